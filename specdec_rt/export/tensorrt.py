"""Native TensorRT engines for a bundle: ``<bundle>/target.engine`` and ``<bundle>/draft.engine``.

Written against the documented TensorRT 10.x Python API (``trt.Builder``, ``trt.OnnxParser``,
optimization profiles, ``build_serialized_network``); NOT run on real hardware in this project yet
(docs/backends.md). Engines are specific to the GPU and the TensorRT version that built them, so
build them on the device that runs them (on a Jetson: ``python -m specdec_rt.export.tensorrt B``).

Two optimization profiles per engine, because one profile cannot be tuned for both call shapes:

* profile 0, prefill: ``S`` in ``1..max_prefill``, ``P`` in ``0..max_context-1``;
* profile 1, verify/decode: ``S`` in ``1..max_verify`` (the K+1 tokens of a verify call).

Precision: on TensorRT 10.x an fp32 graph with ``fp16=True`` is built weakly typed with
``BuilderFlag.FP16`` (TensorRT picks per-layer precision; I/O tensors keep their ONNX types).
TensorRT 11 removed weak typing: every network is strongly typed and runs in the precision the
ONNX graph declares, so fp16 there needs an fp16 graph (``specdec-export --dtype fp16``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specdec_rt.runtime.core.bundle import MANIFEST, load_bundle, sha256_file
from specdec_rt.runtime.engines.providers import BackendUnavailableError
from specdec_rt.runtime.engines.trt import PREFILL, VERIFY, import_tensorrt  # noqa: F401 - shared

__all__ = ["build_engines", "build_engine", "profile_shapes", "import_tensorrt", "PREFILL", "VERIFY"]


def trt_major(trt) -> int:
    return int(str(trt.__version__).split(".")[0])


def profile_shapes(num_layers: int, num_kv_heads: int, head_dim: int, max_context: int,
                   s_max: int, s_opt: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) of every input for one profile: S in 1..s_max, P in 0..max_context-S."""
    p_max = max_context - 1
    p_opt = max(0, min(max_context // 2, max_context - s_opt))
    shapes: dict[str, tuple[tuple[int, ...], ...]] = {
        "input_ids": ((1, 1), (1, s_opt), (1, s_max)),
        "position_ids": ((1, 1), (1, s_opt), (1, s_max)),
        "attention_mask": ((1, 1, 1, 1), (1, 1, s_opt, p_opt + s_opt), (1, 1, s_max, max_context)),
    }
    for layer in range(num_layers):
        for kind in ("past_key", "past_value"):
            shapes[f"{kind}.{layer}"] = ((1, 0, num_kv_heads, head_dim),
                                         (1, p_opt, num_kv_heads, head_dim),
                                         (1, p_max, num_kv_heads, head_dim))
    return shapes


def build_engine(onnx_path: Path, out_path: Path, info, max_context: int, fp16: bool,
                 max_prefill: int, max_verify: int, timing_cache: Path,
                 workspace_bytes: int = 1 << 30) -> dict:
    """Parse one ONNX graph, build and serialize its engine; return its manifest entry."""
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    major = trt_major(trt)
    graph_fp16 = info.dtype == "fp16"
    weak_fp16 = fp16 and not graph_fp16 and major < 11 and hasattr(trt.BuilderFlag, "FP16")
    flags = 0
    creation = trt.NetworkDefinitionCreationFlag
    if not weak_fp16 and hasattr(creation, "STRONGLY_TYPED"):
        flags = 1 << int(creation.STRONGLY_TYPED)
    elif hasattr(creation, "EXPLICIT_BATCH") and major < 10:  # TensorRT 8.x
        flags = 1 << int(creation.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # from the file, so external data resolves
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if weak_fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    cache_bytes = timing_cache.read_bytes() if timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)

    max_prefill = max(1, min(max_prefill, max_context))
    max_verify = max(1, min(max_verify, max_prefill))
    profiles = {}
    for index, (name, s_max, s_opt) in enumerate(
            [("prefill", max_prefill, min(128, max_prefill)), ("verify", max_verify, min(5, max_verify))]):
        shapes = profile_shapes(info.num_layers, info.num_kv_heads, info.head_dim, max_context, s_max, s_opt)
        profile = builder.create_optimization_profile()
        for tensor, (lo, opt, hi) in shapes.items():
            profile.set_shape(tensor, lo, opt, hi)
        got = config.add_optimization_profile(profile)
        if got != index:
            raise RuntimeError(f"TensorRT rejected the {name} optimization profile for {onnx_path}")
        profiles[name] = {"index": index, "max_tokens": s_max, "opt_tokens": s_opt,
                          "max_past": max_context - 1}

    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine for {onnx_path} (see the log above)")
    out_path.write_bytes(bytes(serialized))
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    precision = "fp16" if graph_fp16 or weak_fp16 else "fp32"
    return {
        "file": out_path.name, "graph": info.graph, "profiles": profiles,
        "tensorrt_version": str(trt.__version__), "fp16": precision == "fp16",
        "precision": precision, "strongly_typed": not weak_fp16,
        "max_context": max_context, "build_seconds": round(time.perf_counter() - t0, 2),
    }


def build_engines(bundle_dir: str | Path, fp16: bool = True, max_prefill: int = 512,
                  max_verify: int = 16, workspace_bytes: int = 1 << 30) -> dict:
    """Build ``<role>.engine`` for every model of a portable bundle and record them in its manifest.

    Adds an ``engines`` section (file, profiles, TensorRT version, precision) and the engines'
    sha256 to ``files``, so ``load_bundle`` verifies them like every other bundle file.
    """
    trt = import_tensorrt()
    root = Path(bundle_dir)
    bundle = load_bundle(root)
    for info in filter(None, (bundle.target, bundle.draft)):
        if info.fused_ops:
            raise BackendUnavailableError(
                f"{info.graph} uses ONNX Runtime contrib ops, which TensorRT cannot parse; "
                "re-export with specdec-export --portable (or --trt)")
    timing_cache = root / "trt_timing.cache"
    engines = {}
    for info in filter(None, (bundle.target, bundle.draft)):
        out = root / f"{info.role}.engine"
        engines[info.role] = build_engine(root / info.graph, out, info, bundle.max_context, fp16,
                                          max_prefill, max_verify, timing_cache, workspace_bytes)
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["engines"] = engines
    manifest["engines_built_with"] = {"tensorrt": str(trt.__version__), "fp16_requested": fp16}
    for entry in engines.values():
        manifest["files"][entry["file"]] = sha256_file(root / entry["file"])
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return engines


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec_rt.export.tensorrt BUNDLE``: build engines on the device that runs them."""
    ap = argparse.ArgumentParser(prog="python -m specdec_rt.export.tensorrt",
                                 description="Build native TensorRT engines into a portable bundle.")
    ap.add_argument("bundle")
    ap.add_argument("--fp32", action="store_true", help="no fp16 (TensorRT 10.x weak typing)")
    ap.add_argument("--max-prefill", type=int, default=512)
    ap.add_argument("--max-verify", type=int, default=16)
    ap.add_argument("--workspace-mb", type=int, default=1024)
    args = ap.parse_args(argv)
    try:
        engines = build_engines(args.bundle, fp16=not args.fp32, max_prefill=args.max_prefill,
                                max_verify=args.max_verify, workspace_bytes=args.workspace_mb << 20)
    except (BackendUnavailableError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(engines, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
