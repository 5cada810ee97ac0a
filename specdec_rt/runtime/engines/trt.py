"""Native TensorRT engine behind the same interface as :class:`OrtEngine` (``provider="trt"``).

Written against the documented TensorRT 10.x and cuda-python APIs; NOT run on real hardware in
this project yet (docs/backends.md says what was and was not run). No pycuda, no torch: device
memory, copies and the stream come from cuda-python's runtime bindings.

Memory: every buffer is allocated once. Per layer and kind a ``[1, max_len, Hkv, D]`` K/V buffer
(as in :mod:`specdec_rt.runtime.engines.kv_cache`); device buffers for ids, positions, mask and logits at
their largest per-call size; pinned host staging buffers for the transfers.

Alignment: TensorRT requires 256-byte aligned tensor addresses. ``cudaMalloc`` returns (at least)
256-byte aligned bases, so the past, which always starts at the buffer base, is aligned. The new
K/V rows belong at ``base + P * token_bytes``, which is misaligned whenever
``P * token_bytes % 256 != 0`` (possible when ``Hkv * D * itemsize`` is not a multiple of 256,
i.e. small models). Those calls write new K/V into aligned scratch outputs and copy the S rows
device-to-device into place on the same stream (cheap: S rows per layer). When ``token_bytes`` is
a multiple of 256 (typical: Hkv*D*2 >= 256 bytes and a power of two) the scratch is never allocated.
"""
from __future__ import annotations

import ctypes
import json
import os
import time
from pathlib import Path

import numpy as np

from specdec_rt.errors import ContextOverflowError
from specdec_rt.runtime.core.bundle import MANIFEST, BundleError, ModelInfo
from specdec_rt.runtime.engines.base import EngineBase
from specdec_rt.runtime.engines.kv_cache import set_layout
from specdec_rt.runtime.engines.providers import BackendUnavailableError

ALIGN = 256  # TensorRT's required I/O tensor address alignment
PREFILL, VERIFY = 0, 1  # optimization profile indices written by specdec_rt.export.tensorrt


def import_tensorrt():
    """``import tensorrt`` or a :class:`BackendUnavailableError` saying what to install."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise BackendUnavailableError(
            "native TensorRT needs the tensorrt Python package: pip install tensorrt (or "
            "pip install 'specdec-rt[trt]'); JetPack 6 ships it with TensorRT 10.3, so create the "
            f"venv with --system-site-packages (deploy/jetson/README.md). Import error: {exc}"
        ) from None
    return trt


def import_cudart():
    """cuda-python's runtime module (``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.8)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.8
        except ImportError as exc:
            raise BackendUnavailableError(
                "native TensorRT needs cuda-python for device memory and streams: pip install "
                "'cuda-python>=12,<13' (match the CUDA major version: 12.x on JetPack 6). "
                f"Import error: {exc}"
            ) from None
    return cudart


