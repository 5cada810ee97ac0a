"""Execution-provider selection with errors that say what to install."""
from __future__ import annotations

import onnxruntime as ort

from specdec_rt.errors import BackendUnavailableError  # noqa: F401 - defined there, re-exported here


_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt-ep": "TensorrtExecutionProvider",
}

_INSTALL_HINT = {
    "CUDAExecutionProvider": (
        "install onnxruntime-gpu (pip install 'specdec-rt[gpu]'; on JetPack 6 use the "
        "onnxruntime-gpu 1.21/1.22 wheel built for Jetson) and make sure a CUDA GPU is visible"
    ),
    "TensorrtExecutionProvider": (
        "install onnxruntime-gpu built with TensorRT and the TensorRT libraries (JetPack ships "
        "TensorRT 10.3); see deploy/jetson/README.md"
    ),
}


def resolve_provider(provider: str) -> str:
    """Map a user-facing name (``cpu``, ``cuda``, ``tensorrt``) to an ORT provider name."""
    name = _ALIASES.get(provider.lower(), provider)
    if name not in _ALIASES.values():
        raise ValueError(f"unknown provider '{provider}'; choose one of: cpu, cuda, tensorrt, trt "
                         "(trt = native TensorRT engines built by specdec-export --trt)")
    available = ort.get_available_providers()
    if name not in available:
        hint = _INSTALL_HINT.get(name, "")
        raise BackendUnavailableError(
            f"provider '{provider}' ({name}) is not available in this onnxruntime build "
            f"(available: {', '.join(available)}); {hint}"
        )
    return name


def device_of(provider_name: str) -> str:
    """Where this provider's KV buffers live: 'cpu' or 'cuda'."""
    return "cpu" if provider_name == "CPUExecutionProvider" else "cuda"
