"""Persistent IO bindings for the draft's one-sequence calls on the CPU, past bound in windows.

The draft runs a few hundred tiny graph calls per generated text; binding every input and output
afresh (4L + 4 of them) or going through ``session.run`` costs a measurable share of each call.
:class:`WindowBinder` keeps one binding per call width S and sequence, binds the past as the
first ``C = ceil(P / PAST_WINDOW) * PAST_WINDOW`` positions of the cache (so those bindings change
once per window) and masks ``[P, C)``. It lives apart from :mod:`specdec_rt.runtime.engines.ort`
because it is a self-contained optimisation of one path: the engine asks it for a step or a call
and falls back to its plain host path when the binder declines.
"""
from __future__ import annotations

import time
import numpy as np
import onnxruntime as ort

from specdec_rt.runtime.core.masks import NEG_INF

# The draft's one-sequence calls on the CPU feed the past in windows of this many positions
# (see WindowBinder.forward): the bindings then change once per window, not per call.
PAST_WINDOW = 32

# calls of up to this many rows keep their windowed bindings (one per S and sequence); larger
# ones (prefill chunks, whose S varies) bind afresh
KEPT_WINDOW_ROWS = 8


class _WindowBindings:
    """The persistent IO binding of :meth:`WindowBinder.forward` and what it is bound to."""

    def __init__(self, binding) -> None:
        self.binding = binding
        self.device = ort.OrtDevice.make("cpu", 0)._get_c_device()
        self.s = self.seq = self.c = self.keys = None
        self.token = 0
        self.copies: list = []
        self.causal_p: int | None = None  # the P whose causal one-token mask row is in place