class Cuda:
    """The few CUDA runtime calls used here, each checked, on one stream."""

    def __init__(self, device_id: int = 0) -> None:
        self.rt = rt = import_cudart()
        self._ok = rt.cudaError_t.cudaSuccess
        err, count = rt.cudaGetDeviceCount()
        if err != self._ok or not count:
            raise BackendUnavailableError(f"no CUDA device is usable: {self._describe(err) if err != self._ok else 'none found'}")
        self.check(rt.cudaSetDevice(device_id), "cudaSetDevice")
        self.stream = self.check(rt.cudaStreamCreate(), "cudaStreamCreate")
        self.stream_handle = int(self.stream)
        self.H2D = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.D2H = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.D2D = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._device: list[int] = []
        self._host: list[int] = []

    def _describe(self, err) -> str:
        res = self.rt.cudaGetErrorString(err)
        text = res[1] if isinstance(res, tuple) else res
        return f"{getattr(err, 'name', err)} ({text.decode() if isinstance(text, bytes) else text})"

    def check(self, result, what: str):
        err = result[0] if isinstance(result, tuple) else result
        if err != self._ok:
            raise RuntimeError(f"{what} failed: {self._describe(err)}")
        if isinstance(result, tuple) and len(result) > 1:
            return result[1] if len(result) == 2 else result[1:]
        return None

    def malloc(self, nbytes: int) -> int:
        ptr = int(self.check(self.rt.cudaMalloc(max(nbytes, ALIGN)), f"cudaMalloc({nbytes})"))
        if ptr % ALIGN:  # documented to be at least 256-byte aligned; refuse silently wrong binds
            raise RuntimeError(f"cudaMalloc returned an address not aligned to {ALIGN} bytes")
        self._device.append(ptr)
        return ptr

    def host(self, nbytes: int) -> np.ndarray:
        """Pinned host memory as a uint8 array (async copies need page-locked memory)."""
        ptr = int(self.check(self.rt.cudaMallocHost(max(nbytes, 1)), f"cudaMallocHost({nbytes})"))
        self._host.append(ptr)
        return np.frombuffer((ctypes.c_ubyte * max(nbytes, 1)).from_address(ptr), dtype=np.uint8)

    def copy(self, dst: int, src: int, nbytes: int, kind) -> None:
        if nbytes:
            self.check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream), "cudaMemcpyAsync")

    def sync(self) -> None:
        self.check(self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self) -> None:
        for ptr in self._device:
            self.rt.cudaFree(ptr)
        for ptr in self._host:
            self.rt.cudaFreeHost(ptr)
        self._device, self._host = [], []
        if self.stream is not None:
            self.rt.cudaStreamDestroy(self.stream)
            self.stream = None


