"""Which engine runs a graph: :func:`make_engine` picks ONNX Runtime or native TensorRT.

The generator asks for an engine by provider name and never learns which class it got. The
choice sits in its own module, above both engines, so that neither :mod:`specdec_rt.runtime.engines.ort`
nor :mod:`specdec_rt.runtime.engines.trt` imports the other (the old home of ``make_engine`` in
engine.py made an import circle with trt_engine.py, whose engine derives from the shared base).
"""
from __future__ import annotations

import os
from pathlib import Path

from specdec_rt.errors import BackendUnavailableError
from specdec_rt.runtime.core.bundle import ModelInfo
from specdec_rt.runtime.engines.ort import OrtEngine


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
        from specdec_rt.runtime.engines.trt import TrtEngine  # tensorrt only when asked for

        if max_batch > 1:
            raise BackendUnavailableError(
                f"batched decoding (max_batch {max_batch}) runs on the CPU provider in this version; "
                "the native TensorRT engines decode one sequence at a time (max_batch=1)")
        return TrtEngine(graph_path, info, max_len, bundle_root=bundle_root)
    return OrtEngine(graph_path, info, max_len, provider, threads, bundle_root, io_binding, shared_pool,
                     max_batch, spin)
