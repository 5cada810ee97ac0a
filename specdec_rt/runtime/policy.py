"""Cost-model-driven draft length (``num_draft_tokens="auto"``).

Per step of a batch of B sequences, choose K in [0, k_max] maximizing expected tokens per second:

    E[tokens | K] = 1 + sum_{i=1..K} prod_{j<=i} a_j            (a_j: P(accept j | accepted j-1))
    time(K)       = K * c_draft(B) + T(B, K + 1)                  (T(B, S): target time for B x S tokens)

This is Leviathan et al.'s speedup formula generalised to per-position acceptance and a measured
T(B, S) surface instead of a constant-cost assumption (the batch's rate is B E / time, so the
same argmax). The a_j are running estimates (exponential moving average over verify calls of
every sequence, persisted across generations). T(1, S) and c_draft(1) are measured once per
generator (a few target / draft calls), T(B, S) and c_draft(B) once per batch width B (powers
of two and the batch size, interpolated in between). Wide batches make verification costlier
per extra draft position (T(B, S) grows with B x S once the weights are no longer the bottleneck)
while the draft's cost per step hardly changes, which is how the policy learns shorter K for
wide batches. A second, cheaper rule works inside a step:
the drafter stops early when the draft's own confidence (the product of its top
probabilities) says the next token is not worth its cost.

Overlapped decoding (:mod:`specdec_rt.runtime.overlap`) hides a step's drafting behind the
previous verify call whenever the previous step's look-ahead survived, which happens with
probability h(K) = a_1 ... a_{K+1} (all K accepted and the guess at the bonus position too), so

    time(K) = (1 - h(K)) * K * c_draft(B) + T(B, K + 1)

(T measured on the overlapped generator's own target session). A shorter block survives more
often, so with a cheap draft the policy may pick a shorter K than without overlap, and with a
costly, well-agreeing draft a longer one (more drafting to hide).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specdec_rt.runtime.engine import OrtEngine, causal_mask
from specdec_rt.runtime.overlap import hit_probability


@dataclass
class CostModel:
    """Measured target time T(B, S) (B sequences of S new tokens each per call) and draft step
    time c(B), for the batch widths measured so far.

    ``target_times`` / ``draft_step`` are the one-sequence figures (B = 1); ``widths`` maps a
    width B > 1 to its (T(B, S) for S = 1.., draft step) measurements. Widths between measured
    ones are interpolated linearly in B (per S), wider ones extrapolated from the widest two.
    """

    target_times: list[float]  # T(1, S), index S-1
    draft_step: float  # c(1)
    widths: dict[int, tuple[list[float], float]] = field(default_factory=dict)

    @staticmethod
    def _curve(t: list[float], s: int) -> float:
        if s <= len(t):
            return t[s - 1]
        slope = (t[-1] - t[0]) / max(1, len(t) - 1)
        return t[-1] + slope * (s - len(t))

    def _points(self) -> list[tuple[int, list[float], float]]:
        pts = [(1, self.target_times, self.draft_step)]
        pts += [(b, t, d) for b, (t, d) in sorted(self.widths.items()) if b > 1]
        return pts

    def _at_width(self, width: int, value) -> float:
        pts = self._points()
        if width <= 1 or len(pts) == 1:
            return value(pts[0])
        for lo, hi in zip(pts, pts[1:]):
            if width <= hi[0]:
                break
        f = (width - lo[0]) / (hi[0] - lo[0])
        return max(0.0, (1 - f) * value(lo) + f * value(hi))

    def target(self, s: int, width: int = 1) -> float:
        return self._at_width(width, lambda pt: self._curve(pt[1], s))

    def draft(self, width: int = 1) -> float:
        return self._at_width(width, lambda pt: pt[2])


def measure_engine(engine: OrtEngine, sizes: list[int], past: int = 64, reps: int = 5,
                   width: int = 1, clock=time.perf_counter) -> list[float]:
    """Least-disturbed time of a forward call with ``width`` sequences of S new tokens each
    (S in ``sizes``), every sequence on a ``past``-position cache. ``clock``: wall time by
    default; ``time.process_time`` measures CPU time (single-threaded runs on a shared machine)."""
    past = min(past, engine.max_len - max(sizes) - 1)
    seqs = list(range(width))
    engine.reset()
    pos = np.arange(past)
    for q in seqs:
        engine.forward(np.zeros(past, dtype=np.int64), pos, causal_mask(0, pos), q)
        engine.commit(past, q)
    calls = []
    for s in sizes:
        pos = np.arange(past, past + s)
        calls.append((seqs, [np.zeros(s, dtype=np.int64)] * width))
        engine.forward_rows(*calls[-1])  # warm this shape
    best = [float("inf")] * len(sizes)
    for _ in range(reps):  # round robin over S, so drift on a shared machine hits every S alike
        for i, args in enumerate(calls):
            t0 = clock()
            engine.forward_rows(*args)
            best[i] = min(best[i], clock() - t0)  # the least disturbed run
    out = best
    engine.reset()
    return list(np.maximum.accumulate(out))  # T(S) is non-decreasing; smooth out noise


def measure_cost_model(target: OrtEngine, draft: OrtEngine | None, max_s: int = 16,
                       clock=time.perf_counter) -> CostModel:
    # ~0.3 s on the reference pair; min over 11 round-robin passes shrugs off a noisy moment
    t = measure_engine(target, list(range(1, max_s + 1)), past=128, reps=11, clock=clock)
    d = measure_engine(draft, [1], past=128, reps=21, clock=clock)[0] if draft is not None else 0.0
    return CostModel(target_times=t, draft_step=d)


def measure_width(cost: CostModel, target: OrtEngine, draft: OrtEngine | None, width: int,
                  max_s: int = 13, clock=time.perf_counter) -> None:
    """Add T(width, S) for S = 1..max_s and the draft step at ``width`` to ``cost``."""
    t = measure_engine(target, list(range(1, max_s + 1)), past=128, reps=7, width=width, clock=clock)
    d = measure_engine(draft, [1], past=128, reps=11, width=width, clock=clock)[0] if draft is not None else 0.0
    cost.widths[width] = (t, d)


def batch_widths(max_width: int) -> list[int]:
    """Widths measured for batches of up to ``max_width`` sequences: powers of two and the top."""
    out, b = [], 2
    while b < max_width:
        out.append(b)
        b *= 2
    return out + ([max_width] if max_width > 1 else [])


@dataclass
class AdaptivePolicy:
    cost: CostModel
    k_max: int = 12
    prior: float = 0.6
    decay: float = 0.9  # EMA weight of history per verify call
    accept: list[float] = field(default_factory=list)  # a_j estimates, j = 1..k_max
    probe_every: int = 8  # every this many steps, draft 2 more than the optimum to re-estimate
    # Off by default: measured on the reference pair, the distilled draft is under-confident
    # (top-1 acceptance 0.83 while its top probability is often < 0.5), so the floor cut drafts
    # short and "auto" ran at 1.28x against 1.75x for the best fixed K.
    use_confidence_stop: bool = False
    last_k: int = 0
    overlap: bool = False  # drafting hidden behind verification on look-ahead hits
    _idle: int = 0
    _tested: int = 0  # positions with at least one observation
    _step_times: dict[int, np.ndarray] = field(default_factory=dict)  # per batch width

    def __post_init__(self) -> None:
        if not self.accept:
            self.accept = [self.prior] * self.k_max

    def step_time(self, k: int, width: int = 1) -> float:
        """One step of ``width`` sequences drafting ``k`` tokens each: k draft calls, one verify
        (with overlap, the k draft calls only when the last look-ahead missed)."""
        drafting = k * self.cost.draft(width)
        if self.overlap:
            drafting *= 1.0 - hit_probability(self.accept, k)
        return drafting + self.cost.target(k + 1, width)

    def best_k(self, width: int = 1) -> int:
        """The K maximising expected tokens per second for a batch of ``width`` sequences (each
        sequence expects the same tokens per step, so the batch's rate is ``width`` times it)."""
        ks = np.arange(self.k_max + 1)
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.accept[: self.k_max]))])
        times = None if self.overlap else self._step_times.get(width)
        if times is None:  # costs are fixed once measured: tabulate them once per width
            # (with overlap the step time depends on the acceptance estimates: every time)
            times = self._step_times[width] = np.array([self.step_time(int(k), width) for k in ks])
        return int(np.argmax(tokens / times))

    def update(self, proposed: int, accepted: int) -> None:
        """Fold one verify call's outcome into the per-position estimates.

        Positions never tested yet inherit the deepest tested estimate instead of keeping the
        prior: otherwise a policy that settled on K never learns that K + 2 would pay (measured:
        with a fixed 0.6 prior it stayed at K = 3-5 where K = 7-10 was best).
        """
        for j in range(min(proposed, self.k_max)):
            if j > accepted:
                break  # positions after the first rejection were not tested
            hit = 1.0 if j < accepted else 0.0
            self.accept[j] = self.decay * self.accept[j] + (1 - self.decay) * hit
            self._tested = max(self._tested, j + 1)
        for j in range(self._tested, self.k_max):
            self.accept[j] = self.accept[self._tested - 1]

    def confidence_floor(self) -> float:
        """Stop drafting when prod(draft top-prob) falls below this: the expected gain of one
        more token (that probability, in tokens) is worth less than its cost in token-times."""
        t1 = self.cost.target(1)
        marginal = self.cost.draft_step + (self.cost.target(2) - t1)
        return float(np.clip(marginal / t1, 0.0, 0.9)) if t1 > 0 else 0.0

    def observe(self, proposed: int, accepted: int) -> None:
        """One sequence's verify outcome (every row of a batch reports its own)."""
        if proposed:
            self.update(proposed, accepted)

    def choose(self, width: int = 1) -> int:
        """K for the next step of a batch of ``width`` sequences."""
        k = self.best_k(width)
        # explore: now and then draft two more than the optimum, so estimates of deeper
        # positions (which the chosen K stops testing) can recover after a bad stretch. Every
        # (probe_every x width)-th step: a step of ``width`` rows tests ``width`` sequences at
        # once, and a wide verify call is costly (measured at B = 8 on the reference pair:
        # exploring every 8th step cost ~15% of "auto"'s throughput).
        self._idle += 1
        if self._idle >= self.probe_every * width:
            self._idle, k = 0, min(self.k_max, k + 2)
        self.last_k = k
        return k


