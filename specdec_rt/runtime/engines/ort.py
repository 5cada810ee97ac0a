"""One model's forward pass over ONNX Runtime with IO binding into a preallocated KV cache.

The same code drives the CPU, CUDA and TensorRT execution providers: the past is bound by
pointer and shape (the valid prefix of each layer buffer), the new K/V outputs are bound at byte
offset ``P`` of the same buffers, and only token ids, positions, the mask and the logits rows
cross the host boundary. This module holds :class:`OrtEngine` only: session setup lives in
:mod:`~specdec_rt.runtime.engines.sessions`, masks in :mod:`~specdec_rt.runtime.core.masks`, the draft's
windowed bindings in :mod:`~specdec_rt.runtime.engines.window_binding`, the load-time exactness probes
in :mod:`~specdec_rt.runtime.engines.probes` and the engine choice in :mod:`~specdec_rt.runtime.engines.factory`.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_rt.errors import BackendUnavailableError, ContextOverflowError  # also the old import path
from specdec_rt.runtime.core.bundle import ModelInfo
from specdec_rt.runtime.core.masks import NEG_INF
from specdec_rt.runtime.engines.base import EngineBase
from specdec_rt.runtime.engines.kv_cache import CudaKVCache, KVCache
from specdec_rt.runtime.engines.ort_batch import STRIDE_STEP, BatchCalls  # noqa: F401 - STRIDE_STEP re-exported
from specdec_rt.runtime.engines.probes import RowInvarianceWarning  # noqa: F401 - re-exported
from specdec_rt.runtime.engines.providers import device_of, resolve_provider
from specdec_rt.runtime.engines.sessions import (FUSED_ATTENTION_MIN_ORT, ort_element_type, provider_options,
                                                 session_options)
# bound to a name of this module and looked up per call (a test stubs an old onnxruntime here)
from specdec_rt.runtime.engines.sessions import ort_version as _ort_version
from specdec_rt.runtime.engines.window_binding import PAST_WINDOW, WindowBinder



class OrtEngine(BatchCalls, EngineBase):
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
        self._fed_extras: set[str] = set()  # the call_inputs names now in _feeds
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
        # graph inputs and outputs beyond the contract (EAGLE-3, issue 22): ``call_inputs`` are fed
        # to every call (a head's ``hidden_states`` and ``logits_to_keep``, set by its drafter before
        # each call; one sequence per call), ``extra_outputs`` fetched into ``outputs`` (rows of the last call);
        # ``features`` ([max_batch, max_len + 1, F], see enable_features) keeps the target's
        # per-position ``features`` output at the slots its K/V take, committed and compacted alike
        self.call_inputs: dict[str, np.ndarray] = {}
        self.extra_outputs: list[str] = []
        # a target or draft exported with ``logits_to_keep`` (an optional input: an initializer
        # ONNX Runtime lets session.run override, but not IO binding, which knows required inputs
        # only: IO-bound engines, the GPU's, compute every row as before); a head's is a
        # required input its drafter feeds
        self.keeps_last_rows = not self.io_binding and "logits_to_keep" in {
            i.name for i in self.session.get_overridable_initializers()}
        self.outputs: dict[str, np.ndarray] = {}
        self.features: np.ndarray | None = None

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
        keep = self.call_inputs.get("logits_to_keep")  # a head's: logits of the last rows only
        rows = s if keep is None else int(keep[0])
        if self._logits.shape[1] < rows:  # rows of the widest call so far (prefill chunks, trees)
            self._logits = np.zeros((1, max(rows, 2 * self._logits.shape[1]), self.vocab_size), dtype=np.float32)
        b.bind_output("logits", "cpu", 0, np.float32, [1, rows, self.vocab_size], self._logits.ctypes.data)
        for name, value in self.call_inputs.items():
            b.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in self.extra_outputs:
            if name == "features" and self.features is not None:
                f = self.features
                b.bind_output(name, "cpu", 0, np.float32, [1, s, f.shape[-1]], f[seq, p:].ctypes.data)
            else:
                b.bind_output(name, "cpu")
        t0 = time.perf_counter()
        self.session.run_with_iobinding(b)
        self.model_time += time.perf_counter() - t0
        self.calls += 1
        if self.extra_outputs:
            values = b.get_outputs()[-len(self.extra_outputs):]
            self.outputs = {n: (self.features[seq, p:p + s] if n == "features" and self.features is not None
                                else v.numpy()[0]) for n, v in zip(self.extra_outputs, values)}
        return self._logits[0, :rows]

    def forward_last(self, input_ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, rows: int,
                     seq: int = 0) -> np.ndarray:
        """:meth:`forward` with the LM head over the last ``rows`` rows only (``logits_to_keep``);
        the call must not need padding (``rows >= min_rows``, S >= rows)."""
        if not self.keeps_last_rows:
            return super().forward_last(input_ids, positions, mask, rows, seq)
        saved = self.call_inputs
        self.call_inputs = {**saved, "logits_to_keep": np.array([rows], dtype=np.int64)}
        try:
            return self.forward(input_ids, positions, mask, seq)
        finally:
            self.call_inputs = saved

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
        """One sequence on the host (no IO binding asked for): windowed bindings or session.run
        (a call that keeps the last rows only, a prefill chunk, binds afresh either way)."""
        if self.past_window and "logits_to_keep" not in self.call_inputs:
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
        if self._fed_extras != self.call_inputs.keys():  # drop an earlier call's (a prefill's logits_to_keep)
            for name in self._fed_extras - self.call_inputs.keys():
                del feeds[name]
            self._fed_extras = set(self.call_inputs)
        feeds.update(self.call_inputs)
        t0 = time.perf_counter()
        out = self._run(self._out_names + self.extra_outputs if self.extra_outputs else self._out_names, feeds, None)
        self.model_time += time.perf_counter() - t0
        i = 1
        for _, _, kv, vv in views:
            kv[:, p:p + s] = out[i]
            vv[:, p:p + s] = out[i + 1]
            i += 2
        if self.extra_outputs:
            self._keep_outputs(out[i:], seq, p, s)
        self.calls += 1
        return out[0][0]

    def _keep_outputs(self, values: list, seq: int, p: int, s: int) -> None:
        """The extra outputs of a one-sequence call: ``features`` to its slots, the rest kept."""
        self.outputs = {}
        for name, value in zip(self.extra_outputs, values):
            if name == "features" and self.features is not None:
                self.features[seq, p:p + s] = value[0]
                self.outputs[name] = self.features[seq, p:p + s]
            else:
                self.outputs[name] = value[0]

    def enable_features(self) -> None:
        """Keep the graph's ``features`` output (the target of an EAGLE-3 head) for every position
        of every sequence, from the next call on: what the head's drafter reads."""
        outputs = {o.name: o for o in self.session.get_outputs()}
        if "features" not in outputs:
            raise ValueError(f"the {self.info.role} graph has no 'features' output (exported without a head)")
        if self.features is None:
            width = int(outputs["features"].shape[-1])
            self.features = np.zeros((self.max_batch, self.max_len + 1, width), dtype=np.float32)
        if "features" not in self.extra_outputs:
            self.extra_outputs.append("features")
