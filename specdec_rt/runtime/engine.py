"""One model's forward pass over ONNX Runtime with IO binding into a preallocated KV cache.

The same code drives the CPU, CUDA and TensorRT execution providers: the past is bound by
pointer and shape (the valid prefix of each layer buffer), the new K/V outputs are bound at byte
offset ``P`` of the same buffers, and only token ids, positions, the mask and the logits rows
cross the host boundary.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_rt.errors import BackendUnavailableError, ContextOverflowError  # noqa: F401 - re-exported here
from specdec_rt.runtime.bundle import ModelInfo
from specdec_rt.runtime.kv_cache import CudaKVCache, KVCache
from specdec_rt.runtime.providers import device_of, resolve_provider

NEG_INF = np.float32(-np.inf)

# Long inputs (prompts) run in chunks of this many tokens: the graph returns logits for every
# row, and a 4k-token prompt over a 152k vocabulary would otherwise need a 2.5 GB logits tensor.
PREFILL_CHUNK = 256

# Batched calls attend over the cache's whole stride (masked past each row's length): it grows in
# steps of this many positions (a re-layout, i.e. a move of every sequence's K/V, once per
# STRIDE_STEP tokens of the longest sequence) and shrinks back when two steps are unused.
STRIDE_STEP = 32

# The draft's one-sequence calls on the CPU feed the past in windows of this many positions
# (see OrtEngine._forward_window): the bindings then change once per window, not per call.
PAST_WINDOW = 32


# ONNX Attention (opset 23), which drafts exported with fused attention use: CPU kernel since 1.23
FUSED_ATTENTION_MIN_ORT = (1, 23)


def _ort_version() -> tuple[int, int]:
    try:
        major, minor = ort.__version__.split(".")[:2]
        return int(major), int(minor)
    except ValueError:  # a development build: assume it is recent
        return (99, 0)


_GLOBAL_POOL: int | None = None  # intra-op size of the process-wide pool, once created


def enable_shared_thread_pool(threads: int | None = None) -> bool:
    """Opt in to ONNX Runtime's process-wide thread pool (see :func:`_global_pool`)."""
    return _global_pool(threads or max(1, min(os.cpu_count() or 1, 8)))


def shared_pool_in_use() -> bool:
    """Whether this process runs its sessions on ONNX Runtime's process-wide thread pool."""
    return _GLOBAL_POOL is not None


def _global_pool(threads: int) -> bool:
    """Create ONNX Runtime's process-wide thread pool once; False if it cannot be used.

    Draft and target alternate dozens of times per generated token. With one pool per session,
    each pool's workers spin or sleep independently and steal cycles from the other session's
    call: measured on the reference pair (2 cores) a draft x4 + verify cycle took 3.76 ms with
    per-session pools and 2.24 ms with one shared pool (target S=5 2.79 -> 1.79 ms, draft step
    0.24 -> 0.11 ms). The pool must be configured before ONNX Runtime's environment exists,
    and afterwards every session of the process must use it (ONNX Runtime refuses sessions with
    their own pool), which is why the library only does this when asked
    (``load(..., shared_thread_pool=True)``; the command-line tools and the server do).
    """
    global _GLOBAL_POOL
    if _GLOBAL_POOL is not None:
        return True
    if os.environ.get("SPECDEC_PER_SESSION_THREADS"):
        return False
    try:
        ort.capi._pybind_state.set_global_thread_pool_sizes(threads, 1)
    except Exception:  # noqa: BLE001 - environment already created, or an older onnxruntime
        return False
    _GLOBAL_POOL = threads
    return True


