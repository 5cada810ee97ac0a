"""Per-call latency of ONNX graphs alone (no engine): ours (the bundle's graph contract) and
onnxruntime-genai's builder graphs, each through ONNX Runtime's C++ run entry point on one
intra-op thread, S new tokens on P cached zeros; minimum over 100 alternating blocks of 5 calls.

    python scripts/graph_latency_raw.py out/peer-models/draft/model.onnx out/reference-bundle/draft/model.onnx

Used for docs/benchmarks.md ("Draft graph", issue 12): it separates the graph's cost from the
engine's (``specdec-bench --compare-graphs`` times ours through ``engine.forward``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec_rt.bench.graphs import _feeds_for_genai  # noqa: E402
from specdec_rt.runtime.engines.sessions import session_options  # noqa: E402


def _feeds(sess: ort.InferenceSession, path: Path, s: int, p: int) -> dict:
    names = [i.name for i in sess.get_inputs()]
    if "past_key_values.0.key" in names:  # genai's graph
        cfg = json.loads((path.parent / "genai_config.json").read_text())
        return _feeds_for_genai(sess, s, p, cfg["model"]["decoder"]["head_size"])
    visible = np.arange(p + s)[None, :] <= (p + np.arange(s))[:, None]
    feeds = {"input_ids": np.zeros((1, s), np.int64), "position_ids": np.arange(p, p + s)[None],
             "attention_mask": np.where(visible, 0, -np.inf).astype(np.float32)[None, None]}
    for inp in sess.get_inputs():
        if inp.name.startswith("past"):
            feeds[inp.name] = np.zeros((1, p, inp.shape[2], inp.shape[3]), np.float32)
    return feeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graphs", nargs="+", type=Path)
    ap.add_argument("--sizes", default="1,5")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=100)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    fns = {}
    for path in args.graphs:
        sess = ort.InferenceSession(str(path), session_options(args.threads), providers=["CPUExecutionProvider"])
        outs = [o.name for o in sess.get_outputs()]
        for s in sizes:
            feeds = _feeds(sess, path, s, args.past)
            fns[(path, s)] = (lambda run, o, f: (lambda: run(o, f, None)))(sess._sess.run, outs, feeds)
    best = {k: float("inf") for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(args.blocks):
        for key, fn in fns.items():
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                best[key] = min(best[key], time.perf_counter() - t0)
    for path in args.graphs:
        print(f"{str(path):48s} " + "  ".join(f"S={s}: {best[(path, s)] * 1e3:.4f} ms" for s in sizes))


if __name__ == "__main__":
    main()