class TrtKVCache:
    """Device K/V buffers ``[1, max_len, Hkv, D]`` per layer and kind, addressed by pointer.

    Same interface as :class:`specdec_rt.runtime.engines.kv_cache.KVCache`; copies run on the engine's
    stream, so they are ordered before the next forward call without a synchronization.
    """

    device = "cuda"

    def __init__(self, cuda: Cuda, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: np.dtype) -> None:
        self.cuda = cuda
        set_layout(self, num_layers, max_len, num_kv_heads, head_dim, dtype)
        size = max_len * self.token_bytes
        self._key_ptrs = [cuda.malloc(size) for _ in range(num_layers)]
        self._value_ptrs = [cuda.malloc(size) for _ in range(num_layers)]

    def key_ptr(self, layer: int, offset: int) -> int:
        return self._key_ptrs[layer] + offset * self.token_bytes

    def value_ptr(self, layer: int, offset: int) -> int:
        return self._value_ptrs[layer] + offset * self.token_bytes

    def read(self, layer: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of K and V for positions [start, stop) (tests and debugging)."""
        out = []
        for ptr in (self.key_ptr(layer, start), self.value_ptr(layer, start)):
            arr = np.empty((max(stop - start, 0), self.heads, self.head_dim), dtype=self.dtype)
            self.cuda.copy(arr.ctypes.data, ptr, arr.nbytes, self.cuda.D2H)
            self.cuda.sync()
            out.append(arr)
        return out[0], out[1]

    def gather_into(self, src_slots: list[int], dst_start: int, seq: int = 0) -> None:
        """Tree compaction: one device-to-device copy per moved slot, layer and kind.

        Sources are at or after their destinations and copies are stream-ordered, so no copy
        reads a slot an earlier copy overwrote (same argument as the host cache). Single-slot
        copies never overlap, which ``cudaMemcpyAsync`` requires.
        """
        tb, d2d = self.token_bytes, self.cuda.D2D
        for j, src in enumerate(src_slots):
            dst = dst_start + j
            if src == dst:
                continue
            for ptrs in (self._key_ptrs, self._value_ptrs):
                for base in ptrs:
                    self.cuda.copy(base + dst * tb, base + src * tb, tb, d2d)


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class TrtEngine(EngineBase):
    """A deserialized ``<role>.engine`` plus its device KV cache; drop-in for ``OrtEngine``."""

    device = "cuda"
    provider = "trt"
    io_binding = True

    def __init__(self, graph_path: str | os.PathLike, info: ModelInfo, max_len: int,
                 bundle_root: Path | None = None, device_id: int = 0) -> None:
        trt = import_tensorrt()
        self.cuda = Cuda(device_id)  # raises BackendUnavailableError without cuda-python or a GPU
        graph_path = Path(graph_path)
        role = graph_path.parent.name
        root = Path(bundle_root) if bundle_root is not None else graph_path.parent.parent
        path = root / f"{role}.engine"
        if not path.is_file():
            raise BundleError(
                f"bundle {root} has no TensorRT engine for the {role} model ({path.name}); build it "
                f"on this device: python -m specdec_rt.export.tensorrt {root} (engines are "
                "specific to the GPU and TensorRT version)")
        self.info = info
        self.max_len = max_len
        self.vocab_size = info.vocab_size
        self.lengths = [0]  # one sequence (``length``): no batched calls on this engine
        self.calls = 0
        self.model_time = 0.0  # seconds from enqueue to the logits on the host (as OrtEngine's)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            built = _manifest_engine(root, role).get("tensorrt_version", "unknown")
            raise BundleError(
                f"TensorRT {trt.__version__} could not deserialize {path} (built with TensorRT "
                f"{built}); engines only load on the TensorRT version and GPU that built them: "
                f"rebuild with python -m specdec_rt.export.tensorrt {root}")
        self.context = self.engine.create_execution_context()
        self._check_engine(trt)

        kv_dtype = np.dtype(info.kv_dtype)
        self.cache = TrtKVCache(self.cuda, info.num_layers, max_len, info.num_kv_heads, info.head_dim, kv_dtype)
        self._names = [(f"past_key.{i}", f"past_value.{i}", f"new_key.{i}", f"new_value.{i}")
                       for i in range(info.num_layers)]
        cap, v, cuda = self.max_step, self.vocab_size, self.cuda
        self._d_ids, self._d_pos = cuda.malloc(cap * 8), cuda.malloc(cap * 8)
        self._d_mask = cuda.malloc(cap * max_len * 4)
        self._d_logits = cuda.malloc(cap * v * 4)
        self._h_ids = cuda.host(cap * 8).view(np.int64)
        self._h_pos = cuda.host(cap * 8).view(np.int64)
        self._h_mask = cuda.host(cap * max_len * 4).view(np.float32)
        self._h_logits = cuda.host(cap * v * 4).view(np.float32).reshape(cap, v)
        tb = self.cache.token_bytes
        self._scratch: list[tuple[int, int]] = []
        if tb % ALIGN:  # some P will put new K/V at a misaligned address: aligned scratch outputs
            slot = _round_up(cap * tb)
            base = cuda.malloc(slot * 2 * info.num_layers)
            self._scratch = [(base + (2 * i) * slot, base + (2 * i + 1) * slot) for i in range(info.num_layers)]
        self._profile = -1

    def _check_engine(self, trt) -> None:
        """Profiles and I/O dtypes must match what this runtime binds."""
        eng = self.engine
        n = eng.num_optimization_profiles
        self.prefill_profile = PREFILL
        self.verify_profile = VERIFY if n > 1 else PREFILL
        self.max_prefill = int(eng.get_tensor_profile_shape("input_ids", PREFILL)[2][1])
        self.max_verify = int(eng.get_tensor_profile_shape("input_ids", self.verify_profile)[2][1])
        self.max_step = max(self.max_prefill, self.max_verify)
        for idx in {self.prefill_profile, self.verify_profile}:
            max_past = int(eng.get_tensor_profile_shape("past_key.0", idx)[2][1])
            if max_past < self.max_len - 1:
                raise BundleError(
                    f"the TensorRT engine accepts at most {max_past} past positions but max_length is "
                    f"{self.max_len}; pass max_length <= {max_past + 1} or rebuild the engine")
        want = {"input_ids": np.int64, "position_ids": np.int64, "attention_mask": np.float32,
                "logits": np.float32, "past_key.0": np.dtype(self.info.kv_dtype),
                "new_key.0": np.dtype(self.info.kv_dtype)}
        for name, dtype in want.items():
            got = np.dtype(trt.nptype(eng.get_tensor_dtype(name)))
            if got != np.dtype(dtype):
                raise BundleError(f"TensorRT engine tensor '{name}' is {got}, the runtime binds "
                                  f"{np.dtype(dtype)}; rebuild the engine from this bundle's graph")

    # -- forward ----------------------------------------------------------------------------
    def forward(self, input_ids: np.ndarray, positions: np.ndarray, mask: np.ndarray,
                seq: int = 0) -> np.ndarray:
        """Run S new tokens against the committed cache; return host logits [S, V].

        Calls longer than the prefill profile allows are split into chunks; each chunk sees the
        K/V the previous chunks wrote, so the result equals one call.
        """
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        s, p = ids.shape[0], self.length
        if p + s > self.max_len:
            raise ContextOverflowError(f"{p + s} positions exceed the context of {self.max_len} tokens")
        msk = np.asarray(mask, dtype=np.float32).reshape(s, p + s)
        self.calls += 1
        if s <= self.max_step:
            return self._run(ids, pos, msk, p)
        out = np.empty((s, self.vocab_size), dtype=np.float32)
        for a in range(0, s, self.max_prefill):
            b = min(s, a + self.max_prefill)
            out[a:b] = self._run(ids[a:b], pos[a:b], msk[a:b, :p + b], p + a)
        return out

    def _run(self, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, p: int) -> np.ndarray:
        s, ctx, cuda, cache = ids.shape[0], self.context, self.cuda, self.cache
        profile = self.verify_profile if s <= self.max_verify else self.prefill_profile
        if profile != self._profile:
            ctx.set_optimization_profile_async(profile, cuda.stream_handle)
            self._profile = profile
        n_mask = s * (p + s)
        self._h_ids[:s] = ids
        self._h_pos[:s] = pos
        self._h_mask[:n_mask] = mask.reshape(-1)
        cuda.copy(self._d_ids, self._h_ids.ctypes.data, s * 8, cuda.H2D)
        cuda.copy(self._d_pos, self._h_pos.ctypes.data, s * 8, cuda.H2D)
        cuda.copy(self._d_mask, self._h_mask.ctypes.data, n_mask * 4, cuda.H2D)
        hkv, d = self.info.num_kv_heads, self.info.head_dim
        for name, shape, ptr in (("input_ids", (1, s), self._d_ids), ("position_ids", (1, s), self._d_pos),
                                 ("attention_mask", (1, 1, s, p + s), self._d_mask)):
            ctx.set_input_shape(name, shape)
            ctx.set_tensor_address(name, ptr)
        direct = (p * cache.token_bytes) % ALIGN == 0
        past = (1, p, hkv, d)
        for layer, (pk, pv, nk, nv) in enumerate(self._names):
            ctx.set_input_shape(pk, past)
            ctx.set_input_shape(pv, past)
            ctx.set_tensor_address(pk, cache.key_ptr(layer, 0))
            ctx.set_tensor_address(pv, cache.value_ptr(layer, 0))
            if direct:
                ctx.set_tensor_address(nk, cache.key_ptr(layer, p))
                ctx.set_tensor_address(nv, cache.value_ptr(layer, p))
            else:
                ctx.set_tensor_address(nk, self._scratch[layer][0])
                ctx.set_tensor_address(nv, self._scratch[layer][1])
        ctx.set_tensor_address("logits", self._d_logits)
        t0 = time.perf_counter()
        if not ctx.execute_async_v3(cuda.stream_handle):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")
        if not direct:
            nbytes = s * cache.token_bytes
            for layer, (ks, vs) in enumerate(self._scratch):
                cuda.copy(cache.key_ptr(layer, p), ks, nbytes, cuda.D2D)
                cuda.copy(cache.value_ptr(layer, p), vs, nbytes, cuda.D2D)
        cuda.copy(self._h_logits.ctypes.data, self._d_logits, s * self.vocab_size * 4, cuda.D2H)
        cuda.sync()
        self.model_time += time.perf_counter() - t0
        return self._h_logits[:s]

    def close(self) -> None:
        """Free device memory (also on garbage collection); the engine is unusable afterwards."""
        cuda = getattr(self, "cuda", None)
        if cuda is None:
            return
        self.context = None
        self.engine = None
        cuda.close()
        self.cuda = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def _manifest_engine(root: Path, role: str) -> dict:
    try:
        return json.loads((root / MANIFEST).read_text()).get("engines", {}).get(role, {})
    except (OSError, ValueError):
        return {}
