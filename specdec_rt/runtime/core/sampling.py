"""Logit processing and the speculative acceptance rules.

Temperature, top-k and top-p shape the draft's q and the target's p *identically* before the
acceptance test; the output then follows the processed target distribution exactly (Leviathan et
al. 2023, Chen et al. 2023). Shaping only p, or shaping them differently, silently changes the
output distribution (transformers #47932).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from specdec_rt.errors import SamplingParamsError  # noqa: F401 - defined there, re-exported here


def _finite(x: int | float) -> bool:
    """A finite float, or an int a float can hold (``np.isfinite`` raises TypeError on ints past
    int64, ``math.isfinite`` OverflowError past float's range)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or not _finite(t) or t < 0:
            raise SamplingParamsError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise SamplingParamsError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not isinstance(p, (int, float)) or not _finite(p) or not 0 < p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1] (1 = off), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Rows of logits [n, V] -> processed probabilities [n, V] (float64, rows sum to 1).

    With top-k (transformers' default is 50 whenever it samples) the exponentials and the top-p
    sort run over each row's k kept tokens only (ties at the k-th value kept, as transformers'
    warper keeps them), not over the whole vocabulary: the same probabilities (the same sums of
    the same terms), measured 3-5x faster on [5, 4096] rows (~1.1 ms -> ~0.2 ms with top-p), a
    cost every sampled step pays for the verify rows and each drafted token.
    """
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    n, v = x.shape
    keep = None
    if 0 < params.top_k < v:
        kth = np.partition(x, v - params.top_k, axis=-1)[:, v - params.top_k][:, None]
        keep = x >= kth
    x -= x.max(axis=-1, keepdims=True)
    if keep is None:
        probs = np.exp(x)
    else:  # exp(-inf) = 0 outside the kept tokens: write the zeros, exponentiate the rest
        probs = np.zeros_like(x)
        np.exp(x, out=probs, where=keep)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        for r in range(n):
            # candidates in index order, so the stable sort breaks ties as over the whole row
            cand = np.arange(v) if keep is None else np.flatnonzero(keep[r])
            p = probs[r, cand]
            order = np.argsort(-p, kind="stable")
            sorted_p = p[order]
            cum = np.cumsum(sorted_p)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            dropped = cand[order[(cum - sorted_p) >= params.top_p]]
            probs[r, dropped] = 0.0
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector (inverse CDF; faster than rng.choice)."""
    cdf = np.cumsum(probs)
    idx = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(idx, len(probs) - 1)


def draft_token(logits: np.ndarray, params: SamplingParams,
                rng: np.random.Generator) -> tuple[int, np.ndarray | None]:
    """A drafter's pick from one row of its logits: the argmax when greedy, else a sample from
    its distribution, returned too (the q the sampled verification needs)."""
    if params.greedy:
        return int(np.argmax(logits)), None
    q = probabilities(logits[None, :], params)[0]
    return sample(q, rng), q


def accept_chain_sampled(p: np.ndarray, q: np.ndarray | None, drafts: list[int],
                         rng: np.random.Generator) -> tuple[int, int]:
    """Speculative sampling over a chain.

    p: target probabilities [k+1, V]; q: draft probabilities [k, V] (None: the drafter is
    deterministic, i.e. q is a point mass on each draft token). Returns (accepted count, next
    token): the next token is drawn from the residual max(0, p - q) at the first rejection, or
    from p[k] when every draft token is accepted. ``drafts`` may hold one token more than p has
    rows to verify after (k + 1 drafts against p [k+1, V]: the overlapped loop's guess at the
    bonus position); if all are accepted there is no row left to draw from and the next token
    is -1 (none: the last accepted draft ends the step).
    """
    for i, d in enumerate(drafts):
        pi = p[i]
        qd = 1.0 if q is None else q[i, d]
        if qd > 0 and rng.random() * qd < pi[d]:
            continue
        if q is None:
            residual = pi.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(pi - q[i], 0.0)
        total = residual.sum()
        return i, sample(residual if total > 0 else pi, rng)
    if len(drafts) == len(p):
        return len(drafts), -1
    return len(drafts), sample(p[len(drafts)], rng)


def accept_chain_greedy(target_argmax: np.ndarray, drafts: list[int]) -> tuple[int, int]:
    """Accept while the draft equals the target's argmax; then the target's own token."""
    n = 0
    for d in drafts:
        if target_argmax[n] != d:
            break
        n += 1
    return n, int(target_argmax[n])
