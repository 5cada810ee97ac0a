"""``specdec-export``: Hugging Face checkpoints -> validated verify graphs + bundle."""
from __future__ import annotations

import argparse
import json
import sys

from specdec_rt.cli.common import fail
from specdec_rt.export.quantize import BLOCK_SIZES, DEFAULT_BLOCK_SIZE


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="specdec-export",
        description="Export a target (and draft) Hugging Face checkpoint folder or GGUF file into a specdec-rt bundle.",
    )
    ap.add_argument("--target", required=True,
                    help="target checkpoint folder (config.json + weights) or GGUF file (dequantised once into --gguf-cache)")
    ap.add_argument("--draft", default=None, help="draft checkpoint folder or GGUF file (optional)")
    ap.add_argument("--out", required=True, help="bundle directory to write")
    ap.add_argument("--gguf-cache", default=None, metavar="DIR",
                    help="where GGUF inputs are dequantised into checkpoint folders, once per file "
                         "(default: ~/.cache/specdec-rt/gguf)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"],
                    help="graph dtype: fp32 (default; exact for bf16/fp16/fp32 checkpoints) or fp16 (half the "
                         "size); bf16 is refused: ONNX Runtime's CPU EP has no bfloat16 MatMul/Add kernels")
    ap.add_argument("--quantize", default=None, choices=["auto", "int8", "int4", "w8a8"],
                    help="auto: measure int4 and w8a8 on this CPU (a second or two) and export the faster, "
                         "saying why in one line (the recommended setting for CPUs); "
                         "int4 / int8: weight-only MatMulNBits; w8a8: 7-bit weights per output channel times "
                         "8-bit activations per row in an integer GEMM, whose rows never depend on the other "
                         "rows of a call (no padded one-row calls on any CPU) and whose verify cost stays flat on "
                         "AVX2 (docs/design.md, 'Exactness')")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, choices=list(BLOCK_SIZES),
                    help="with --quantize: weights per scale along K (default 32). 16: ONNX Runtime's one-row and "
                         "multi-row int4 kernels give the same bits on AVX2-only CPUs too (no padded one-row "
                         "calls there), at ~1.2x the bytes per weight (docs/design.md, 'Exactness')")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="cut the draft's LM head to N tokens (the N most frequent by BPE merge order, plus every "
                         "special token): cheaper draft calls, proposals only among those tokens; verification "
                         "and output are unchanged (e.g. 32768 for 152k-token vocabularies)")
    ap.add_argument("--draft-head", default=None, metavar="DIR",
                    help="an EAGLE-3 feature head folder (config.json + model.safetensors or pytorch_model.bin, "
                         "published EAGLE-3 names) trained for --target: the target graph gets a 'features' output "
                         "for the head's layers and the head's graphs go to head/ (with or without --draft)")
    ap.add_argument("--head-quantize", default="auto", choices=["auto", "int4", "int8", "w8a8", "none"],
                    help="the --draft-head graphs' weights: auto (default) = int4 unless --quantize is given (then "
                         "its scheme, or float if --quantize-models leaves out head) or --portable (float: "
                         "MatMulNBits is a contrib op); the head only proposes, so "
                         "this never changes the output, and int4 makes a head call ~2-3x cheaper in the loop")
    ap.add_argument("--draft-quantize", default="auto", choices=["auto", "int4", "int8", "w8a8", "none"],
                    help="the draft model's weights: auto (default) = as --quantize / --quantize-models; e.g. "
                         "--quantize w8a8 --draft-quantize int4: a row-invariant target with a flat verify and a "
                         "draft at half the bytes per call (the draft only proposes: output unchanged)")
    ap.add_argument("--float-embedding", action="store_true",
                    help="with --quantize: keep the embedding table in the graph dtype (larger, no "
                         "quantization error on the lookup)")
    ap.add_argument("--quantize-models", default="target,draft,head",
                    help="which models --quantize applies to (default: target,draft,head; head: the "
                         "--draft-head graphs)")
    ap.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17; JetPack 6 runs <= 18)")
    ap.add_argument("--max-context", type=int, default=None, help="max positions (default: model's, capped at 4096)")
    ap.add_argument("--portable", action="store_true",
                    help="standard ONNX ops only (no com.microsoft contrib ops), e.g. for TensorRT")
    ap.add_argument("--draft-plain-attention", action="store_true",
                    help="the draft's (and --draft-head's) attention as decomposed ops (MatMul/Softmax/...) "
                         "instead of one ONNX Attention node per layer (opset 23, ONNX Runtime >= 1.23); --portable implies it")
    ap.add_argument("--target-attention", default="fp64", choices=["fp64", "native", "fused"],
                    help="fp64 (default): the target sums attention in float64, so tree verification is "
                         "token-identical to target-only decoding; native: float32 sums in plain ops; fused: "
                         "one ONNX Attention node per layer (opset 23, ONNX Runtime >= 1.23), the fastest "
                         "target calls; native and fused are exact for chains only (trees are refused at run time)")
    ap.add_argument("--trt", action="store_true", help="also build native TensorRT engines (needs tensorrt)")
    ap.add_argument("--no-validate", action="store_true", help="skip the ORT-vs-PyTorch validation")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def _return_large_frees_to_the_os() -> None:
    """glibc raises its mmap threshold after large frees (up to 32 MiB), after which the
    exporter's many transient 1-64 MiB arrays (upcast modules, weight blocks) stay in the heap:
    on Qwen2.5-1.5B that added ~0.9 GiB to the peak. A fixed 1 MiB threshold returns them."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _return_large_frees_to_the_os()

    def run() -> int:
        from specdec_rt.export.pipeline import ExportOptions, export_pair

        choice = None
        if args.quantize == "auto":
            from specdec_rt.export.quant_choice import choose_quantization

            choice = choose_quantization(block_size=args.block_size)
            args.quantize = choice.scheme
            print(f"specdec-export: --quantize auto -> {choice.reason}", file=sys.stderr, flush=True)

        opts = ExportOptions(
            dtype=args.dtype, quantize=args.quantize,
            quantize_roles=tuple(r.strip() for r in args.quantize_models.split(",") if r.strip()),
            opset=args.opset, max_context=args.max_context, portable=args.portable or args.trt,
            draft_fused_attention=not args.draft_plain_attention, target_attention=args.target_attention,
            validate=not args.no_validate, progress=not args.quiet, quantize_embedding=not args.float_embedding,
            gguf_cache=args.gguf_cache,
            block_size=args.block_size, draft_vocab=args.draft_vocab, draft_head=args.draft_head,
            head_quantize=args.head_quantize, draft_quantize=args.draft_quantize,
        )
        manifest = export_pair(args.target, args.draft, args.out, opts)
        if args.trt:
            from specdec_rt.export.tensorrt import build_engines

            build_engines(args.out)
        summary = {}
        for role, m in manifest["models"].items():
            row = {k: m[k] for k in ("family", "num_parameters", "num_nodes", "size_bytes", "quantization")}
            quant = m["validation"].get("quantized")
            if quant:  # the quantized graph vs the PyTorch model (computing in float32)
                row["size_bytes_unquantized"] = m["size_bytes_unquantized"]
                row["quantized_max_logit_error"] = quant["max_logit_error"]
                row["quantized_top1_agreement"] = quant["top1_agreement"]
            else:
                row["max_logit_error"] = m["validation"].get("max_logit_error")
            row["peak_rss_bytes"] = m.get("export_peak_rss_bytes")
            summary[role] = row
        peak = manifest.get("export_peak_rss_bytes")
        print(json.dumps({"bundle": args.out, "export_seconds": manifest["export_seconds"],
                          "stage_seconds": manifest.get("stage_seconds"),
                          "stage_peak_rss_mib": {k: v >> 20 for k, v in manifest.get("stage_peak_rss_bytes", {}).items()},
                          "models": summary,
                          **({"quantize_choice": choice.to_json()} if choice else {}),
                          "export_peak_rss_bytes": peak}, indent=2))
        if peak:
            print(f"export peak RSS: {peak / 2**30:.2f} GiB (getrusage ru_maxrss)")
        return 0

    return fail(run)


if __name__ == "__main__":
    sys.exit(main())
