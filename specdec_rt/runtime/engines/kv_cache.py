"""Preallocated per-layer KV buffers addressed by pointer, on the host or on a CUDA device.

Layout per layer and kind: ``[seqs, stride, Hkv, D]``, sequence-major: one sequence per batch
row (``seqs`` is 1 unless batched decoding is enabled), position i of sequence s at ``[s, i]``. A
sequence's valid prefix ``[s, :P]`` is one contiguous block, so a one-sequence call feeds the past
to ONNX Runtime by pointer with no copy, and the graph's new K/V outputs are bound straight at
byte offset ``P`` of the same buffer. Rolling back is setting the sequence's ``P``: rejected
tokens were never committed.

Batched calls feed a range of sequences ``[lo:hi, :stride]`` as their past, also with no copy
(each row's mask hides the positions past its own length), so ``stride`` (positions per
sequence in the buffer) follows the longest sequence instead of the context: the host cache is
re-laid out (:meth:`KVCache.restride`, a move of every sequence's valid prefix) when a sequence
outgrows it, in steps of 64 positions. With one sequence the stride never matters (sequence 0
starts at offset 0). Host buffers come from ``np.zeros`` (calloc): what a run never touches costs
no resident memory.
"""
from __future__ import annotations

import numpy as np


def set_layout(cache, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype: np.dtype) -> None:
    """The shape attributes every cache variant (host, ORT device, TensorRT) exposes."""
    cache.num_layers = num_layers
    cache.max_len = max_len
    cache.heads = num_kv_heads
    cache.head_dim = head_dim
    cache.dtype = np.dtype(dtype)
    cache.token_bytes = num_kv_heads * head_dim * cache.dtype.itemsize


class KVCache:
    """Host buffers (numpy). Also the reference for the device variant's behaviour."""

    device = "cpu"

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: np.dtype, seqs: int = 1) -> None:
        set_layout(self, num_layers, max_len, num_kv_heads, head_dim, dtype)
        self.seqs = seqs
        # one allocation per layer and kind, for the life of the engine: [K0, V0, K1, V1, ...]
        size = seqs * max_len * num_kv_heads * head_dim
        self._flat = [np.zeros(size, dtype=self.dtype) for _ in range(2 * num_layers)]
        self._key_ptrs = [f.ctypes.data for f in self._flat[0::2]]
        self._value_ptrs = [f.ctypes.data for f in self._flat[1::2]]
        self._set_stride(max_len)

    @property
    def flat(self) -> list[np.ndarray]:
        """The buffers themselves, one flat array per layer and kind: ``[K0, V0, K1, V1, ...]``
        (each sequence at ``seq * stride`` positions; writers of raw rows use them)."""
        return self._flat

    def _set_stride(self, stride: int) -> None:
        self.stride = stride
        shape = (self.seqs, stride, self.heads, self.head_dim)
        n = self.seqs * stride * self.heads * self.head_dim
        views = [f[:n].reshape(shape) for f in self._flat]
        self.keys, self.values = views[0::2], views[1::2]

    def restride(self, stride: int, lengths: list[int]) -> None:
        """Lay sequences out ``stride`` positions apart, keeping sequence s's first
        ``lengths[s]`` positions (every length must fit the new stride)."""
        old = self.stride
        if stride == old:
            return
        tok = self.heads * self.head_dim
        # growing moves sequences to higher addresses: last first; shrinking: first first
        order = range(self.seqs - 1, 0, -1) if stride > old else range(1, self.seqs)
        for f in self._flat:
            for q in order:
                n = lengths[q] * tok
                if n:
                    f[q * stride * tok:q * stride * tok + n] = f[q * old * tok:q * old * tok + n]
        self._set_stride(stride)

    def key_ptr(self, layer: int, offset: int, seq: int = 0) -> int:
        return self._key_ptrs[layer] + (seq * self.stride + offset) * self.token_bytes

    def value_ptr(self, layer: int, offset: int, seq: int = 0) -> int:
        return self._value_ptrs[layer] + (seq * self.stride + offset) * self.token_bytes

    def read(self, layer: int, start: int, stop: int, seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Copies of K and V for positions [start, stop) (for tests and debugging)."""
        return self.keys[layer][seq, start:stop].copy(), self.values[layer][seq, start:stop].copy()

    def gather_into(self, src_slots: list[int], dst_start: int, seq: int = 0) -> None:
        """Move K/V of ``src_slots`` to consecutive slots from ``dst_start`` (tree compaction).

        Sources are always at or after their destinations (accepted path nodes are compacted
        toward the front), so a forward pass of copies never overwrites an unread source.
        """
        src = np.asarray(src_slots, dtype=np.intp)
        dst = np.arange(dst_start, dst_start + len(src), dtype=np.intp)
        moved = src != dst
        if not moved.any():
            return
        src, dst = src[moved], dst[moved]
        # one fancy-indexed copy per layer and kind (the gather reads every source first)
        for layer in range(self.num_layers):
            keys, values = self.keys[layer][seq], self.values[layer][seq]
            keys[dst] = keys[src]
            values[dst] = values[src]


class CudaKVCache(KVCache):
    """Device-resident buffers as ONNX Runtime ``OrtValue``s (CUDA / TensorRT EPs).

    Allocated once; the engine binds raw device pointers at offsets exactly as for the host
    buffers. Tree compaction needs a device-to-device copy, done with cuda-python.
    """

    device = "cuda"

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: np.dtype, device_id: int = 0) -> None:  # pragma: no cover - needs a GPU
        import onnxruntime as ort

        set_layout(self, num_layers, max_len, num_kv_heads, head_dim, dtype)
        self.seqs = 1  # batched decoding (several sequences) runs on the host cache only
        self.stride = max_len
        self.device_id = device_id
        shape = [1, max_len, num_kv_heads, head_dim]
        alloc = lambda: ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype, "cuda", device_id)  # noqa: E731
        self.keys = [alloc() for _ in range(num_layers)]
        self.values = [alloc() for _ in range(num_layers)]
        self._key_ptrs = [v.data_ptr() for v in self.keys]
        self._value_ptrs = [v.data_ptr() for v in self.values]

    def read(self, layer: int, start: int, stop: int, seq: int = 0):  # pragma: no cover - needs a GPU
        k = self.keys[layer].numpy()[0, start:stop].copy()
        v = self.values[layer].numpy()[0, start:stop].copy()
        return k, v

    def gather_into(self, src_slots: list[int], dst_start: int, seq: int = 0) -> None:  # pragma: no cover
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            try:
                from cuda import cudart  # cuda-python < 12.8
            except ImportError as exc:
                raise RuntimeError(
                    "tree speculation on a CUDA device needs cuda-python for the K/V compaction "
                    "copy: pip install cuda-python"
                ) from exc
        kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        for j, src in enumerate(src_slots):
            dst = dst_start + j
            if src == dst:
                continue
            for layer in range(self.num_layers):
                for ptrs in (self._key_ptrs, self._value_ptrs):
                    base = ptrs[layer]
                    cudart.cudaMemcpy(base + dst * self.token_bytes, base + src * self.token_bytes,
                                      self.token_bytes, kind)
