"""Preallocated per-layer KV buffers addressed by pointer, on the host or on a CUDA device.

Layout per layer and kind: ``[seqs, max_len, Hkv, D]``, sequence-major: one sequence per batch
row (``seqs`` is 1 unless batched decoding is enabled), position i of sequence s at ``[s, i]``. A
sequence's valid prefix ``[s, :P]`` is one contiguous block, so a one-sequence call feeds the past
to ONNX Runtime by pointer with no copy, and the graph's new K/V outputs are bound straight at
byte offset ``P`` of the same buffer. Rolling back is setting the sequence's ``P``: rejected
tokens were never committed. Host buffers come from ``np.zeros`` (calloc): sequences a run never
uses cost no resident memory.
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
        shape = (seqs, max_len, num_kv_heads, head_dim)
        # one allocation per layer and kind, for the life of the engine
        self.keys = [np.zeros(shape, dtype=self.dtype) for _ in range(num_layers)]
        self.values = [np.zeros(shape, dtype=self.dtype) for _ in range(num_layers)]
        self._key_ptrs = [a.ctypes.data for a in self.keys]
        self._value_ptrs = [a.ctypes.data for a in self.values]

    def key_ptr(self, layer: int, offset: int, seq: int = 0) -> int:
        return self._key_ptrs[layer] + (seq * self.max_len + offset) * self.token_bytes

    def value_ptr(self, layer: int, offset: int, seq: int = 0) -> int:
        return self._value_ptrs[layer] + (seq * self.max_len + offset) * self.token_bytes

    def read(self, layer: int, start: int, stop: int, seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Copies of K and V for positions [start, stop) (for tests and debugging)."""
        return self.keys[layer][seq, start:stop].copy(), self.values[layer][seq, start:stop].copy()

    def gather_into(self, src_slots: list[int], dst_start: int, seq: int = 0) -> None:
        """Move K/V of ``src_slots`` to consecutive slots from ``dst_start`` (tree compaction).

        Sources are always at or after their destinations (accepted path nodes are compacted
        toward the front), so a forward pass of copies never overwrites an unread source.
        """
        for j, src in enumerate(src_slots):
            dst = dst_start + j
            if src == dst:
                continue
            for layer in range(self.num_layers):
                self.keys[layer][seq, dst] = self.keys[layer][seq, src]
                self.values[layer][seq, dst] = self.values[layer][seq, src]


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
