"""What a speculative step costs on this machine: the measured figures both "auto" policies
decide from, and the in-loop corrections they learn on top.

Choosing K (or a tree) needs the target's time T(B, S) for B sequences of S new tokens and the
draft's step time c(B), and neither is a constant ratio: T grows slowly with S while the weights
are the bottleneck and steeply once compute is (wide batches), so the figures are measured with
a few calls per engine (:func:`measure_cost_model`, :func:`measure_width`) instead of assumed.
Widths between the measured ones (powers of two and the batch size, :func:`batch_widths`) are
interpolated. Micro-benchmarks run on warm caches, while in the loop each model's calls follow
the other's (draft calls measured 1.2-1.5x, a step's first one 2-3x their warm figure): the
policies learn those ratios as scales (:func:`learn_scale`, :func:`learn_drafting`) rather than
folding them into a constant per-step overhead, which would mis-price long blocks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specdec_rt.runtime.core.masks import causal_mask
from specdec_rt.runtime.engines.ort import OrtEngine


def expected_chain_tokens(accept, k_max: int) -> np.ndarray:
    """E[tokens | K] = 1 + sum_{i<=K} prod_{j<=i} a_j for K = 0..k_max (a chain's tokens per step
    under per-position acceptance ``accept``)."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(accept[:k_max]))])


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
    sizes = [s for s in sizes if s < engine.max_len] or [1]  # a tiny context: the curve extrapolates
    past = max(0, min(past, engine.max_len - max(sizes) - 1))
    seqs = list(range(width))
    engine.reset()
    pos = np.arange(past)
    for q in seqs:
        if past:
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


# T(S) is measured for S = 1..16 and then at a few widths up to MAX_VERIFY_ROWS (interpolated in
# between): suffix drafts copy spans of 32 tokens where the answer repeats the prompt, and on
# exports whose verify cost is flat (w8a8 on int8 GEMM hardware) such a block costs little more
# than one token, which a curve extrapolated from S <= 16 cannot tell
DENSE_ROWS = 16
MAX_VERIFY_ROWS = 33  # a 32-token draft plus the target's own token
WIDE_ROWS = (20, 24, 28, MAX_VERIFY_ROWS)


def measure_cost_model(target: OrtEngine, draft: OrtEngine | None, max_s: int = MAX_VERIFY_ROWS,
                       clock=time.perf_counter) -> CostModel:
    # ~0.3 s on the reference pair; min over 11 round-robin passes shrugs off a noisy moment
    dense = list(range(1, min(max_s, DENSE_ROWS) + 1))
    t = measure_engine(target, dense, past=128, reps=11, clock=clock)
    wide = [s for s in WIDE_ROWS if DENSE_ROWS < s <= max_s and s < target.max_len]
    if wide and len(t) == len(dense):  # fewer passes: a wide call is long, and the policy needs its level, not its last bit
        tw = measure_engine(target, wide, past=128, reps=5, clock=clock)
        xs = dense + wide
        t = [float(v) for v in np.maximum.accumulate(np.interp(np.arange(1, xs[-1] + 1), xs, t + tw))]
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


def learn_scale(scale: float, measured: float | None, modelled: float, high: float = 4.0) -> float:
    """One EMA step of a model's in-loop cost over its micro-benchmarked one (``measured`` /
    ``modelled``, clipped to [0.5, ``high``] so that one descheduled call cannot swamp it);
    unchanged when the call was not timed."""
    if measured is None or modelled <= 0:
        return scale
    return 0.95 * scale + 0.05 * min(max(measured / modelled, 0.5), high)


def first_call_scale(policy) -> float:
    """A drafting step's first call over its micro-benchmark (either policy): ``draft_scale``
    until a drafter reported the first call's share."""
    return policy.draft_scale if policy.first_draft_scale is None else policy.first_draft_scale


def chain_drafting(policy, k, c: float):
    """Drafting ``k`` tokens in a chain (an int or an array of them) at ``c`` per micro-benchmarked
    call (either policy): the first call at :func:`first_call_scale`, the others at ``draft_scale``."""
    return c * (k * policy.draft_scale + (first_call_scale(policy) - policy.draft_scale) * (k > 0))


def learn_drafting(policy, draft_seconds: float | None, first_share: float | None,
                   first_modelled: float, rest_modelled: float) -> None:
    """Fold one step's drafting time into ``policy.first_draft_scale`` and ``policy.draft_scale``
    (either policy): with the drafter's ``first_share`` the first call and the rest are learned
    apart, without it their sum as one scale."""
    if draft_seconds is None:
        return
    if first_share is None:
        policy.draft_scale = learn_scale(policy.draft_scale, draft_seconds, first_modelled + rest_modelled)
        return
    first = draft_seconds * first_share
    policy.first_draft_scale = learn_scale(first_call_scale(policy), first, first_modelled, high=8.0)
    if rest_modelled > 0:
        policy.draft_scale = learn_scale(policy.draft_scale, draft_seconds - first, rest_modelled)
