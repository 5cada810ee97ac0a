"""Scale benchmark of the exporter (not CI): export time, peak memory, bundle size, quantized error.

Builds random-weight checkpoints with the published Qwen2.5-0.5B / 1.5B configs into a cache
folder outside the repository (scripts/scale_checkpoints.py, reused when present), then runs
``specdec-export`` on each in its own process (so ``ru_maxrss`` is that export's peak) and
prints a markdown table plus the stage breakdown; raw figures go to ``<out>/results.json``.

    python scripts/bench_scale.py --cache /work/cache --runs all
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scale_checkpoints import build  # noqa: E402

# name: (checkpoint, extra specdec-export arguments)
RUNS = {
    "0.5b-fp32": ("qwen2.5-0.5b", []),
    "0.5b-int4": ("qwen2.5-0.5b", ["--quantize", "int4"]),
    "0.5b-int4-float-embedding": ("qwen2.5-0.5b", ["--quantize", "int4", "--float-embedding"]),
    "0.5b-int8": ("qwen2.5-0.5b", ["--quantize", "int8"]),
    "0.5b-fp16": ("qwen2.5-0.5b", ["--dtype", "fp16"]),
    "1.5b-fp32": ("qwen2.5-1.5b", []),
    "1.5b-int4": ("qwen2.5-1.5b", ["--quantize", "int4"]),
    # 3B: the fp32 graph is 12.4 GB, so validating it needs ~12 GiB (the ONNX Runtime session)
    "3b-int4": ("qwen2.5-3b", ["--quantize", "int4"]),
    "3b-fp32-no-validate": ("qwen2.5-3b", ["--no-validate"]),
}
DEFAULT = ["0.5b-fp32", "0.5b-int4", "0.5b-int4-float-embedding", "1.5b-fp32", "1.5b-int4"]


def run(name: str, cache: Path, out: Path) -> dict:
    ckpt_name, extra = RUNS[name]
    ckpt = build(ckpt_name, cache / "ckpt")
    bundle = out / name
    if bundle.exists():
        shutil.rmtree(bundle)
    cmd = [sys.executable, "-m", "specdec_rt.cli.export_cli", "--target", str(ckpt), "--out", str(bundle),
           "--quiet", *extra]
    print("$", " ".join(["specdec-export", "--target", str(ckpt), "--out", str(bundle), "--quiet", *extra]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    manifest = json.loads((bundle / "manifest.json").read_text())
    info = manifest["models"]["target"]
    v = info["validation"]
    q = v.get("quantized")
    report = q or v or {}  # --no-validate: no report
    graph_bytes = info["size_bytes"]
    row = {
        "run": name, "checkpoint": ckpt_name, "args": extra, "wall_seconds": round(wall, 1),
        "export_seconds": manifest["export_seconds"], "stage_seconds": manifest["stage_seconds"],
        "stage_peak_rss_mib": {k: v >> 20 for k, v in manifest.get("stage_peak_rss_bytes", {}).items()},
        "peak_rss_bytes": manifest["export_peak_rss_bytes"], "graph_bytes": graph_bytes,
        "bundle_bytes": sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()),
        "peak_over_graph": round(manifest["export_peak_rss_bytes"] / graph_bytes, 2),
        "num_parameters": info["num_parameters"],
        "max_logit_error": report.get("max_logit_error"), "max_abs_logit": report.get("max_abs_logit"),
        "top1_agreement": report.get("top1_agreement"), "quantized": bool(q),
        "validation_seconds": report.get("seconds"),
    }
    print(f"  {row['wall_seconds']} s, peak {row['peak_rss_bytes'] / 2**30:.2f} GiB, "
          f"graph {graph_bytes / 1e6:.0f} MB, error {row['max_logit_error']}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| run | wall time | peak RSS | graph | peak / graph | max logit error (max abs logit) | top-1 agree |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        err = "not validated" if r["max_logit_error"] is None else f"{r['max_logit_error']:.2g} ({r['max_abs_logit']:.2f})"
        top1 = "-" if r["top1_agreement"] is None else f"{r['top1_agreement']:.2f}"
        lines.append(
            f"| {r['run']} | {r['wall_seconds']:.0f} s | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
            f"{r['graph_bytes'] / 1e6:,.0f} MB | {r['peak_over_graph']:.2f} | {err} | {top1} |")
    lines += ["", "| run | " + " | ".join(["load", "reference", "build", "validate"]) + " | validation: session / cases |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        st, pk = r["stage_seconds"], r["stage_peak_rss_mib"]
        cells = []
        for stage in ("load", "reference", "build", "validate"):
            key = f"{stage} target"
            cells.append(f"{st.get(key, 0):.0f} s, {pk.get(key, 0) / 1024:.1f} GiB" if key in st else "-")
        vs = r["validation_seconds"] or {}
        lines.append(f"| {r['run']} | " + " | ".join(cells) + f" | {vs.get('session', 0):.0f} s / {vs.get('cases', 0):.0f} s |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=os.environ.get("SPECDEC_CACHE", "/work/cache"),
                    help="checkpoints go to <cache>/ckpt, bundles to <cache>/scale (outside the repo)")
    ap.add_argument("--runs", default=",".join(DEFAULT), help=f"comma list or 'all': {', '.join(RUNS)}")
    ap.add_argument("--keep", action="store_true", help="keep the bundles (default: delete each after measuring)")
    args = ap.parse_args()
    cache = Path(args.cache)
    out = cache / "scale"
    out.mkdir(parents=True, exist_ok=True)
    names = list(RUNS) if args.runs == "all" else [r.strip() for r in args.runs.split(",") if r.strip()]
    results = out / "results.json"  # rows of earlier runs are kept, the same run replaced
    previous = json.loads(results.read_text()) if results.is_file() else []
    rows = []
    for name in names:
        rows.append(run(name, cache, out))
        if not args.keep:
            shutil.rmtree(out / name, ignore_errors=True)
        merged = [r for r in previous if r["run"] not in {x["run"] for x in rows}] + rows
        results.write_text(json.dumps(sorted(merged, key=lambda r: list(RUNS).index(r["run"])), indent=2))
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
