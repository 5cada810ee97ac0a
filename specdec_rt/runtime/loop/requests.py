"""The request layer: how to speculate (:class:`SpeculationConfig`) and what one sequence asks
(:class:`RowRequest`), validated once, where a request enters (the Python API, the CLIs, the
server), so the loop below never re-checks its arguments."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.core.gen_config import GenerationDefaults
from specdec_rt.runtime.core.rows import LoopConfig
from specdec_rt.runtime.core.sampling import SamplingParams
from specdec_rt.runtime.drafters.names import DRAFTERS, NO_OVERLAP, SPECULATIONS

MAX_DRAFT_TOKENS = 64


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


@dataclass(frozen=True)
class SpeculationConfig:
    """How a generation speculates (one per call, or per batch: its rows share it).

    ``num_draft_tokens``: K, 0..64, or ``"auto"`` (the cost-model policy; trees: the shape policy,
    or a node budget when an integer); ``drafter``: "auto" (the default: the drafter this bundle
    drafts best with on this machine, :meth:`~specdec_rt.runtime.loop.policy_store.PolicyStore.auto_drafter`),
    "model", "prompt_lookup", "hybrid", "suffix", "suffix_hybrid", "eagle" (the bundle's EAGLE-3
    head) or None ("none") for target-only decoding; ``speculation``: "chain" or "tree";
    ``overlap``: draft the next block while the target verifies (None: the generator's default);
    ``tree_shape``: a fixed tree template or shape (trees only).
    """

    num_draft_tokens: int | str = "auto"
    drafter: str | None = "auto"
    speculation: str = "chain"
    overlap: bool | None = None
    tree_shape: object = None

    def __post_init__(self) -> None:
        if self.drafter == "none":
            object.__setattr__(self, "drafter", None)
        if self.overlap is not None and not isinstance(self.overlap, (bool, np.bool_)):
            raise GenerationInputError(f"overlap must be True, False or None, got {self.overlap!r}")
        if self.overlap and self.speculation == "tree":
            raise GenerationInputError("overlap=True drafts ahead of a chain; it does not apply to "
                                       "speculation='tree'")
        if self.drafter in NO_OVERLAP and self.overlap:
            raise GenerationInputError(f"drafter='{self.drafter}' does not draft ahead: use overlap=False with it")
        k = self.num_draft_tokens
        if k != "auto" and not (_is_int(k) and 0 <= k <= MAX_DRAFT_TOKENS):
            raise GenerationInputError(f"num_draft_tokens must be 0..{MAX_DRAFT_TOKENS} or 'auto', got {k!r}")
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise GenerationInputError(f"unknown drafter '{self.drafter}'; choose one of {DRAFTERS} or None")
        if self.speculation not in SPECULATIONS:
            raise GenerationInputError(f"speculation must be 'chain' or 'tree', not {self.speculation!r}")

    @property
    def auto(self) -> bool:
        return self.num_draft_tokens == "auto"


@dataclass
class RowRequest:
    """What one sequence asks: its prompt (text or token ids), limits, sampling and stops.
    Sampling values left as None take the bundle's defaults (:class:`GenerationDefaults`)."""

    prompt: str | Sequence[int]
    max_new_tokens: int = 128
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool | None = None
    seed: int | None = None
    stop: Sequence[str] | str | None = None
    ignore_eos: bool = False
    user: str | None = None

    FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "do_sample", "ignore_eos", "user")

    @property
    def stops(self) -> list[str]:
        """The stop strings, checked: each a non-empty string (an empty one would end every
        generation at once)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x for x in stops):
            raise GenerationInputError(f"stop must be a non-empty string or a list of them (an empty one "
                                       f"would end every generation at once), got {self.stop!r}")
        return list(stops)

    def loop_config(self, defaults: GenerationDefaults, eos_token_ids: Sequence[int]) -> LoopConfig:
        """The row's limits and sampling for the loop, validated, bundle defaults applied."""
        n = self.max_new_tokens
        if not _is_int(n) or n < 1:
            raise GenerationInputError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        temperature, top_k, top_p = defaults.resolve(self.temperature, self.top_k, self.top_p, self.do_sample)
        SamplingParams(temperature, top_k, top_p)  # validates before converting
        params = SamplingParams(float(temperature), int(top_k), float(top_p))
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise GenerationInputError(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        _ = self.stops  # checked before anything decodes, whoever reads them later
        if self.user is not None and not isinstance(self.user, str):
            raise GenerationInputError(f"user must be a string or None, got {type(self.user).__name__}")
        return LoopConfig(max_new_tokens=int(n), params=params, eos_token_ids=tuple(eos_token_ids),
                          ignore_eos=bool(self.ignore_eos), user=self.user)
