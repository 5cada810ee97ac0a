"""T(S)/T(1) of a bundle's int4 target graph per MatMulNBits accuracy level (issue 13's trap).

ONNX Runtime's MatMulNBits CPU kernel cost can grow with the number of rows S (onnxruntime
issue 25636), which would make verification of S = K+1 tokens barely cheaper than K+1 single
steps. This rewrites the accuracy_level attribute of every MatMulNBits node (a copy of the
graph file next to the same external data) and measures T(S) on a 128-token cache for each
level, with and without the one-row padding the runtime applies for exactness.

    python scripts/int4_curve.py BUNDLE [--levels 1,4] [--sizes 1,2,4,8,16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def with_level(graph: Path, level: int) -> Path:
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = level
    out = graph.with_name(f".{graph.stem}_acc{level}.onnx")
    onnx.save(model, str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--levels", default="1,4")
    ap.add_argument("--sizes", default="1,2,3,4,5,6,8,10,12,16")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from specdec_rt.runtime.core.bundle import load_bundle
    from specdec_rt.runtime.engines.ort import OrtEngine
    from specdec_rt.runtime.engines.probes import probe_row_invariance
    from specdec_rt.runtime.engines.sessions import enable_shared_thread_pool
    from specdec_rt.runtime.policies.cost_model import measure_engine

    enable_shared_thread_pool()
    bundle = load_bundle(args.bundle)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    for level in (int(x) for x in args.levels.split(",")):
        path = with_level(bundle.graph_path("target"), level)
        try:
            eng = OrtEngine(path, bundle.target, args.past + max(sizes) + 2, shared_pool=True)
            raw = measure_engine(eng, sizes, past=args.past, reps=args.reps)
            rows = probe_row_invariance(eng)
            padded = measure_engine(eng, sizes, past=args.past, reps=args.reps) if rows > 1 else raw
        finally:
            path.unlink()
        results[level] = {"sizes": sizes, "ms": [t * 1e3 for t in raw], "min_rows": rows,
                          "ms_as_run": [t * 1e3 for t in padded]}
        base = padded[0]
        print(f"accuracy_level {level}: T(1) = {raw[0] * 1e3:.1f} ms raw, {padded[0] * 1e3:.1f} ms as run "
              f"(min_rows {rows}); T(S)/T(1) as run: "
              + ", ".join(f"S={s}: {t / base:.2f}" for s, t in zip(sizes, padded)), flush=True)
        del eng
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
