"""The prefix cache: a prompt that starts with what a cache sequence still holds keeps those
positions' K/V, and only the rest is prefilled.

Multi-turn chats and agents re-send their whole history every turn; prefilling it again cost
~3.5 s a turn on 2 cores at 1.5B int4, ~40% of a code-edit session's time. The K/V a
sequence holds were written while its last turn was decoded (verify and plain-step calls), not
by a prompt chunk, so reuse is exact only where the target computes a position's K/V bit for
bit alike in both: :func:`~specdec_rt.runtime.engines.probes.probe_prefix_reuse` measures that at load
(its verdict is kept on disk per bundle and machine, :mod:`specdec_rt.runtime.engines.cost_cache`), and
the engine reuses only at the padding it was probed with. The bookkeeping (which tokens a
sequence holds, what a prompt may keep) is :class:`~specdec_rt.runtime.engines.base.EngineBase`'s;
the loop's prefill (:func:`~specdec_rt.runtime.loop.speculative.prefill`) asks it, and batches put a
request on the free sequence holding the most of its prompt.
"""
from __future__ import annotations

from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.engines import cost_cache
from specdec_rt.runtime.engines.base import EngineBase
from specdec_rt.runtime.engines.probes import probe_prefix_reuse


def check_setting(setting) -> None:
    """``load(prefix_cache=...)``: True (reuse between any requests), "per-user" (only between
    requests of the same ``user``: a hit shows in the time to first token) or False."""
    if not (setting is True or setting is False or setting == "per-user"):
        raise GenerationInputError(f"prefix_cache must be True, False or 'per-user', got {setting!r}")


def enable_prefix_cache(target: EngineBase, manifest: dict, graph: str, setting, probe: bool = True) -> bool:
    """Turn reuse on for ``target`` (the bundle's target graph ``graph``) where it is exact on
    this machine: the probe's verdict, from disk when measured here before (``probe`` False: an
    engine the probe does not drive, reuse off). Returns it."""
    check_setting(setting)
    if not setting or not probe:
        target.prefix_reuse = False
        return False
    key = cost_cache.probe_key(manifest, graph, target, "prefix_reuse")
    known = cost_cache.load_probe(key)
    if known is None:
        cost_cache.save_probe(key, probe_prefix_reuse(target))
    else:
        target.prefix_reuse, target.prefix_rows = known, target.min_rows
    target.prefix_per_owner = setting == "per-user"
    return target.prefix_reuse
