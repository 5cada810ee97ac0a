"""Prompt lookup where it matches, the draft model elsewhere: ``drafter="hybrid"`` (and
``drafter="suffix_hybrid"``: the suffix drafter where its match is strong, the model elsewhere).

On a real pair the two drafters pay in different places (Spec-Bench, Qwen2.5-Coder 1.5B + 0.5B
int4 on 2 cores): lookup costs nothing to draft and wins where answers copy from the prompt
(summarization, extraction, QA over a context), the 0.5B draft costs a third of a target call
and only wins where it agrees long enough (code, math). Each step, a row whose last n-gram
occurs earlier in its tokens takes lookup's proposal; the others ask the draft model. Output is
exact either way: both only propose.

With ``num_draft_tokens="auto"`` each source has its own :class:`AdaptivePolicy` (its own
acceptance estimates and its own price per drafted token: zero for lookup), and a source whose
drafting does not pay drafts nothing (K = 0): the hybrid then decodes as target-only. The
policy hears each row's outcome in the order the drafter proposed (the loop reports rows in
order), so the two learn apart.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from specdec_rt.runtime.drafters.base import Drafter, DraftReport, ModelDrafter, PromptLookupDrafter, StepReport

if TYPE_CHECKING:
    from specdec_rt.runtime.core.rows import Row
    from specdec_rt.runtime.drafters.suffix import SuffixGoodput
    from specdec_rt.runtime.policies.adaptive import AdaptivePolicy

LOOKUP, MODEL = "prompt_lookup", "model"


class HybridPolicy:
    """Two adaptive policies, one per source; the drafter asks for each one's K."""

    def __init__(self, lookup: AdaptivePolicy | SuffixGoodput, model: AdaptivePolicy) -> None:
        self.lookup, self.model = lookup, model
        self.clock = model.clock
        self.k = {LOOKUP: 0, MODEL: 0}
        self.sources: deque[str] = deque()  # per proposing row, in order: who proposed
        self.step_source: str | None = None  # the one source of the last step's proposals, if one
        self.last_k = 0

    def choose(self, width: int = 1) -> int:
        self.k = {LOOKUP: self.lookup.choose(width), MODEL: self.model.choose(width)}
        self.sources.clear()
        self.step_source = None
        self.last_k = max(self.k.values())
        return self.last_k

    def _policy(self, source: str) -> AdaptivePolicy | SuffixGoodput:
        return self.lookup if source == LOOKUP else self.model

    def observe(self, proposed: int, accepted: int) -> None:
        if self.sources:
            self._policy(self.sources.popleft()).observe(proposed, accepted)

    def observe_step(self, k: int, seconds: float, width: int = 1, **measured) -> None:
        """A step's cost teaches the source that drafted it (steps mixing both teach nothing); a
        step without drafting teaches both what a plain call costs at this context."""
        if k <= 0:
            self.lookup.observe_step(k, seconds, width, **measured)
            self.model.observe_step(k, seconds, width, **measured)
        elif self.step_source is not None:
            self._policy(self.step_source).observe_step(k, seconds, width, **measured)


class HybridDrafter:
    """The free drafter's proposal where it has one, else the draft model's (see module doc).

    ``lookup``: the free source, a drafter that proposes nothing where it has no (strong enough)
    match: prompt lookup (``name`` "hybrid") or the suffix drafter ("suffix_hybrid")."""

    def __init__(self, model: ModelDrafter, lookup: Drafter | None = None,
                 policy: HybridPolicy | None = None, name: str = "hybrid") -> None:
        self.name = name
        self.model = model
        self.lookup = lookup or PromptLookupDrafter()
        self.policy = policy  # None: both sources draft up to the loop's fixed K
        self.calls = 0
        self.time = 0.0
        self.lookup_proposals = 0  # rows that took lookup's proposal (statistics)
        self.model_proposals = 0

    @property
    def report(self) -> DraftReport:
        """The model's report when it drafted this step, else lookup's (free; no catch-up)."""
        return self.model.report if self._used_model else self.lookup.report

    _used_model = False

    def begin(self, prompt: list[int], seq: int = 0) -> None:
        self.lookup.begin(prompt, seq)
        self.model.begin(prompt, seq)

    def observe(self, step: StepReport) -> None:
        self.lookup.observe(step)
        self.model.observe(step)

    def end(self, seq: int = 0) -> None:
        self.lookup.end(seq)
        self.model.end(seq)

    def propose(self, rows: list[Row], ks: list[int]) -> list[tuple[list[int], np.ndarray | None]]:
        k_lookup = k_model = None
        if self.policy is not None:
            k_lookup, k_model = self.policy.k[LOOKUP], self.policy.k[MODEL]
        out: list[tuple[list[int], np.ndarray | None] | None] = [None] * len(rows)
        sources: list[str | None] = [None] * len(rows)
        ask, ask_k = [], []
        free = self.lookup.propose(rows, [k if k_lookup is None else min(k, k_lookup) for k in ks])
        for i, (row, k, (found, _)) in enumerate(zip(rows, ks, free)):
            if found:
                out[i], sources[i] = (found, None), LOOKUP
                continue
            km = k if self.policy is None else min(k, k_model)
            if km > 0:
                ask.append(i)
                ask_k.append(km)
            else:
                out[i] = ([], None)
        self._used_model = bool(ask)
        if ask:
            for i, prop in zip(ask, self.model.propose([rows[i] for i in ask], ask_k)):
                out[i], sources[i] = prop, MODEL
        self.lookup_proposals += sum(s == LOOKUP for s in sources)
        self.model_proposals += sum(s == MODEL for s in sources)
        if self.policy is not None:
            used = [s for s, (d, _) in zip(sources, out) if s is not None and d]
            self.policy.sources.extend(used)
            self.policy.step_source = used[0] if used and all(s == used[0] for s in used) else None
        self.calls = self.model.calls
        self.time = self.model.time + self.lookup.time
        return out  # type: ignore[return-value]
