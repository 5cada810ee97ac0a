"""Graph quality: node count and per-call latency of our graph vs onnxruntime-genai's builder.

Both graphs come from the same checkpoint and run in plain ONNX Runtime sessions with the same
thread count; latency is the minimum over repeated calls (the least disturbed run) for S new
tokens on a cache of P positions, ours as the loop calls it (``engine.forward``: the graph and the
engine's feeding of it) against genai's ``session.run``, the two alternating in blocks of calls;
small graphs get more repeats (about a second of calls per system and S, 30 to 500).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdec_rt.runtime.core.masks import causal_mask
from specdec_rt.runtime.engines.sessions import session_options


def _feeds_for_genai(sess: ort.InferenceSession, s: int, p: int, head_size: int) -> dict:
    feeds = {}
    for inp in sess.get_inputs():
        name, shape = inp.name, inp.shape
        if name == "input_ids":
            feeds[name] = np.zeros((1, s), dtype=np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, p + s), dtype=np.int64 if "int64" in inp.type else np.int32)
        elif name == "position_ids":
            feeds[name] = np.arange(p, p + s, dtype=np.int64)[None]
        elif name.startswith("past_key_values"):
            feeds[name] = np.zeros((1, shape[1], p, head_size), dtype=np.float32)
        else:
            raise ValueError(f"unexpected genai graph input {name} {shape}")
    return feeds


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _reps_for(fns: dict, reps: int, budget_s: float = 1.0, most: int = 500) -> int:
    """At least ``reps`` calls, more for fast calls: about ``budget_s`` of them, at most ``most``."""
    slowest = 0.0
    for fn in fns.values():
        t0 = time.perf_counter()
        fn()
        slowest = max(slowest, time.perf_counter() - t0)
    return max(reps, min(most, int(budget_s / max(slowest, 1e-6))))


def _time_interleaved(fns: dict, reps: int, block: int = 5) -> dict:
    """Minimum per-call time of each function, calls alternating in blocks of ``block``: on a
    shared machine both systems then see the same moments of load (timed one after the other,
    a busy minute during one system's turn moved the ratio by 0.1-0.2)."""
    best = {name: float("inf") for name in fns}
    reps = _reps_for(fns, reps)
    for _ in range(max(1, -(-reps // block))):
        for name, fn in fns.items():
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def genai_session(model_path: Path, threads: int | None):
    import json

    head_size = json.loads((model_path.parent / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    sess = ort.InferenceSession(str(model_path), session_options(threads), providers=["CPUExecutionProvider"])
    return sess, head_size


def genai_latency(model_path: Path, sizes: list[int], past: int, threads: int | None, reps: int) -> dict:
    sess, head_size = genai_session(model_path, threads)
    out = {}
    for s in sizes:
        feeds = _feeds_for_genai(sess, s, past, head_size)
        out[s] = _time(lambda: sess.run(None, feeds), reps)
    return out


def _prefill(engine, past: int) -> None:
    engine.reset()
    pos = np.arange(past)
    engine.forward(np.zeros(past, dtype=np.int64), pos, causal_mask(0, pos))
    engine.commit(past)


def ours_latency(engine, sizes: list[int], past: int, reps: int) -> dict:
    _prefill(engine, past)
    out = {}
    for s in sizes:
        pos = np.arange(past, past + s)
        ids = np.zeros(s, dtype=np.int64)
        mask = causal_mask(past, pos)
        out[s] = _time(lambda: engine.forward(ids, pos, mask), reps)
    engine.reset()
    return out


def paired_latency(engine, model_path: Path, sizes: list[int], past: int, threads: int | None,
                   reps: int) -> tuple[dict, dict]:
    """Ours (``engine.forward``: the graph plus the engine's feeding of it, as the loop calls it)
    and genai's graph (``session.run``) for S new tokens on P cached ones, interleaved per S."""
    sess, head_size = genai_session(model_path, threads)
    _prefill(engine, past)
    ours, theirs = {}, {}
    for s in sizes:
        pos = np.arange(past, past + s)
        ids = np.zeros(s, dtype=np.int64)
        mask = causal_mask(past, pos)
        feeds = _feeds_for_genai(sess, s, past, head_size)
        best = _time_interleaved({"ours": lambda: engine.forward(ids, pos, mask),
                                  "genai": lambda: sess.run(None, feeds)}, reps)
        ours[s], theirs[s] = best["ours"], best["genai"]
    engine.reset()
    return ours, theirs


def node_count(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def compare_graphs(gen, genai_dirs: dict[str, Path], threads: int | None = None, past: int = 128,
                   sizes: tuple[int, ...] = (1, 2, 4, 5, 8, 16), reps: int = 30) -> list[dict]:
    rows = []
    for role, gdir in genai_dirs.items():
        engine = gen.target if role == "target" else gen.draft_engine
        if engine is None:
            continue
        genai_model = Path(gdir) / "model.onnx"
        ours, theirs = paired_latency(engine, genai_model, list(sizes), past, threads, reps)
        row = {"role": role, "past": past, "quantization": gen.bundle.manifest["models"][role].get("quantization"),
               "min_rows_ours": getattr(engine, "min_rows", 1),
               "nodes_ours": node_count(gen.bundle.graph_path(role)), "nodes_genai": node_count(genai_model)}
        for s in sizes:
            row[f"ms_ours_S{s}"] = ours[s] * 1e3
            row[f"ms_genai_S{s}"] = theirs[s] * 1e3
            row[f"ratio_S{s}"] = ours[s] / theirs[s]
        rows.append(row)
    return rows
