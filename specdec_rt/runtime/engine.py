"""One model's forward pass over ONNX Runtime with IO binding into a preallocated KV cache.

The same code drives the CPU, CUDA and TensorRT execution providers: the past is bound by
pointer and shape (the valid prefix of each layer buffer), the new K/V outputs are bound at byte
offset ``P`` of the same buffers, and only token ids, positions, the mask and the logits rows
cross the host boundary. This module holds :class:`OrtEngine` only: session setup lives in
:mod:`~specdec_rt.runtime.sessions`, masks in :mod:`~specdec_rt.runtime.masks`, the draft's
windowed bindings in :mod:`~specdec_rt.runtime.window_binding`, the load-time exactness probes
in :mod:`~specdec_rt.runtime.probes` and the engine choice in :mod:`~specdec_rt.runtime.factory`.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_rt.errors import BackendUnavailableError, ContextOverflowError  # also the old import path
from specdec_rt.runtime.bundle import ModelInfo
from specdec_rt.runtime.engine_base import EngineBase
from specdec_rt.runtime.kv_cache import CudaKVCache, KVCache
from specdec_rt.runtime.masks import NEG_INF, causal_mask
from specdec_rt.runtime.probes import RowInvarianceWarning
from specdec_rt.runtime.providers import device_of, resolve_provider
from specdec_rt.runtime.sessions import (FUSED_ATTENTION_MIN_ORT, ort_element_type, provider_options,
                                        session_options)
# bound to a name of this module and looked up per call (a test stubs an old onnxruntime here)
from specdec_rt.runtime.sessions import ort_version as _ort_version
from specdec_rt.runtime.window_binding import PAST_WINDOW, WindowBinder

# Batched calls attend over the cache's whole stride (masked past each row's length): it grows in
# steps of this many positions (a re-layout, i.e. a move of every sequence's K/V, once per
# STRIDE_STEP tokens of the longest sequence) and shrinks back when two steps are unused.
STRIDE_STEP = 32


class OrtEngine(EngineBase):
    """A model graph plus its KV cache. ``lengths[s]``: committed positions of sequence s.

    ``max_batch`` sequences share the cache buffers (``[max_batch, max_len + 1, Hkv, D]`` per
    layer and kind); :meth:`forward_rows` runs several of them in one call (host cache only).
    """

    def __init__(self, graph_path: str | os.PathLike, info: ModelInfo, max_len: int,
                 provider: str = "cpu", threads: int | None = None,
                 bundle_root: Path | None = None, io_binding: bool | None = None,
                 shared_pool: bool = False, max_batch: int = 1, spin: bool = True) -> None:
        self.info = info
        self.max_len = max_len
        self.provider = provider
        providers = provider_options(provider, bundle_root, info, max_len)
        self.device = device_of(resolve_provider(provider))
        if max_batch > 1 and self.device != "cpu":
            raise BackendUnavailableError(
                f"batched decoding (max_batch {max_batch}) runs on the CPU provider in this version; "
                f"the {provider} provider decodes one sequence at a time (max_batch=1)")
        if getattr(info, "fused_attention", False) and _ort_version() < FUSED_ATTENTION_MIN_ORT:
            raise BackendUnavailableError(
                f"the {info.role} graph uses ONNX's Attention op (opset 23), which needs onnxruntime >= "
                f"{'.'.join(map(str, FUSED_ATTENTION_MIN_ORT))} (installed: {ort.__version__}); upgrade it, or "
                "re-export the bundle with specdec-export --draft-plain-attention")
        try:
            self.session = ort.InferenceSession(str(graph_path), session_options(threads, shared_pool, spin),
                                                providers=providers)
        except Exception as exc:  # noqa: BLE001 - surface ORT load failures as one clear error
            raise RuntimeError(f"ONNX Runtime could not load {graph_path}: {exc}") from None
        kv_dtype = np.dtype(info.kv_dtype)
        cache_cls = KVCache if self.device == "cpu" else CudaKVCache
        # one spare slot: a single-token call padded to two rows (see ``min_rows``) writes the
        # pad row's K/V there when the cache is full
        self.max_batch = max_batch
        if self.device == "cpu":
            self.cache = KVCache(info.num_layers, max_len + 1, info.num_kv_heads, info.head_dim, kv_dtype,
                                 seqs=max_batch)
        else:
            self.cache = cache_cls(info.num_layers, max_len + 1, info.num_kv_heads, info.head_dim, kv_dtype)
        self.vocab_size = info.vocab_size
        self._logits = np.zeros((1, 0, info.vocab_size), dtype=np.float32)  # IO binding; grown on demand
        self._kv_elem = ort_element_type(kv_dtype)
        self._kv_shape_tail = [info.num_kv_heads, info.head_dim]
        self._binding = self.session.io_binding()
        self._names = [(f"past_key.{i}", f"past_value.{i}", f"new_key.{i}", f"new_value.{i}")
                       for i in range(info.num_layers)]
        self._out_names = ["logits"] + [n for names in self._names for n in names[2:]]
        self._ids1 = np.zeros((1, 1), dtype=np.int64)
        self._pos1 = np.zeros((1, 1), dtype=np.int64)
        self._zeros = np.zeros(max_len, dtype=np.float32)
        self._past_names = [(pk, pv) for pk, pv, _, _ in self._names]
        self._feeds: dict = {}  # the host path's feed dict, reused (see _forward_run)
        self._views_of, self._views = None, {}  # per-sequence cache views (see _seq_views)
        # the C++ run entry point skips per-call Python-side input validation (~4 us); our
        # feeds are built to the graph's contract, and load-time checks caught the rest
        self._run = getattr(self.session, "_sess", self.session).run
        # IO binding is required on a GPU (no host round trip of the cache). On the CPU EP,
        # session.run over zero-copy views of the same buffers plus a copy of the S new rows
        # measured faster for small drafts (fewer Python->C++ calls per step): docs/runtime.md.
        self.io_binding = (self.device != "cpu") if io_binding is None else io_binding
        # host path (io_binding left to us): the draft's one-sequence calls go through persistent
        # bindings with the past in windows of PAST_WINDOW positions (WindowBinder); the target,
        # and io_binding=False, keep session.run over exact-length views (_forward_run): the
        # target's bits must not depend on masked columns
        window = PAST_WINDOW if io_binding is None and info.role == "draft" and self.device == "cpu" else 0
        self._windows = WindowBinder(self.session, self._names, self._kv_elem, self._kv_shape_tail,
                                     info.vocab_size, window)
        self._wins = self._windows.bindings  # the windowed path's bindings per (S, sequence)
        self.lengths = [0] * max_batch
        self.calls = 0
        self.model_time = 0.0  # seconds inside ONNX Runtime: the loop's overhead is the rest
        # Calls with fewer rows are padded to this many (see probes.probe_row_invariance).
        self.min_rows = 1
        # False: forward_rows runs one sequence per call (see probes.probe_batch_invariance)
        self.batch_calls = True
        self.batch_warning: str | None = None  # set by probe_batch_invariance, said once

    # -- forward ----------------------------------------------------------------------------
    def forward(self, input_ids: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                seq: int = 0) -> np.ndarray:
        """Run S new tokens of sequence ``seq`` against its committed cache; return logits
        [S, V] (a view).

        New K/V land at slots [length, length + S) but are not committed until :meth:`commit`.
        """
        s = int(input_ids.shape[-1])
        p = self.lengths[seq]
        if p + s > self.max_len:
            raise ContextOverflowError(
                f"{p + s} positions exceed the context of {self.max_len} tokens")
        self._fit(p + max(s, self.min_rows))
        if s < self.min_rows:
            return self._forward_padded(input_ids, positions, mask, seq)
        return self._dispatch(input_ids, positions, mask, s, p, seq)

    def _dispatch(self, input_ids, positions, mask, s: int, p: int, seq: int) -> np.ndarray:
        if not self.io_binding:
            return self._host(input_ids, positions, mask, s, p, seq)
        b = self._binding
        ids = np.ascontiguousarray(input_ids, dtype=np.int64).reshape(1, s)
        pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(1, s)
        msk = np.ascontiguousarray(mask, dtype=np.float32).reshape(1, 1, s, p + s)
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("position_ids", pos)
        b.bind_cpu_input("attention_mask", msk)
        cache, dev, elem, tail = self.cache, self.device, self._kv_elem, self._kv_shape_tail
        past_shape = [1, p] + tail
        new_shape = [1, s] + tail
        for layer, (pk, pv, nk, nv) in enumerate(self._names):
            b.bind_input(pk, dev, 0, elem, past_shape, cache.key_ptr(layer, 0, seq))
            b.bind_input(pv, dev, 0, elem, past_shape, cache.value_ptr(layer, 0, seq))
            b.bind_output(nk, dev, 0, elem, new_shape, cache.key_ptr(layer, p, seq))
            b.bind_output(nv, dev, 0, elem, new_shape, cache.value_ptr(layer, p, seq))
        if self._logits.shape[1] < s:  # rows of the widest call so far (prefill chunks, trees)
            self._logits = np.zeros((1, max(s, 2 * self._logits.shape[1]), self.vocab_size), dtype=np.float32)
        b.bind_output("logits", "cpu", 0, np.float32, [1, s, self.vocab_size], self._logits.ctypes.data)
        t0 = time.perf_counter()
        self.session.run_with_iobinding(b)
        self.model_time += time.perf_counter() - t0
        self.calls += 1
        return self._logits[0, :s]

    def _forward_padded(self, input_ids: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                        seq: int) -> np.ndarray:
        """:meth:`forward` with the call padded to ``min_rows`` rows by repeating its last row.

        The pad rows see what the last row sees (never themselves), so they are finite and
        change nothing: every kernel here computes a row independently of the others; only which
        kernel runs depends on the row count. Their K/V land after the real rows, uncommitted.
        """
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        s, p, m = len(ids), self.lengths[seq], self.min_rows
        if p + m > self.max_len + 1:
            raise ContextOverflowError(f"{p + m} positions exceed the context of {self.max_len} tokens")
        mask = np.asarray(mask, dtype=np.float32).reshape(s, p + s)
        padded = np.full((m, p + m), NEG_INF, dtype=np.float32)
        padded[:s, :p + s] = mask
        padded[s:, :p + s] = mask[-1]
        ids = np.concatenate([ids, np.repeat(ids[-1:], m - s)])
        pos = np.concatenate([pos, np.repeat(pos[-1:], m - s)])
        return self._dispatch(ids, pos, padded, m, p, seq)[:s]

    def step(self, token: int, seq: int = 0) -> np.ndarray:
        """One token at the next position (the draft's hot path); returns its logits row.

        Same result as ``forward([token], [length], causal_mask(...))`` without building the
        inputs: ids and position live in preallocated arrays and the all-zero mask is a view of
        a preallocated zero row. Commits the token.
        """
        p = self.lengths[seq]
        window = self.info.sliding_window
        if self.io_binding or self.min_rows > 1 or (window and p >= window) or p + 1 > self.max_len:
            return super().step(token, seq)
        self._fit(p + 1)
        row = self._windows.step(token, p, seq, self.cache) if self.past_window else None
        if row is not None:
            self._count_window_call()
        else:
            self._ids1[0, 0] = token
            self._pos1[0, 0] = p
            row = self._host(self._ids1, self._pos1, self._zeros[: p + 1], 1, p, seq)[-1]
        self.lengths[seq] = p + 1
        return row

    @property
    def past_window(self) -> int:
        """Positions per window of the draft's windowed host path (0: that path is off)."""
        return self._windows.window

    @past_window.setter
    def past_window(self, n: int) -> None:
        self._windows.window = n

    def _count_window_call(self) -> None:
        """Account for the windowed path's last call (its time inside ONNX Runtime)."""
        self.model_time += self._windows.seconds
        self.calls += 1

    def _seq_views(self, seq: int) -> list:
        """``(past_key name, past_value name, K, V)`` per layer, K and V the ``[1, stride, Hkv, D]``
        views of sequence ``seq``: made once per sequence and kept until the cache is re-laid out
        (a restride makes new views), so a call slices each only to its length."""
        keys = self.cache.keys
        if self._views_of is not keys:
            self._views_of, self._views = keys, {}
        views = self._views.get(seq)
        if views is None:
            views = self._views[seq] = [(pk, pv, kbuf[seq:seq + 1], vbuf[seq:seq + 1])
                                        for (pk, pv), kbuf, vbuf in zip(self._past_names, keys, self.cache.values)]
        return views

    def _host(self, input_ids, positions, mask, s: int, p: int, seq: int) -> np.ndarray:
        """One sequence on the host (no IO binding asked for): windowed bindings or session.run."""
        if self.past_window:
            logits = self._windows.forward(input_ids, positions, mask, s, p, seq, self.cache)
            self._count_window_call()
            return logits
        return self._forward_run(input_ids, positions, mask, s, p, seq)

    def _forward_run(self, input_ids, positions, mask, s: int, p: int, seq: int) -> np.ndarray:
        """Host path: past fed as zero-copy views, the S new K/V rows copied into place.

        The feed dict is kept between calls (only its values change) and the per-sequence cache
        views are made once: measured on the reference draft (2 layers) this Python side costs
        ~5 us per call, against ~100 us for the graph itself."""
        feeds = self._feeds
        feeds["input_ids"] = np.asarray(input_ids, dtype=np.int64).reshape(1, s)
        feeds["position_ids"] = np.asarray(positions, dtype=np.int64).reshape(1, s)
        feeds["attention_mask"] = np.asarray(mask, dtype=np.float32).reshape(1, 1, s, p + s)
        views = self._seq_views(seq)
        for pk, pv, kv, vv in views:
            feeds[pk] = kv[:, :p]
            feeds[pv] = vv[:, :p]
        t0 = time.perf_counter()
        out = self._run(self._out_names, feeds, None)
        self.model_time += time.perf_counter() - t0
        i = 1
        for _, _, kv, vv in views:
            kv[:, p:p + s] = out[i]
            vv[:, p:p + s] = out[i + 1]
            i += 2
        self.calls += 1
        return out[0][0]

    # -- batched calls --------------------------------------------------------------------
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
        :func:`~specdec_rt.runtime.probes.probe_batch_invariance`; where it fails, sequences run
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
                      masks: list | None = None) -> list[np.ndarray]:
        """:meth:`forward_rows` as one batched call whatever ``batch_calls`` says (CPU provider,
        several sequences): what :func:`~specdec_rt.runtime.probes.probe_batch_invariance`
        compares with one-sequence calls. Nothing is committed."""
        return self._forward_batch(seqs, ids, positions, masks)

    def warn_unbatched(self) -> None:
        """Say once (at load if batching was asked for, else at the first batch) that batched
        calls fall back to one sequence per call
        (:func:`~specdec_rt.runtime.probes.probe_batch_invariance`)."""
        if self.batch_warning:
            import warnings

            warnings.warn(self.batch_warning, RowInvarianceWarning, stacklevel=3)
            self.batch_warning = None

    def _forward_batch(self, seqs: list[int], ids: list, positions: list | None,
                       masks: list | None) -> list[np.ndarray]:
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
        keys, values = cache.keys, cache.values
        for (pk, pv), kbuf, vbuf in zip(self._past_names, keys, values):
            feeds[pk] = kbuf[lo:hi]
            feeds[pv] = vbuf[lo:hi]
        t0 = time.perf_counter()
        out = self._run(self._out_names, feeds, None)
        self.model_time += time.perf_counter() - t0
        # each row's new K/V to its own length: one scatter per layer and kind
        take = (j[None, :] < widths[:, None]).ravel()
        src = (rows[:, None] * smax + j[None, :]).ravel()[take]
        dst = (np.array(seqs)[:, None] * c + lengths[:, None] + j[None, :]).ravel()[take]
        tail = (cache.heads, cache.head_dim)
        for layer, (kbuf, vbuf) in enumerate(zip(keys, values)):
            kbuf.reshape(-1, *tail)[dst] = out[1 + 2 * layer].reshape(-1, *tail)[src]
            vbuf.reshape(-1, *tail)[dst] = out[2 + 2 * layer].reshape(-1, *tail)[src]
        self.calls += 1
        logits = out[0]
        return [logits[r, :s] for r, s in zip(rows, widths)]
