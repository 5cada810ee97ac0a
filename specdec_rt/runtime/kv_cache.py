"""Preallocated per-layer KV buffers addressed by pointer, on the host or on a CUDA device.

Layout per layer and kind: ``[1, max_len, Hkv, D]`` (batch 1, sequence-major). With batch 1 the
valid prefix ``[:, :P]`` is one contiguous block, so the past is fed to ONNX Runtime by pointer
with no copy, and the graph's new K/V outputs are bound straight at byte offset ``P`` of the same
buffer. Rolling back is setting ``P``: rejected tokens were never committed.
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
                 dtype: np.dtype) -> None:
        set_layout(self, num_layers, max_len, num_kv_heads, head_dim, dtype)
        shape = (1, max_len, num_kv_heads, head_dim)
        # one allocation per layer and kind, for the life of the engine
        self.keys = [np.zeros(shape, dtype=self.dtype) for _ in range(num_layers)]
        self.values = [np.zeros(shape, dtype=self.dtype) for _ in range(num_layers)]
        self._key_ptrs = [a.ctypes.data for a in self.keys]
        self._value_ptrs = [a.ctypes.data for a in self.values]

    def key_ptr(self, layer: int, offset: int) -> int:
        return self._key_ptrs[layer] + offset * self.token_bytes

    def value_ptr(self, layer: int, offset: int) -> int:
        return self._value_ptrs[layer] + offset * self.token_bytes

    def read(self, layer: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of K and V for positions [start, stop) (for tests and debugging)."""
        return self.keys[layer][0, start:stop].copy(), self.values[layer][0, start:stop].copy()

    def gather_into(self, src_slots: list[int], dst_start: int) -> None:
        """Move K/V of ``src_slots`` to consecutive slots from ``dst_start`` (tree compaction).

        Sources are always at or after their destinations (accepted path nodes are compacted
        toward the front), so a forward pass of copies never overwrites an unread source.
        """
        for j, src in enumerate(src_slots):
            dst = dst_start + j
            if src == dst:
                continue
            for layer in range(self.num_layers):
                self.keys[layer][0, dst] = self.keys[layer][0, src]
                self.values[layer][0, dst] = self.values[layer][0, src]


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
        self.device_id = device_id
        shape = [1, max_len, num_kv_heads, head_dim]
        alloc = lambda: ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype, "cuda", device_id)  # noqa: E731
        self.keys = [alloc() for _ in range(num_layers)]
        self.values = [alloc() for _ in range(num_layers)]
        self._key_ptrs = [v.data_ptr() for v in self.keys]
        self._value_ptrs = [v.data_ptr() for v in self.values]

    def read(self, layer: int, start: int, stop: int):  # pragma: no cover - needs a GPU
        k = self.keys[layer].numpy()[0, start:stop].copy()
        v = self.values[layer].numpy()[0, start:stop].copy()
        return k, v

    def gather_into(self, src_slots: list[int], dst_start: int) -> None:  # pragma: no cover
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
