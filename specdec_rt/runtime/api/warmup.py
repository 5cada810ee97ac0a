"""Warm-up: pay at load what the first requests would otherwise pay.

A fresh generator's first "auto" generation measures (or reads back from disk) the cost model,
its first batched call measures the batch widths, and ONNX Runtime allocates on the first call of
every input shape. Measured on the reference pair (2 cores): the first ``generate_batch`` of 8
rows x 64 tokens took 1.53 s against 0.35 s warm without the on-disk cost model, 0.43 s with it.
:func:`warm_up` runs those once, with a fixed K (so no policy learns from its throw-away
prompts), and the server reports itself ready only afterwards.
"""
from __future__ import annotations

import time
from typing import Protocol

from specdec_rt.runtime.loop.policy_store import PolicyStore

WARM_TOKENS = 8


class WarmableGenerator(Protocol):
    """What warming needs of a :class:`~specdec_rt.runtime.api.generator.Generator` (which imports
    this module, so it is not imported here)."""

    max_batch: int
    draft_engine: object | None
    policies: PolicyStore
    exact_trees: bool

    def generate_ids(self, prompt_ids, **kwargs) -> list[int]: ...

    def generate_batch(self, prompts, max_new_tokens: int = 128, **kwargs) -> list: ...


def warm_up(gen: WarmableGenerator, max_batch: int | None = None, tree: bool = True) -> dict[str, float]:
    """Measure or load the cost model for batches of up to ``max_batch`` rows (default: the
    generator's), then decode a few tokens target-only, speculatively with each drafter the
    bundle supports, batched at that width and (``tree``) as a tree. Returns the seconds each
    part took."""
    width = max(1, min(max_batch or gen.max_batch, gen.max_batch))
    has_draft = gen.draft_engine is not None
    drafter = "model" if has_draft else "prompt_lookup"
    spent: dict[str, float] = {}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        spent[name] = time.perf_counter() - t0

    prompt = list(range(1, 17))  # any valid ids: only shapes and code paths matter here
    timed("cost_model", lambda: gen.policies.chain(drafter, width))
    run = dict(max_new_tokens=WARM_TOKENS, temperature=0.0, ignore_eos=True)
    timed("target_only", lambda: gen.generate_ids(prompt, drafter=None, **run))
    timed("chain", lambda: gen.generate_ids(prompt, drafter=drafter, num_draft_tokens=2, **run))
    if width > 1:
        timed("batch", lambda: gen.generate_batch([prompt[: 8 + i % 8] for i in range(width)], drafter=drafter,
                                                  num_draft_tokens=2, **run))
    if tree and has_draft and gen.exact_trees:
        timed("tree", lambda: (gen.policies.tree(),
                               gen.generate_ids(prompt, speculation="tree", num_draft_tokens=6, **run)))
    return spent
