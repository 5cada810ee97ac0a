"""Where a target call's time goes: ONNX Runtime's per-op profile of S-row calls on a P-token cache.

    python scripts/profile_target.py BUNDLE [--role target] [--sizes 1,5] [--past 256] [--reps 20]
        [--threads 2] [--out results/profile.json]

For each S it runs ``reps`` calls of S new tokens against a cache of P positions (random token ids,
causal mask, the graph contract's inputs) in a session with profiling on, then reads the trace:
kernel time per op type, per layer (from node names ``.../layers.N/...``), and the wall time of
each call that no kernel accounts for (ONNX Runtime's own overhead: allocation, scheduling, input
copies). Prints a markdown table per S and writes the JSON. The first two calls are warm-up and
are not counted. Times are means over the counted calls, in milliseconds per call.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec_rt.runtime.core.bundle import load_bundle  # noqa: E402
from specdec_rt.runtime.core.masks import causal_mask  # noqa: E402

LAYER = re.compile(r"^l(\d+)_|layers?[._/](\d+)")  # our node names: l{N}_...; HF-style: layers.N
WARMUP = 2


def feeds_for(info, s: int, p: int, rng: np.random.Generator) -> dict:
    pos = np.arange(p, p + s, dtype=np.int64)
    kv = np.dtype(info.kv_dtype)
    feeds = {"input_ids": rng.integers(0, info.vocab_size, (1, s), dtype=np.int64),
             "position_ids": pos[None],
             "attention_mask": causal_mask(p, pos).reshape(1, 1, s, p + s).astype(np.float32)}
    for i in range(info.num_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{i}"] = (rng.standard_normal((1, p, info.num_kv_heads, info.head_dim)) * 0.5).astype(kv)
    return feeds


def profile_calls(graph: Path, info, s: int, p: int, reps: int, threads: int) -> dict:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.enable_profiling = True
    opts.profile_file_prefix = os.path.join(tempfile.mkdtemp(), f"prof_s{s}")
    sess = ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])
    feeds = feeds_for(info, s, p, np.random.default_rng(0))
    for _ in range(reps + WARMUP):
        sess.run(None, feeds)
    trace = json.loads(Path(sess.end_profiling()).read_text())
    runs = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"][WARMUP:]
    if not runs:
        raise SystemExit("the profile has no model_run events")
    start = runs[0]["ts"]
    nodes = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start]
    by_op: dict[str, float] = defaultdict(float)
    by_layer: dict[str, float] = defaultdict(float)
    count_op: dict[str, int] = defaultdict(int)
    for e in nodes:
        op = e.get("args", {}).get("op_name", "?")
        by_op[op] += e["dur"]
        count_op[op] += 1
        m = LAYER.search(e["name"])
        layer = f"layer {int(m.group(1) or m.group(2)):02d}" if m else e["name"].removesuffix("_kernel_time")
        by_layer[layer if m else f"outside layers: {layer}"] += e["dur"]
    n = len(runs)
    wall = sum(r["dur"] for r in runs) / n / 1e3
    kernels = sum(by_op.values()) / n / 1e3
    return {
        "S": s, "P": p, "calls": n, "ms_per_call": wall, "ms_in_kernels": kernels,
        "ms_outside_kernels": wall - kernels, "nodes_per_call": len(nodes) / n,
        "by_op_ms": {k: v / n / 1e3 for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
        "nodes_by_op": {k: count_op[k] // n for k in by_op},
        "by_layer_ms": {k: v / n / 1e3 for k, v in sorted(by_layer.items())},
    }


def markdown(res: dict) -> str:
    lines = [f"### S = {res['S']}, P = {res['P']}: {res['ms_per_call']:.2f} ms per call "
             f"({res['ms_in_kernels']:.2f} in kernels, {res['ms_outside_kernels']:.2f} outside, "
             f"{res['nodes_per_call']:.0f} kernels)", "", "| op type | nodes | ms per call | share |", "|---|---|---|---|"]
    for op, ms in res["by_op_ms"].items():
        lines.append(f"| {op} | {res['nodes_by_op'][op]} | {ms:.3f} | {ms / res['ms_per_call']:.1%} |")
    layers = [v for k, v in res["by_layer_ms"].items() if k.startswith("layer")]
    if layers:
        lines.append(f"\nper layer: mean {np.mean(layers):.3f} ms, min {min(layers):.3f}, max {max(layers):.3f} "
                     f"({len(layers)} layers, {sum(layers):.2f} ms)")
    outside = sorted(((v, k) for k, v in res["by_layer_ms"].items() if not k.startswith("layer")), reverse=True)
    lines += [f"{k.removeprefix('outside layers: ')}: {v:.3f} ms" for v, k in outside[:4]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--role", default="target", choices=["target", "draft"])
    ap.add_argument("--sizes", default="1,5")
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    bundle = load_bundle(args.bundle)
    info = bundle.target if args.role == "target" else bundle.draft
    results = []
    for s in (int(x) for x in args.sizes.split(",")):
        res = profile_calls(bundle.graph_path(args.role), info, s, args.past, args.reps, args.threads)
        results.append(res)
        print(markdown(res), "\n", flush=True)
    if len(results) > 1:
        base = results[0]
        for r in results[1:]:
            print(f"T({r['S']})/T({base['S']}) = {r['ms_per_call'] / base['ms_per_call']:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"bundle": str(args.bundle), "role": args.role,
                                              "threads": args.threads, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