class WindowBinder:
    """Windowed, persistent IO bindings of one session's calls over a host :class:`KVCache`.

    ``names``: ``(past_key, past_value, new_key, new_value)`` input/output names per layer;
    ``kv_elem`` / ``kv_shape_tail``: the K/V element type and ``[Hkv, D]``; ``window``: positions
    per window (the engine's ``past_window``). After each call ``seconds`` holds its time inside
    ONNX Runtime (the engine's accounting). ``bindings`` maps ``(S, sequence)`` to the bindings
    kept for calls of S rows (S up to ``KEPT_WINDOW_ROWS``).
    """

    def __init__(self, session: ort.InferenceSession, names: list[tuple[str, str, str, str]],
                 kv_elem, kv_shape_tail: list[int], vocab_size: int, window: int) -> None:
        self.session = session
        self.names = names
        self.kv_elem = kv_elem
        self.kv_shape_tail = kv_shape_tail
        self.vocab_size = vocab_size
        self.window = window
        self.seconds = 0.0
        self.bindings: dict[tuple[int, int], _WindowBindings] = {}
        # the C++ entry point: no per-call Python-side validation (the bindings are ours)
        self._run_binding = session._sess.run_with_iobinding

    def step(self, token: int, p: int, seq: int, cache) -> np.ndarray | None:
        """One causal token of sequence ``seq`` at position ``p`` (the draft's inner loop), if its
        one-row binding is already bound at the window ``p`` falls in; else None (the caller takes
        :meth:`forward` or its plain path). The mask row changes by one column from the previous
        step, so only that column is written (or the row, after a rollback or another call
        shape). Returns the logits row; commits nothing."""
        w = self.bindings.get((1, seq))
        if w is None or w.keys is not cache.keys or w.c != self._window_end(p, cache):
            return None
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
        self._run_window(w, 1, p, seq, cache)
        return w.logits[0, 0]

    def forward(self, input_ids, positions, mask, s: int, p: int, seq: int, cache) -> np.ndarray:
        """One call of ``s`` tokens of sequence ``seq`` after its ``p`` committed positions: what
        a call rebinds is only what changed since the last one.

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
        w = self.bindings.get((s, seq))
        if w is None:
            w = _WindowBindings(self.session.io_binding()._iobinding)
            if s <= KEPT_WINDOW_ROWS:  # a draft alternates S = 1 and 2: no rebinding per step
                self.bindings[(s, seq)] = w
        if w.s != s or w.seq != seq or w.keys is not cache.keys:
            self._window_buffers(w, s, seq, cache)
        c = self._window_end(p, cache)
        if w.c != c:
            self._window_past(w, c, cache)
        w.ids[0] = input_ids
        w.pos[0] = positions
        w.causal_p = None  # the mask row is rewritten whole: step starts afresh
        m = np.asarray(mask, dtype=np.float32).reshape(s, p + s)
        mb = w.mask[0, 0]
        mb[:, :p] = m[:, :p]
        mb[:, p:c] = NEG_INF
        mb[:, c:] = m[:, p:]
        self._run_window(w, s, p, seq, cache)
        return w.logits[0]

    def _window_end(self, p: int, cache) -> int:
        """C: the past bound for a sequence of ``p`` positions, ``p`` rounded up to the window."""
        return min(-(-p // self.window) * self.window, cache.stride)

    def _run_window(self, w: _WindowBindings, s: int, p: int, seq: int, cache) -> None:
        """Run the bound call and copy its ``s`` new K/V rows into the cache at position ``p``."""
        t0 = time.perf_counter()
        self._run_binding(w.binding, None)
        self.seconds = time.perf_counter() - t0
        o = (seq * cache.stride + p) * w.token
        n = s * w.token
        for flat, new in w.copies:  # the S new rows of each layer and kind, into the cache
            flat[o:o + n] = new

    def _window_buffers(self, w: _WindowBindings, s: int, seq: int, cache) -> None:
        """(Re)bind the buffers of S-row calls of sequence ``seq``: ids, positions, logits, new K/V."""
        ib, dev = w.binding, w.device
        if w.s != s:
            w.ids = np.zeros((1, s), dtype=np.int64)
            w.pos = np.zeros((1, s), dtype=np.int64)
            w.logits = np.zeros((1, s, self.vocab_size), dtype=np.float32)
            shape = [1, s] + self.kv_shape_tail
            w.new = [np.zeros(shape, dtype=cache.dtype) for _ in range(2 * len(self.names))]
            ib.bind_input("input_ids", w.ids)
            ib.bind_input("position_ids", w.pos)
            ib.bind_output("logits", dev, np.float32, [1, s, self.vocab_size], w.logits.ctypes.data)
            for (_, _, nk, nv), k, v in zip(self.names, w.new[0::2], w.new[1::2]):
                ib.bind_output(nk, dev, self.kv_elem, shape, k.ctypes.data)
                ib.bind_output(nv, dev, self.kv_elem, shape, v.ctypes.data)
            w.c = None  # the mask's shape depends on S
        if w.keys is not cache.keys or w.seq != seq:
            w.c = None  # the past's address depends on the sequence and the layout
        w.s, w.seq, w.keys = s, seq, cache.keys
        w.token = int(np.prod(self.kv_shape_tail))
        w.copies = [(f, x.reshape(-1)) for f, x in zip(cache.flat, w.new)]  # K0, V0, K1, V1, ...

    def _window_past(self, w: _WindowBindings, c: int, cache) -> None:
        """Bind the first ``c`` positions of the sequence as the past, and a ``[S, c + S]`` mask."""
        ib, dev = w.binding, w.device
        shape = [1, c] + self.kv_shape_tail
        for layer, (pk, pv, _, _) in enumerate(self.names):
            ib.bind_input(pk, dev, self.kv_elem, shape, cache.key_ptr(layer, 0, w.seq))
            ib.bind_input(pv, dev, self.kv_elem, shape, cache.value_ptr(layer, 0, w.seq))
        w.mask = np.empty((1, 1, w.s, c + w.s), dtype=np.float32)
        ib.bind_input("attention_mask", w.mask)
        w.c = c
        w.causal_p = None