def make_policy(generator, drafter: str | None, max_width: int = 1, overlap: bool = False) -> AdaptivePolicy:
    """The generator's policy for this drafter, measured once and kept across generations.

    The cost model is measured once per generator for one sequence, and once per batch width
    the first time a batch of up to ``max_width`` sequences asks (before it starts: measuring
    uses the engines' caches).
    """
    cache = generator.__dict__.setdefault("_policies", {})
    key = (drafter or "none", bool(overlap))
    draft = generator.draft_engine if drafter == "model" else None
    clock = generator.__dict__.get("measure_clock", time.perf_counter)
    cost = generator.__dict__.get("_cost_model")
    if cost is None or (draft is not None and cost.draft_step == 0.0):
        cost = measure_cost_model(generator.target, draft, clock=clock)
        generator._cost_model = cost
    for width in batch_widths(max_width):
        if width not in cost.widths or (draft is not None and cost.widths[width][1] == 0.0):
            measure_width(cost, generator.target, draft, width, clock=clock)
    if drafter != "model":  # prompt lookup: drafting costs (next to) nothing
        cost = CostModel(cost.target_times, 0.0, {b: (t, 0.0) for b, (t, _) in cost.widths.items()})
    policy = cache.setdefault(key, AdaptivePolicy(cost, overlap=bool(overlap)))
    policy.cost = cost  # possibly with more widths than when the policy was made
    policy._step_times = {}
    return policy
