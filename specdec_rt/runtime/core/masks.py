"""The additive attention masks every graph call takes: causal chains and speculation trees.

A mask is ``[S, P + S]`` float32 with 0 where a new token may attend and -inf where it may not
(the graphs add it to the attention scores). The loops, the engines, the probes and the
benchmarks all build them here, so the sliding-window rule and the -inf convention live in one
module with no dependency beyond numpy.
"""
from __future__ import annotations

import numpy as np

NEG_INF = np.float32(-np.inf)

_TRIU: dict[int, np.ndarray] = {}


def causal_mask(past_len: int, positions: np.ndarray, sliding_window: int | None = None) -> np.ndarray:
    """Additive mask [S, P+S] for a chain of new tokens at ``positions`` after ``past_len``."""
    s = len(positions)
    if sliding_window and int(positions[-1]) >= sliding_window:
        key_pos = np.concatenate([np.arange(past_len), positions])
        allowed = (key_pos[None, :] <= positions[:, None]) & (
            (positions[:, None] - key_pos[None, :]) < sliding_window)
        return np.where(allowed, np.float32(0), NEG_INF).astype(np.float32, copy=False)
    mask = np.zeros((s, past_len + s), dtype=np.float32)
    if s > 1:
        block = _TRIU.get(s)
        if block is None:
            block = _TRIU[s] = np.triu(np.full((s, s), NEG_INF, dtype=np.float32), 1)
        mask[:, past_len:] = block
    return mask


def tree_mask(past_len: int, region: np.ndarray, positions: np.ndarray,
              sliding_window: int | None = None, new_block: np.ndarray | None = None) -> np.ndarray:
    """Additive mask for tree nodes at ``positions``.

    Columns: ``past_len`` committed positions (0..past_len-1, all visible, subject to the
    sliding window), then ``region`` (earlier tree slots, visibility given), then the new block
    (``new_block`` visibility, identity if None).
    """
    s = len(positions)
    prefix = np.ones((s, past_len), dtype=bool)
    if sliding_window:
        prefix &= (positions[:, None] - np.arange(past_len)[None, :]) < sliding_window
    block = np.eye(s, dtype=bool) if new_block is None else new_block
    allowed = np.concatenate([prefix, region, block], axis=1)
    return np.where(allowed, np.float32(0), NEG_INF).astype(np.float32, copy=False)
