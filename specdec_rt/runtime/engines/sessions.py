"""How this package opens ONNX Runtime sessions: options, providers, threads, version checks.

Every graph the runtime (and the export validator and the benchmarks) runs goes through these
helpers, so a process uses one threading setup (per-session pools, or ONNX Runtime's
process-wide pool once opted in) and the TensorRT / CUDA provider options derived from the
bundle are built in one place. Kept apart from the engines so that tools that only open a
session need none of the engine code.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_rt.runtime.core.bundle import ModelInfo
from specdec_rt.runtime.engines.providers import resolve_provider

# ONNX Attention (opset 23), which drafts exported with fused attention use: CPU kernel since 1.23
FUSED_ATTENTION_MIN_ORT = (1, 23)


def ort_version() -> tuple[int, int]:
    """The installed onnxruntime's (major, minor)."""
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


def pool_for_overlap(shared_thread_pool: bool) -> bool:
    """``shared_thread_pool`` for an overlapped generator: False (its own pools), with a warning
    where the process-wide pool was asked for or is already in use."""
    if shared_thread_pool or shared_pool_in_use():
        import warnings

        warnings.warn("overlap=True: the models run on ONNX Runtime's process-wide thread pool, "
                      "so the draft and the target compete for its workers (measured slower than "
                      "their own pools: load without shared_thread_pool in a process that never "
                      "enabled it)", stacklevel=4)
    return False


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


def ort_element_type(dtype: np.dtype):
    """The numpy type IO binding declares for a K/V buffer of ``dtype`` (fp16, else fp32)."""
    return np.float16 if np.dtype(dtype) == np.float16 else np.float32
