"""What the decoding loop works on: rows (one sequence each), their limits and sampling, and the
K policy interface. Its own module so that drafters, the loop and sessions share these types
without importing each other."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from specdec_rt.runtime.core.sampling import SamplingParams
from specdec_rt.runtime.core.stats import GenerationStats


@dataclass
class DraftReport:
    """How a drafter's last :meth:`~Drafter.propose` went, for the K policies' cost learning:
    ``seconds`` spent, the share of it in the first draft call (``first_call_share``; None: not
    measured or nothing drafted), and whether it caught up more than a step's tokens
    (``long_catch_up``: a prompt or a re-entry after steps without drafting; prefill work, not
    what a drafting step costs, so the policies learn nothing from that step)."""

    seconds: float = 0.0
    first_call_share: float | None = None
    long_catch_up: bool = False


@dataclass
class StepReport:
    """What verification did to one row's proposal, passed back to the drafter: ``tokens`` are
    the row's committed tokens followed by any look-ahead still valid (overlap), ``proposed``
    and ``accepted`` count this step's drafts."""

    seq: int
    tokens: list[int]
    proposed: int = 0
    accepted: int = 0


WAIT = object()
"""A row source (:func:`run_batch`'s ``rows``) may yield ``WAIT``: no row to admit now, ask again
after the next step (a server's queue that is empty while rows are decoding)."""


class DraftLengthPolicy(Protocol):
    """Chooses K for each step of a batch of ``width`` rows; learns from every row's outcome
    (:meth:`observe`) and from what each whole step cost on its ``clock`` (:meth:`observe_step`:
    the in-loop calibration of its cost model)."""

    clock: Callable[[], float]

    def choose(self, width: int) -> int: ...

    def observe(self, proposed: int, accepted: int) -> None: ...

    def observe_step(self, k: int, seconds: float, width: int = 1, draft_seconds: float | None = None,
                     verify_seconds: float | None = None, first_draft_share: float | None = None) -> None: ...


@dataclass
class LoopConfig:
    """What one row was asked (budget, sampling, EOS): K and its policy are the loop's, one
    value for every row of a step (:class:`~specdec_rt.runtime.loop.speculative.BatchLoop`)."""

    max_new_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    user: str | None = None  # who asked (OpenAI's ``user``): selects a suffix pool, nothing else


@dataclass
class Row:
    """One sequence of a batch: what it was asked, and where it stands.

    ``finished`` is set by the loop ("length", "eos", "context", "error") or by whoever consumes
    the loop's output ("stop", "cancelled"): the row then leaves the batch before the next step.
    """

    prompt: list[int]
    cfg: LoopConfig
    rng: np.random.Generator
    stats: GenerationStats
    index: int = 0  # the caller's name for it (position in the prompt list)
    seq: int = -1  # its sequence in the engines' caches, while in the batch
    tokens: list[int] = field(default_factory=list)  # prompt + committed tokens
    finished: str | None = None
    error: Exception | None = None
    clock: StepClock | None = None
    # drafted past the committed tokens, not verified yet: this step's block and, with overlap,
    # the look-ahead beyond it; ahead_q: their draft probabilities as blocks of rows [n, V]
    # (sampled rows of a model drafter; empty for deterministic proposals)
    ahead: list[int] = field(default_factory=list)
    ahead_q: list[np.ndarray] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return self.stats.new_tokens

    def q_rows(self, n: int) -> np.ndarray | None:
        """Draft probabilities of the first ``n`` tokens ahead ([n, V]), or None if deterministic."""
        if not self.ahead_q or n == 0:
            return None
        first = self.ahead_q[0]
        return first[:n] if len(first) >= n else np.concatenate(self.ahead_q)[:n]

    def drop_ahead(self, n: int) -> None:
        """Forget the first ``n`` tokens ahead (committed now); ``n`` >= len(ahead) clears it."""
        if n >= len(self.ahead):
            self.ahead, self.ahead_q = [], []
            return
        del self.ahead[:n]
        while n and self.ahead_q:
            first = self.ahead_q[0]
            if len(first) > n:
                self.ahead_q[0] = first[n:]
                break
            n -= len(first)
            self.ahead_q.pop(0)


def draft_room(target, seq: int) -> int:
    """Drafts a step may verify on cache sequence ``seq`` of ``target`` without ending where plain
    decoding does not: plain decoding stops once the committed tokens fill the context
    (``max_len``), so a step that accepts every draft and adds the target's own token must stay
    within it (the K/V then holds ``max_len - 1`` positions, as plain decoding's last step leaves it)."""
    return max(0, target.max_len - target.lengths[seq] - 2)


@dataclass
class RowView:
    """A row as a drafter sees it when drafting past its committed tokens and the tokens
    already ahead of them (the drafter reads ``tokens``, ``cfg``, ``rng`` and ``seq``)."""

    tokens: list[int]
    cfg: LoopConfig
    rng: np.random.Generator
    seq: int


class StepClock:
    """Decode-time accounting shared by the chain and tree loops (one per row)."""

    def __init__(self, target, drafter, t_start: float) -> None:
        """``target``: the target engine; ``drafter``: the drafter (its ``engine``, if any, is
        timed too); both report ``model_time``, their seconds inside ONNX Runtime."""
        self.engines = [e for e in (target, getattr(drafter, "engine", None)) if e is not None]
        self.t_start = t_start
        self.model_t0 = self._model_time()

    def _model_time(self) -> float:
        return sum(e.model_time for e in self.engines)

    def commit(self, stats: GenerationStats, tokens: list[int], new: list[int], drafter, seq: int = 0,
               ahead: list[int] | None = None, proposed: int = 0, accepted: int = 0) -> None:
        """Append one step's tokens, tell the drafter what verification kept (with what it drafted
        ``ahead`` of them), refresh the stats."""
        tokens.extend(new)
        if drafter is not None:
            drafter.observe(StepReport(seq, tokens + ahead if ahead else tokens, proposed, accepted))
        stats.new_tokens += len(new)
        stats.time_total = time.perf_counter() - self.t_start
        stats.time_in_models = self._model_time() - self.model_t0
