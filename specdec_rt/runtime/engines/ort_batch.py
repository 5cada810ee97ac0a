"""The batched half of :class:`~specdec_rt.runtime.engines.ort.OrtEngine`: several sequences of its
cache in one ONNX Runtime call (CPU provider), a row's bits what it gets alone.

A mixin of the engine (its own module to keep each under the size the project allows): it reads
the engine's cache, session and bookkeeping as the engine's own methods do.
"""
from __future__ import annotations

import time

import numpy as np

from specdec_rt.errors import BackendUnavailableError, ContextOverflowError
from specdec_rt.runtime.core.masks import NEG_INF, causal_mask
from specdec_rt.runtime.engines.probes import RowInvarianceWarning

# Batched calls attend over the cache's whole stride (masked past each row's length): it grows in
# steps of this many positions (a re-layout, i.e. a move of every sequence's K/V, once per
# STRIDE_STEP tokens of the longest sequence) and shrinks back when two steps are unused.
STRIDE_STEP = 32


class BatchCalls:
    """``forward_rows`` / ``forward_batch`` of the engine, and the cache stride they need."""

    def _fit(self, need: int, batched: bool = False) -> None:
        """Keep the cache's stride (positions per sequence) at least ``need`` and every
        sequence's length; batched calls attend over the whole stride, so they also shrink it
        back when it is far above what is needed."""
        cache = self.cache
        if getattr(cache, "seqs", 1) == 1:
            return  # one sequence starts at offset 0 whatever the stride
        need = max(need, max(self.lengths))
        stride = cache.stride
        if need > stride or (batched and stride >= need + 2 * STRIDE_STEP):
            cache.restride(min(cache.max_len, -(-need // STRIDE_STEP) * STRIDE_STEP), self.lengths)

    def forward_rows(self, seqs: list[int], ids: list, positions: list | None = None,
                     masks: list | None = None) -> list[np.ndarray]:
        """One call over several sequences (see :meth:`EngineBase.forward_rows`).

        Sequences at different lengths share the call through padding expressed only in the
        mask and positions: the past is the cache's rows ``[lo:hi, :stride]`` fed with no copy
        (each row's mask hides the positions past its own length; a sequence in the range that
        is not in the call runs as a dummy row), and the new tokens are ``[B, S_max]`` (a row
        with fewer tokens repeats its last one in pad rows that see what it sees and that no
        real row sees). A row's logits and K/V are bit for bit what it gets alone: every kernel
        computes a row independently of the others, the attention sums over keys run in float64
        (masked columns add exact zeros), and the call always has several rows, so the one-row
        kernel question (``min_rows``) does not arise. Measured at load by
        :func:`~specdec_rt.runtime.engines.probes.probe_batch_invariance`; where it fails, sequences run
        one per call.
        """
        if len(seqs) == 1 or not self.batch_calls:
            if len(seqs) > 1:
                self.warn_unbatched()
            if positions is None:
                positions = [np.arange(self.lengths[q], self.lengths[q] + len(t), dtype=np.int64)
                             for q, t in zip(seqs, ids)]
            if masks is None:
                masks = [causal_mask(self.lengths[q], pos, self.info.sliding_window)
                         for q, pos in zip(seqs, positions)]
            return [self.forward(*args) for args in zip(ids, positions, masks, seqs)]
        return self._forward_batch(seqs, ids, positions, masks)

    def forward_batch(self, seqs: list[int], ids: list, positions: list | None = None,
                      masks: list | None = None, row_inputs: dict[str, list[np.ndarray]] | None = None
                      ) -> list[np.ndarray]:
        """:meth:`forward_rows` as one batched call whatever ``batch_calls`` says (CPU provider,
        several sequences): what :func:`~specdec_rt.runtime.engines.probes.probe_batch_invariance`
        compares with one-sequence calls, and how an EAGLE-3 head drafts for a batch (its
        proposals need no bit-exactness). ``row_inputs``: graph inputs given per sequence as
        ``[S_r, ...]`` arrays (a head's ``hidden_states``), laid out like the tokens; extra outputs
        other than ``features`` come back per sequence in ``outputs`` (lists). Nothing is committed."""
        return self._forward_batch(seqs, ids, positions, masks, row_inputs)

    def warn_unbatched(self) -> None:
        """Say once (at load if batching was asked for, else at the first batch) that batched
        calls fall back to one sequence per call
        (:func:`~specdec_rt.runtime.engines.probes.probe_batch_invariance`)."""
        if self.batch_warning:
            import warnings

            warnings.warn(self.batch_warning, RowInvarianceWarning, stacklevel=3)
            self.batch_warning = None

    def _forward_batch(self, seqs: list[int], ids: list, positions: list | None,
                       masks: list | None, row_inputs: dict[str, list[np.ndarray]] | None = None) -> list[np.ndarray]:
        if self.device != "cpu":  # pragma: no cover - guarded at construction
            raise BackendUnavailableError("batched calls run on the CPU provider only")
        lengths = np.array([self.lengths[q] for q in seqs])
        widths = np.array([len(x) for x in ids])
        over = np.nonzero(lengths + widths > self.max_len)[0]
        if len(over):
            i = int(over[0])
            raise ContextOverflowError(f"{lengths[i] + widths[i]} positions exceed the context of "
                                       f"{self.max_len} tokens (sequence {seqs[i]})")
        self._fit(int((lengths + widths).max()), batched=True)
        cache = self.cache
        c, smax = cache.stride, int(widths.max())
        seq_arr = np.array(seqs)
        lo, hi = int(seq_arr.min()), int(seq_arr.max()) + 1
        rows = seq_arr - lo  # row of each sequence in the call
        n = hi - lo
        # sequences in [lo, hi) that are not in the call: dummy rows (no past, a causal block)
        row_len = np.zeros(n, dtype=np.int64)
        row_width = np.full(n, smax, dtype=np.int64)
        row_len[rows], row_width[rows] = lengths, widths
        # row r's query j holds its token min(j, S_r - 1): shorter rows repeat their last token
        j = np.arange(smax)
        pick = np.minimum(j[None, :], widths[:, None] - 1)
        flat = (np.cumsum(widths) - widths)[:, None] + pick
        ids_in = np.zeros((n, smax), dtype=np.int64)
        pos_in = np.tile(j, (n, 1))
        ids_in[rows] = np.concatenate(ids)[flat]
        pos_in[rows] = lengths[:, None] + pick if positions is None else np.concatenate(positions)[flat]
        window = self.info.sliding_window
        if masks is None and not window:
            # causal chains: past columns below the row's length, new column j for query i while
            # j <= i; pad queries (i >= S_r) see what the row's last query sees
            past = np.arange(c)[None, None, :] < row_len[:, None, None]
            last = np.minimum(np.arange(smax)[None, :], row_width[:, None] - 1)
            new = np.arange(smax)[None, None, :] <= last[:, :, None]
            visible = np.concatenate([np.broadcast_to(past, (n, smax, c)), new], axis=2)
            mask_in = np.where(visible, np.float32(0), NEG_INF)[:, None]
        else:
            if masks is None:
                masks = [causal_mask(int(p), pos_in[r, :s], window) for r, p, s in zip(rows, lengths, widths)]
            mask_in = np.full((n, 1, smax, c + smax), NEG_INF, dtype=np.float32)
            mask_in[:, 0, :, c:] = np.triu(np.full((smax, smax), NEG_INF, dtype=np.float32), 1)
            for r, m, p, s in zip(rows, masks, lengths, widths):
                m = np.asarray(m, dtype=np.float32).reshape(s, p + s)
                block = mask_in[r, 0]
                block[:] = NEG_INF
                block[:s, :p] = m[:, :p]
                block[:s, c:c + s] = m[:, p:]
                block[s:] = block[s - 1]  # pad rows see what the last real row sees
        feeds = {"input_ids": ids_in, "position_ids": pos_in, "attention_mask": mask_in}
        for name, parts in (row_inputs or {}).items():  # per sequence, padded like the tokens
            x = np.concatenate(parts)
            arr = np.zeros((n, smax) + x.shape[1:], dtype=x.dtype)
            arr[rows] = x[flat]
            feeds[name] = arr
        feeds.update({k: v for k, v in self.call_inputs.items() if k not in (row_inputs or {})})
        keys, values = cache.keys, cache.values
        for (pk, pv), kbuf, vbuf in zip(self._past_names, keys, values):
            feeds[pk] = kbuf[lo:hi]
            feeds[pv] = vbuf[lo:hi]
        t0 = time.perf_counter()
        out = self._run(self._out_names + self.extra_outputs if self.extra_outputs else self._out_names, feeds, None)
        self.model_time += time.perf_counter() - t0
        # each row's new K/V to its own length: one scatter per layer and kind
        take = (j[None, :] < widths[:, None]).ravel()
        src = (rows[:, None] * smax + j[None, :]).ravel()[take]
        dst = (np.array(seqs)[:, None] * c + lengths[:, None] + j[None, :]).ravel()[take]
        tail = (cache.heads, cache.head_dim)
        for layer, (kbuf, vbuf) in enumerate(zip(keys, values)):
            kbuf.reshape(-1, *tail)[dst] = out[1 + 2 * layer].reshape(-1, *tail)[src]
            vbuf.reshape(-1, *tail)[dst] = out[2 + 2 * layer].reshape(-1, *tail)[src]
        if self.features is not None and "features" in self.extra_outputs:  # to the rows' slots too
            f = self.features
            at = (np.array(seqs)[:, None] * f.shape[1] + lengths[:, None] + j[None, :]).ravel()[take]
            got = out[len(self._out_names) + self.extra_outputs.index("features")]
            f.reshape(-1, f.shape[-1])[at] = got.reshape(-1, f.shape[-1])[src]
        # extra outputs other than the features (a head's hidden_out), per sequence
        self.outputs = {name: [out[len(self._out_names) + i][r, :s] for r, s in zip(rows, widths)]
                        for i, name in enumerate(self.extra_outputs) if name != "features"}
        self.calls += 1
        logits = out[0]  # [n, S_max or the kept rows, V]
        return [logits[r, :s] for r, s in zip(rows, widths)]
