"""The run-time half of specdec-rt: numpy on ONNX Runtime (or TensorRT), no torch.

One sub-package per responsibility; imports run down this list only (a module may import its
own sub-package and those below it), which ``scripts/check_structure.py`` checks in CI:

* :mod:`.api`: ``Generator`` and ``load``, chat templates, prompt limits, warm-up;
* :mod:`.loop`: the speculative step shared by chains, trees, batches and overlap; requests;
  the per-request drafter plan; the policy store a generator keeps;
* :mod:`.drafters`: every proposer (draft model, prompt lookup, suffix, hybrids, EAGLE-3, trees);
* :mod:`.policies`: adaptive K, tree shapes and the cost model they decide from;
* :mod:`.engines`: ONNX Runtime and TensorRT engines, KV caches, sessions, providers, probes,
  the prefix cache and the on-disk cost cache;
* :mod:`.core`: the bundle, tokenizer, rows and reports, sampling rules, stats, masks.

The public names below are importable from here (``from specdec_rt.runtime import RowRequest``)
without loading ONNX Runtime until one is used. The flat module paths of releases before the
split (``specdec_rt.runtime.generator``, ``specdec_rt.runtime.requests``...) still import, as
the moved modules themselves, with a DeprecationWarning naming the new path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

PUBLIC = {
    "load": "api.generator", "Generator": "api.generator", "GenerationResult": "loop.text_output",
    "GenerationStats": "core.stats", "BatchStats": "core.stats", "BatchStream": "loop.batch_session",
    "BatchSession": "loop.batch_session", "RowRequest": "loop.requests",
    "SpeculationConfig": "loop.requests", "SamplingParams": "core.sampling",
    "GenerationDefaults": "core.gen_config", "SuffixPool": "drafters.suffix", "warm_up": "api.warmup",
}
__all__ = sorted(PUBLIC)

# the flat layout's module names and where each module lives now (``drafters`` is the package of
# that name, which re-exports the old module's names itself)
MOVED = {
    "generator": "api.generator", "chat": "api.chat", "warmup": "api.warmup", "limits": "api.limits",
    "speculative": "loop.speculative", "batch_session": "loop.batch_session", "tree": "loop.tree_step",
    "planning": "loop.planning", "overlap": "loop.overlap", "requests": "loop.requests",
    "text_output": "loop.text_output", "policy_store": "loop.policy_store",
    "drafter_names": "drafters.names", "hybrid": "drafters.hybrid",
    "suffix": "drafters.suffix", "suffix_trie": "drafters.suffix_trie", "eagle": "drafters.eagle",
    "tree_drafters": "drafters.tree",
    "policy": "policies.adaptive", "tree_policy": "policies.tree", "tree_shapes": "policies.tree_shapes",
    "cost_model": "policies.cost_model",
    "engine_base": "engines.base", "engine": "engines.ort", "engine_batch": "engines.ort_batch",
    "trt_engine": "engines.trt", "kv_cache": "engines.kv_cache", "window_binding": "engines.window_binding",
    "probes": "engines.probes", "prefix_cache": "engines.prefix_cache", "sessions": "engines.sessions",
    "providers": "engines.providers", "factory": "engines.factory", "cost_cache": "engines.cost_cache",
    "bundle": "core.bundle", "tokenizer": "core.tokenizer", "sampling": "core.sampling", "stats": "core.stats",
    "rows": "core.rows", "masks": "core.masks", "memory": "core.memory", "gen_config": "core.gen_config",
    "errors": "specdec_rt.errors",
}


def moved_to(old: str) -> str:
    """The full module path a flat-layout module name now has."""
    new = MOVED[old]
    return new if new.startswith("specdec_rt.") else f"{__name__}.{new}"


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``specdec_rt.runtime.<old name>`` to the moved module itself (same object, so
    ``isinstance`` checks and monkeypatching see one module), warning once per import."""

    def find_spec(self, fullname, path=None, target=None):
        parent, _, leaf = fullname.rpartition(".")
        if parent != __name__ or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        old = spec.name.rpartition(".")[2]
        new = moved_to(old)
        warnings.warn(f"{spec.name} moved to {new}; import it from there (or the public names from "
                      f"{__name__})", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """The moved module ran when it was imported under its own name."""


if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(MovedModuleFinder())


def __getattr__(name: str):
    if name in PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
