"""Drafting overlapped with verification (PEARL-style "post-verify", Liu et al. 2024).

While the target verifies a block on a worker thread, the calling thread lets the draft go on
from the optimistic assumption that the whole block is accepted: it drafts the token it expects
the target to add and the next block after it (the *look-ahead*). If the target accepts the
whole block and its next token is the draft's guess, the look-ahead is the next step's block,
already drafted (a *hit*: that step's draft time was hidden behind the verify call); otherwise
the look-ahead is discarded and the draft rolls back, as after any rejection.

ONNX Runtime releases the GIL inside ``Run``, so the two models run at once on two cores (or a
GPU target and a CPU draft). Exactness is untouched: the target still verifies every token, and
the look-ahead is only ever a proposal. For sampled rows a hit is decided by the usual
accept/reject test of the guess against the target's distribution at the bonus position (not by
equality with a fresh draw), which keeps the output distribution exact and hits more often.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class VerifyThread:
    """One worker thread that runs the target's calls, so the caller can draft meanwhile."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-verify")

    def submit(self, fn: Callable, *args) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def lookahead_length(k: int) -> int:
    """Tokens to hold beyond the committed ones after a step's look-ahead: the block being
    verified (k), the guess for the target's next token (1), and a whole next block (k)."""
    return 2 * k + 1