def session_options(threads: int | None = None, shared_pool: bool = False,
                    spin: bool = True) -> ort.SessionOptions:
    """Sequential execution; ``threads`` intra-op threads (default: the cores, at most 8).

    With ``shared_pool`` (or once the process-wide pool exists) the session runs on the shared
    pool, which ``threads`` sizes only if it does not exist yet; otherwise each session gets its
    own pool of ``threads``, whose workers spin between parallel sections unless ``spin`` is
    False (overlapped decoding: a spinning target worker takes the core the draft runs on).
    """
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    n = threads or max(1, min(os.cpu_count() or 1, 8))
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if _GLOBAL_POOL is not None or (shared_pool and _global_pool(n)):
        opts.use_per_session_threads = False
    else:
        opts.intra_op_num_threads = n
        opts.inter_op_num_threads = 1
        if not spin:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def provider_options(provider: str, bundle_root: Path | None, info: ModelInfo, max_len: int) -> list:
    """Provider list with options derived from the bundle (TensorRT profiles and caches)."""
    name = resolve_provider(provider)
    if name == "CPUExecutionProvider":
        return [name]
    if name == "CUDAExecutionProvider":
        return [(name, {"device_id": 0}), "CPUExecutionProvider"]
    cache_dir = str((bundle_root or Path(".")) / "trt_cache")
    layers = [(f"past_key.{i}", f"past_value.{i}") for i in range(info.num_layers)]
    hkv, d = info.num_kv_heads, info.head_dim

    def profile(s: int, p: int) -> str:
        parts = [f"input_ids:1x{s}", f"position_ids:1x{s}", f"attention_mask:1x1x{s}x{p + s}"]
        for k, v in layers:
            parts += [f"{k}:1x{p}x{hkv}x{d}", f"{v}:1x{p}x{hkv}x{d}"]
        return ",".join(parts)

    trt = {
        "device_id": 0,
        "trt_fp16_enable": info.dtype == "fp16",
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": cache_dir,
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": cache_dir,
        "trt_profile_min_shapes": profile(1, 0),
        "trt_profile_opt_shapes": profile(5, max_len // 2),
        "trt_profile_max_shapes": profile(min(512, max_len), max_len),
    }
    return [(name, trt), ("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]


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
        else:
            self.lengths[seq] = 0

    def rollback(self, length: int, seq: int = 0) -> None:
        """O(1): forget everything after ``length``."""
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot roll back to {length} (cache holds {self.lengths[seq]})")
        self.lengths[seq] = length

    def commit(self, n: int, seq: int = 0) -> None:
        """Keep the first ``n`` positions written by the last forward call."""
        self.lengths[seq] += n

    def compact(self, src_offsets: list[int], seq: int = 0) -> None:
        """Keep the forward call's slots ``src_offsets`` (relative to ``length``) in order."""
        p = self.lengths[seq]
        self.cache.gather_into([p + s for s in src_offsets], p, seq)
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
            row = self.forward(part, positions, causal_mask(p, positions, self.info.sliding_window), seq)[-1]
            self.commit(len(part), seq)
        return row

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


# calls of up to this many rows keep their windowed bindings (one per S and sequence); larger
# ones (prefill chunks, whose S varies) bind afresh
KEPT_WINDOW_ROWS = 8


class _WindowBindings:
    """The persistent IO binding of :meth:`OrtEngine._forward_window` and what it is bound to."""

    def __init__(self, binding) -> None:
        self.binding = binding
        self.device = ort.OrtDevice.make("cpu", 0)._get_c_device()
        self.s = self.seq = self.c = self.keys = None
        self.token = 0
        self.copies: list = []
        self.causal_p: int | None = None  # the P whose causal one-token mask row is in place


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
        # persistent bindings of the windowed host path per (S, sequence), see _forward_window
        self._wins: dict[tuple[int, int], _WindowBindings] = {}
        # the C++ run entry point skips per-call Python-side input validation (~4 us); our
        # feeds are built to the graph's contract, and load-time checks caught the rest
        self._run = getattr(self.session, "_sess", self.session).run
        self._run_binding = self.session._sess.run_with_iobinding
        # IO binding is required on a GPU (no host round trip of the cache). On the CPU EP,
        # session.run over zero-copy views of the same buffers plus a copy of the S new rows
        # measured faster for small drafts (fewer Python->C++ calls per step): docs/runtime.md.
        self.io_binding = (self.device != "cpu") if io_binding is None else io_binding
        # host path (io_binding left to us): the draft's one-sequence calls go through persistent
        # bindings with the past in windows of PAST_WINDOW positions (_forward_window); the target,
        # and io_binding=False, keep session.run over exact-length views (_forward_run): the
        # target's bits must not depend on masked columns
        self.past_window = PAST_WINDOW if io_binding is None and info.role == "draft" and self.device == "cpu" else 0
        self.lengths = [0] * max_batch
        self.calls = 0
        self.model_time = 0.0  # seconds inside ONNX Runtime: the loop's overhead is the rest
        # Calls with fewer rows are padded to this many (see :func:`probe_row_invariance`).
        self.min_rows = 1
        # False: forward_rows runs one sequence per call (see :func:`probe_batch_invariance`)
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
        w = self._wins.get((1, seq)) if self.past_window else None
        if w is not None and w.keys is self.cache.keys and w.c == self._window_end(p):
            row = self._step_window(w, token, p, seq)
        else:
            self._ids1[0, 0] = token
            self._pos1[0, 0] = p
            row = self._host(self._ids1, self._pos1, self._zeros[: p + 1], 1, p, seq)[-1]
        self.lengths[seq] = p + 1
        return row

    def _step_window(self, w: "_WindowBindings", token: int, p: int, seq: int) -> np.ndarray:
        """:meth:`_forward_window` for one causal token in the window already bound (the draft's
        inner loop): the mask row changes by one column from the previous step, so only that
        column is written (or the row, after a rollback or another call shape)."""
        w.ids[0, 0] = token
        w.pos[0, 0] = p
        row = w.mask[0, 0, 0]
        if w.causal_p == p - 1:
            row[p - 1] = 0.0
        else:  # [0, p) visible, [p, c) masked, the new token itself visible
            row[:p] = 0.0
            row[p:w.c] = NEG_INF
            row[w.c] = 0.0
        w.causal_p = p
        self._run_window(w, 1, p, seq)
        return w.logits[0, 0]

    def _window_end(self, p: int) -> int:
        """C: the past bound for a sequence of ``p`` positions, ``p`` rounded up to the window."""
        return min(-(-p // self.past_window) * self.past_window, self.cache.stride)

    def _run_window(self, w: "_WindowBindings", s: int, p: int, seq: int) -> None:
        """Run the bound call and copy its ``s`` new K/V rows into the cache at position ``p``."""
        t0 = time.perf_counter()
        self._run_binding(w.binding, None)
        self.model_time += time.perf_counter() - t0
        o = (seq * self.cache.stride + p) * w.token
        n = s * w.token
        for flat, new in w.copies:  # the S new rows of each layer and kind, into the cache
            flat[o:o + n] = new
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
            return self._forward_window(input_ids, positions, mask, s, p, seq)
        return self._forward_run(input_ids, positions, mask, s, p, seq)

    def _forward_window(self, input_ids, positions, mask, s: int, p: int, seq: int) -> np.ndarray:
        """Host path with persistent IO bindings (the draft's): what a call rebinds is only what
        changed since the last one.

        The past is bound as the first ``C = ceil(P / PAST_WINDOW) * PAST_WINDOW`` positions of the
        sequence's buffers (zero copy), so its bindings change once per window; the positions
        ``[P, C)`` are masked (-inf) in a mask buffer of ``[S, C + S]`` that the call's ``[S, P + S]``
        mask is written into. Token ids, positions, logits and the S new K/V rows live in buffers
        bound once per S (one binding per S and sequence up to ``KEPT_WINDOW_ROWS``: a draft
        alternates S = 1 steps with S = 2 catch-ups, and rebinding ~4L + 4 buffers cost ~35 us per
        draft call); the new rows are copied into the cache after the call. Binding every
        input and output per call costs ~1.5 us each (4L + 4 of them), session.run converts its
        feeds and fetches: this path measured ~10% less per draft step on the reference pair
        (2 layers; 151-155 vs 167-171 us, docs/benchmarks.md). The masked slots hold zeros or
        rolled-back K/V (finite), so they add exact zeros to the attention sums, but may regroup
        them (a last-bit change of the draft's logits): the draft only proposes, the target
        verifies, so greedy output is unchanged; the target never takes this path. The logits
        returned are a view that the next call with the same S overwrites (as with IO binding).
        """
        w = self._wins.get((s, seq))
        if w is None:
            w = _WindowBindings(self.session.io_binding()._iobinding)
            if s <= KEPT_WINDOW_ROWS:  # a draft alternates S = 1 and 2: no rebinding per step
                self._wins[(s, seq)] = w
        cache = self.cache
        if w.s != s or w.seq != seq or w.keys is not cache.keys:
            self._window_buffers(w, s, seq)
        c = self._window_end(p)
        if w.c != c:
            self._window_past(w, c)
        w.ids[0] = input_ids
        w.pos[0] = positions
        w.causal_p = None  # the mask row is rewritten whole: _step_window starts afresh
        m = np.asarray(mask, dtype=np.float32).reshape(s, p + s)
        mb = w.mask[0, 0]
        mb[:, :p] = m[:, :p]
        mb[:, p:c] = NEG_INF
        mb[:, c:] = m[:, p:]
        self._run_window(w, s, p, seq)
        return w.logits[0]

    def _window_buffers(self, w: "_WindowBindings", s: int, seq: int) -> None:
        """(Re)bind the buffers of S-row calls of sequence ``seq``: ids, positions, logits, new K/V."""
        cache, ib, dev = self.cache, w.binding, w.device
        if w.s != s:
            w.ids = np.zeros((1, s), dtype=np.int64)
            w.pos = np.zeros((1, s), dtype=np.int64)
            w.logits = np.zeros((1, s, self.vocab_size), dtype=np.float32)
            shape = [1, s] + self._kv_shape_tail
            w.new = [np.zeros(shape, dtype=cache.dtype) for _ in range(2 * len(self._names))]
            ib.bind_input("input_ids", w.ids)
            ib.bind_input("position_ids", w.pos)
            ib.bind_output("logits", dev, np.float32, [1, s, self.vocab_size], w.logits.ctypes.data)
            for (_, _, nk, nv), k, v in zip(self._names, w.new[0::2], w.new[1::2]):
                ib.bind_output(nk, dev, self._kv_elem, shape, k.ctypes.data)
                ib.bind_output(nv, dev, self._kv_elem, shape, v.ctypes.data)
            w.c = None  # the mask's shape depends on S
        if w.keys is not cache.keys or w.seq != seq:
            w.c = None  # the past's address depends on the sequence and the layout
        w.s, w.seq, w.keys = s, seq, cache.keys
        w.token = int(np.prod(self._kv_shape_tail))
        w.copies = [(f, x.reshape(-1)) for f, x in zip(cache._flat, w.new)]  # K0, V0, K1, V1, ...

    def _window_past(self, w: "_WindowBindings", c: int) -> None:
        """Bind the first ``c`` positions of the sequence as the past, and a ``[S, c + S]`` mask."""
        cache, ib, dev = self.cache, w.binding, w.device
        shape = [1, c] + self._kv_shape_tail
        for layer, (pk, pv, _, _) in enumerate(self._names):
            ib.bind_input(pk, dev, self._kv_elem, shape, cache.key_ptr(layer, 0, w.seq))
            ib.bind_input(pv, dev, self._kv_elem, shape, cache.value_ptr(layer, 0, w.seq))
        w.mask = np.empty((1, 1, w.s, c + w.s), dtype=np.float32)
        ib.bind_input("attention_mask", w.mask)
        w.c = c
        w.causal_p = None

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
        :func:`probe_batch_invariance`; where it fails, sequences run one per call.
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

    def warn_unbatched(self) -> None:
        """Say once (at load if batching was asked for, else at the first batch) that batched
        calls fall back to one sequence per call (:func:`probe_batch_invariance`)."""
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


def ort_element_type(dtype: np.dtype):
    return np.float16 if np.dtype(dtype) == np.float16 else np.float32


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

def make_engine(graph_path: str | os.PathLike, info: ModelInfo, max_len: int, provider: str = "cpu",
                threads: int | None = None, bundle_root: Path | None = None,
                io_binding: bool | None = None, shared_pool: bool = False, max_batch: int = 1,
                spin: bool = True):
    """An engine for ``provider``: ONNX Runtime (cpu / cuda / tensorrt EP) or native TensorRT (trt).

    Every engine has the same interface (forward / forward_rows / commit / rollback / compact /
    reset, ``lengths``, ``max_len``, ``max_batch``, ``info``, ``cache``), so the loop never knows
    which one it drives. ``max_batch``: sequences the cache holds (batched decoding, CPU only).
    """
    if provider.lower() == "trt":
        from specdec_rt.runtime.trt_engine import TrtEngine

        if max_batch > 1:
            raise BackendUnavailableError(
                f"batched decoding (max_batch {max_batch}) runs on the CPU provider in this version; "
                "the native TensorRT engines decode one sequence at a time (max_batch=1)")
        return TrtEngine(graph_path, info, max_len, bundle_root=bundle_root)
    return OrtEngine(graph_path, info, max_len, provider, threads, bundle_root, io_binding, shared_pool,
                     max_batch, spin)


class RowInvarianceWarning(RuntimeWarning):
    """The target's logits for a token depend on how many rows its call had."""


def probe_row_invariance(engine: OrtEngine, widths: tuple[int, ...] = (2, 3, 5, 8, 16, 33),
                         seed: int = 0) -> int:
    """Measure from how many rows on a call's row results stop depending on the row count, and
    pad smaller calls to that (``engine.min_rows``). Returns the row count chosen.

    Greedy speculation is token-for-token target-only decoding only if the target computes a
    token's logits bit for bit the same alone (S = 1) as inside a verify call (S > 1). Kernels
    are free to pick another code path per row count: ONNX Runtime's MatMulNBits (int4 weights)
    runs a separate kernel for a single row whose results differ in the last bits from the
    multi-row kernel (measured on x86 AVX2), and int8 activation quantization turns such bits
    into flipped argmaxes. Which kernels differ depends on the CPU/GPU, so it is measured here,
    on the machine that runs the model, not assumed at export.
    """
    rng = np.random.default_rng(seed)
    prefix = 3
    usable = [w for w in widths if prefix + w <= engine.max_len]
    if not usable:
        return engine.min_rows
    tokens = rng.integers(0, engine.vocab_size, prefix + max(usable))
    sliding = engine.info.sliding_window
    saved = engine.min_rows
    engine.min_rows = 1
    try:
        engine.reset()
        pos = np.arange(prefix, dtype=np.int64)
        engine.forward(tokens[:prefix], pos, causal_mask(0, pos, sliding))
        engine.commit(prefix)
        rows = {}
        for s in (1, *usable):
            pos = np.arange(prefix, prefix + s, dtype=np.int64)
            rows[s] = engine.forward(tokens[prefix:prefix + s], pos, causal_mask(prefix, pos, sliding))[0].copy()
    finally:
        engine.reset()
        engine.min_rows = saved
    multi = [rows[s] for s in usable]
    multi_agree = all(np.array_equal(multi[0], r) for r in multi[1:])
    if multi_agree and np.array_equal(rows[1], multi[0]):
        chosen = 1
    elif multi_agree:
        chosen = 2
    else:
        import warnings

        warnings.warn(
            f"the {engine.info.role} graph's logits for a token change with the number of rows in "
            f"the call (widths {usable} disagree) on the {engine.provider} provider: greedy "
            "speculation may differ from target-only decoding on near-ties", RowInvarianceWarning,
            stacklevel=2)
        chosen = 1
    engine.min_rows = chosen
    return chosen


def probe_batch_invariance(engine: OrtEngine, seed: int = 0, warn: bool = True) -> bool:
    """Measure whether a sequence's logits and K/V in a batched call equal, bit for bit, what it
    gets alone; if not, warn and make :meth:`OrtEngine.forward_rows` run sequences one at a
    time (``engine.batch_calls = False``: exact, without the batching gain). Returns the answer.

    Batched calls pad: rows are at different lengths (masked past columns) and propose different
    numbers of tokens (pad rows), and the call has more rows than any of its sequences. Measured
    on x86 AVX2 with the fp32 and int4 graphs: no effect beyond the one-row kernel that
    ``min_rows`` already pads (every batched call has several rows). Kernels differ per machine,
    so this is checked where the model runs, after :func:`probe_row_invariance`.
    """
    n = min(engine.max_batch, 4)
    if n < 2:
        return True
    rng = np.random.default_rng(seed)
    lengths, widths = [3, 9, 5, 14][:n], [1, 4, 2, 3][:n]
    if max(lengths) + max(widths) > engine.max_len:
        return True
    prompts = [rng.integers(0, engine.vocab_size, p + s) for p, s in zip(lengths, widths)]
    sliding = engine.info.sliding_window
    layers = sorted({0, engine.info.num_layers - 1})
    seqs = list(range(n))

    def inputs(i):
        pos = np.arange(lengths[i], lengths[i] + widths[i], dtype=np.int64)
        return prompts[i][lengths[i]:], pos, causal_mask(lengths[i], pos, sliding)

    def new_kv(i):
        return [engine.cache.read(layer, lengths[i], lengths[i] + widths[i], i) for layer in layers]

    engine.reset()
    try:
        alone = []
        for i in seqs:
            engine.extend(prompts[i][:lengths[i]], seq=i)
            row = engine.forward(*inputs(i), seq=i).copy()
            alone.append((row, new_kv(i)))
        same = True
        for order, given in ((seqs, False), (seqs[::-1], True), (seqs[1:3], False), (seqs[::2], True)):
            if len(order) < 2:
                continue
            ids, positions, masks = map(list, zip(*[inputs(i) for i in order]))
            rows = engine._forward_batch(order, ids, positions, masks if given else None)
            for i, row in zip(order, rows):
                ref_row, ref_kv = alone[i]
                kv = new_kv(i)
                same &= np.array_equal(row, ref_row) and all(
                    np.array_equal(a, b) for x, y in zip(kv, ref_kv) for a, b in zip(x, y))
    finally:
        engine.reset()
    engine.batch_calls = same
    if not same:
        engine.batch_warning = (
            f"the {engine.info.role} graph's logits for a sequence change when it shares a call with "
            f"other sequences on the {engine.provider} provider: batched decoding runs one sequence per "
            "call (exact, without the batching gain)")
        if warn:
            engine.warn_unbatched()
    return same
