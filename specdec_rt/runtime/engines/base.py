"""The cache bookkeeping every engine shares, whatever runs its graph (ONNX Runtime or TensorRT).

:class:`EngineBase` holds each sequence's committed length and implements commit, rollback,
compaction, chunked prefill and the one-token step on top of a subclass's ``forward``. It is
its own module so that both engines (:mod:`specdec_rt.runtime.engines.ort`,
:mod:`specdec_rt.runtime.engines.trt`) can derive from it without importing each other.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from specdec_rt.runtime.core.masks import causal_mask
from specdec_rt.runtime.engines.kv_cache import KVCache

# Long inputs (prompts) run in chunks of this many tokens: graphs without ``logits_to_keep`` (and
# IO-bound engines) return logits for every row, and a 4k-token prompt over a 152k vocabulary
# would otherwise need a 2.5 GB logits tensor.
PREFILL_CHUNK = 256
# extend keeps the last rows' logits only (``logits_to_keep``) from this many tokens on; shorter
# calls (a draft's catch-up of the 1-3 tokens a verify accepted) compute every row, which costs
# little there and keeps them on the draft's windowed bindings, which bind the contract only
KEEP_LAST_FROM = 8


_STAMPS = itertools.count(1)  # HeldPrefix.stamp: increasing, so larger is more recently tracked


@dataclass
class HeldPrefix:
    """The tokens whose K/V fill a sequence's first ``min(len(tokens), length)`` positions, who
    asked for them, and when (a stamp for least-recently-used choices)."""

    tokens: list[int]
    owner: str | None
    stamp: int


class EngineBase:
    """The cache bookkeeping every engine shares: ``lengths[s]`` committed positions of sequence
    ``s`` in ``cache`` (one sequence unless the engine was built for batches, ``max_batch``).

    Every method takes the sequence it acts on (``seq``, default 0: the one-sequence API, where
    ``length`` is ``lengths[0]``). Subclasses provide ``forward(ids, positions, mask, seq)``
    writing new K/V at [length, length + S) of that sequence.
    """

    lengths: list[int]
    cache: KVCache
    max_batch: int = 1
    # calls with fewer rows are padded to this many (exactness on kernels whose one-row path
    # gives other bits: probes.probe_row_invariance sets it at load)
    min_rows: int = 1
    # the graph takes ``logits_to_keep`` (LM head over the last rows only): :meth:`extend` then
    # computes no logits a prefill throws away (set by engines whose graph has the input)
    keeps_last_rows: bool = False
    # a new prompt may keep the K/V of the prefix it shares with what a sequence holds
    # (:meth:`reusable_prefix`): set where probes.probe_prefix_reuse found a prompt's K/V bit for
    # bit those of decoding (the generator's ``prefix_cache``)
    prefix_reuse: bool = False
    prefix_rows: int = 1  # the ``min_rows`` that probe ran with: reuse holds at that padding only
    # reuse only within one owner (a request's ``user``): another tenant could time a cache hit
    prefix_per_owner: bool = False

    @contextmanager
    def rows_padded_to(self, min_rows: int | None) -> Iterator[None]:
        """Calls inside the block are padded to ``min_rows`` rows (None: as probed), restored
        after: benchmarks time the unpadded one-row kernel beside the padded one."""
        saved = self.min_rows
        if min_rows is not None and min_rows != saved:
            self.min_rows = min_rows
            self._forget_prefixes()  # K/V computed at the other padding
        try:
            yield
        finally:
            if self.min_rows != saved:
                self.min_rows = saved
                self._forget_prefixes()

    @property
    def length(self) -> int:
        """Committed positions of sequence 0."""
        return self.lengths[0]

    @length.setter
    def length(self, n: int) -> None:
        self.lengths[0] = n

    def reset(self, seq: int | None = None) -> None:
        """Forget sequence ``seq`` (every sequence if None)."""
        if seq is None:
            self.lengths = [0] * len(self.lengths)
            self._forget_prefixes()
        else:
            self.lengths[seq] = 0
            self._held()[seq] = None

    def rollback(self, length: int, seq: int = 0) -> None:
        """O(1): forget everything after ``length``."""
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot roll back to {length} (cache holds {self.lengths[seq]})")
        self.lengths[seq] = length
        held = self._held()[seq]
        if held is not None and len(held.tokens) > length:
            held.tokens = held.tokens[:length]  # a copy: the tracked list may grow past what stays

    # -- prefix reuse -------------------------------------------------------------------------
    def _held(self) -> list[HeldPrefix | None]:
        """Per sequence, what its cached positions hold (None: unknown). Lazily sized, since
        subclasses set ``lengths``."""
        held = self.__dict__.get("_held_prefixes")
        if held is None or len(held) != len(self.lengths):
            held = self.__dict__["_held_prefixes"] = [None] * len(self.lengths)
        return held

    def _forget_prefixes(self) -> None:
        held = self._held()
        held[:] = [None] * len(held)

    def track(self, tokens: list[int], seq: int = 0, owner: str | None = None) -> None:
        """Sequence ``seq``'s cached positions hold the K/V of ``tokens``, as far as both go.

        ``tokens`` is a row's token list, which only grows by the tokens the row commits (the
        loop's invariant: the cache holds every committed token but the last), so it stays true
        without per-step work; :meth:`reset` and :meth:`rollback` end or cut it. ``owner``: who
        asked (with :attr:`prefix_per_owner`, only the same owner reuses it)."""
        self._held()[seq] = HeldPrefix(tokens, owner, next(_STAMPS))

    def prefix_stamp(self, seq: int = 0) -> int:
        """When sequence ``seq``'s prefix was last tracked (larger: later; -1: it holds none):
        the least recently used sequence is the one to give a prompt that reuses nothing."""
        held = self._held()[seq]
        return -1 if held is None else held.stamp

    def reusable_prefix(self, prompt, seq: int = 0, owner: str | None = None) -> int:
        """How many leading positions of sequence ``seq`` a prefill of ``prompt`` (asked by
        ``owner``) may keep: the tokens it shares with what the sequence holds, short of the
        prompt's last token (whose logits the prefill returns); 0 unless :attr:`prefix_reuse`."""
        held = self._held()[seq]
        if not self.prefix_reuse or held is None or self.min_rows != self.prefix_rows:
            return 0
        if self.prefix_per_owner and (owner is None or held.owner != owner):
            return 0
        n = min(len(held.tokens), self.lengths[seq], len(prompt) - 1)
        if n <= 0:
            return 0
        a, b = np.asarray(held.tokens[:n]), np.asarray(prompt[:n])
        diff = np.flatnonzero(a != b)
        return int(diff[0]) if len(diff) else n

    def commit(self, n: int, seq: int = 0) -> None:
        """Keep the first ``n`` positions written by the last forward call."""
        self.lengths[seq] += n

    def compact(self, src_offsets: list[int], seq: int = 0) -> None:
        """Keep the forward call's slots ``src_offsets`` (relative to ``length``) in order."""
        p = self.lengths[seq]
        self.cache.gather_into([p + s for s in src_offsets], p, seq)
        features = getattr(self, "features", None)  # a target's per-position features (EAGLE-3)
        if features is not None:
            rows = features[seq]
            rows[p:p + len(src_offsets)] = rows[[p + s for s in src_offsets]]
        self.lengths[seq] = p + len(src_offsets)

    def extend(self, tokens, chunk: int = PREFILL_CHUNK, seq: int = 0) -> np.ndarray:
        """Run ``tokens`` at the next positions in chunks of ``chunk`` and commit them; returns
        the last token's logits row. Chunks bound the logits output (every row's, [S, V])."""
        ids = np.asarray(tokens, dtype=np.int64)
        row = None
        for start in range(0, len(ids), chunk):
            p = self.lengths[seq]
            part = ids[start:start + chunk]
            positions = np.arange(p, p + len(part), dtype=np.int64)
            mask = causal_mask(p, positions, self.info.sliding_window)
            # the LM head over min_rows rows (not 1): the rows a padded call would give, so the
            # kernel that computes the kept logits is the multi-row one wherever padding is on
            keep = max(1, self.min_rows)
            if self.keeps_last_rows and len(part) >= max(keep, KEEP_LAST_FROM):
                row = self.forward_last(part, positions, mask, keep, seq)[-1]
            else:
                row = self.forward(part, positions, mask, seq)[-1]
            self.commit(len(part), seq)
        return row

    def forward_last(self, input_ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, rows: int,
                     seq: int = 0) -> np.ndarray:
        """:meth:`forward`, returning the logits of the last ``rows`` rows only (what
        ``keeps_last_rows`` engines compute alone; the others compute all and slice)."""
        return self.forward(input_ids, positions, mask, seq)[-rows:]

    def step(self, token: int, seq: int = 0) -> np.ndarray:
        """One token at the next position; returns its logits row and commits it."""
        p = self.lengths[seq]
        pos = np.array([p], dtype=np.int64)
        row = self.forward(np.array([token], dtype=np.int64), pos,
                           causal_mask(p, pos, self.info.sliding_window), seq)[-1]
        self.lengths[seq] = p + 1
        return row

    def forward_rows(self, seqs: list[int], ids: list, positions: list | None = None,
                     masks: list | None = None) -> list[np.ndarray]:
        """One call over several sequences: sequence ``seqs[i]`` gets tokens ``ids[i]`` at
        ``positions[i]`` (default: its next positions) with ``masks[i]`` ([S_i, length + S_i],
        as for :meth:`forward`; default: causal, the manifest's sliding window applied).

        Returns each sequence's logits [S_i, V]; nothing is committed. Engines without batched
        calls (``max_batch`` 1) take one sequence.
        """
        if len(seqs) != 1:
            raise ValueError(f"this engine runs one sequence per call, got {len(seqs)}")
        p = self.lengths[seqs[0]]
        pos = positions[0] if positions is not None else np.arange(p, p + len(ids[0]), dtype=np.int64)
        mask = masks[0] if masks is not None else causal_mask(p, pos, self.info.sliding_window)
        return [self.forward(ids[0], pos, mask, seqs[0])]
