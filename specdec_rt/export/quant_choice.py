"""``specdec-export --quantize auto``: which exact quantization is fastest on this machine.

Why: the fastest export depends on the CPU more than on the model. On a CPU with int8 matrix
units (AMX) ONNX Runtime's integer GEMM behind W8A8 prefills a 256-token chunk ~12x faster than
the int4 kernel and verifies 8 rows for little more than one, while int4 reads fewer bytes per
one-token step; on AVX2 without VNNI int4's one-row kernel may even need padded calls to stay
exact. So the choice is measured, not guessed: one layer-sized projection (``PROBE_K`` x
``PROBE_N``) quantized both ways, built with the same ops as the exporter's graphs
(``MatMulNBits`` at accuracy level 4 for int4; per-row uint8 activations times 7-bit per-channel
weights in ``MatMulIntegerToFloat`` for W8A8), timed at 1, 2, 8 and 256 rows on this machine's
cores, with int4's one-row exactness checked as the runtime's load-time probe checks it (a row
alone must give the bits it gives among others; where it does not, a one-token step is a padded
two-row call).

The estimate prices two typical requests in units of that projection's time: a chat turn (100
prompt tokens, 256 generated one per step: speculation rarely pays there) and a grounded one
(700 prompt tokens, 256 generated at 3 tokens per 8-row verify, as suffix drafting copies from
the prompt), and picks the scheme with the smaller sum. ``specdec-export`` prints it as one
line and keeps the figures in its JSON summary (``quantize_choice``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from specdec_rt.export.quantize import ACCURACY_LEVEL, ACT_EPS, DEFAULT_BLOCK_SIZE, quantize_blockwise, quantize_per_channel

PROBE_K, PROBE_N = 2048, 8192  # a 1.5B-3B model's MLP projection: int4 8 MiB, int8 16 MiB
CHAT = (100, 256, 1.0, 1)  # prompt tokens, generated tokens, tokens per target call, rows per call
GROUNDED = (700, 256, 3.0, 8)
PREFILL_ROWS = 256  # the runtime's prefill chunk (engines.base.PREFILL_CHUNK)


@dataclass
class QuantChoice:
    """The measured choice: ``scheme`` (and int4's ``block_size``), why, and the timings (ms)."""

    scheme: str
    block_size: int
    reason: str
    times_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    estimate: dict[str, dict[str, float]] = field(default_factory=dict)
    int4_one_row_exact: bool = True

    def to_json(self) -> dict:
        return asdict(self)


def _session(model, threads: int | None):
    """A CPU session set up as the runtime sets up its own (threads, or the process-wide pool)."""
    import onnxruntime as ort

    from specdec_rt.runtime.engines.sessions import session_options

    return ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                providers=["CPUExecutionProvider"])


def _model(nodes, inits, k: int, n: int, opset: int = 17):
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], inits)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = helper.find_min_ir_version_for(opsets[:1])
    return model


def int4_graph(w: np.ndarray, block_size: int):
    """``x @ w`` as the exporter's int4 projection (MatMulNBits, symmetric, accuracy level 4)."""
    from onnx import helper, numpy_helper

    k, n = w.shape
    packed, scales = quantize_blockwise(w, 4, block_size)
    node = helper.make_node("MatMulNBits", ["x", "wq", "ws"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block_size, accuracy_level=ACCURACY_LEVEL)
    return _model([node], [numpy_helper.from_array(packed, "wq"), numpy_helper.from_array(scales, "ws")], k, n)


def w8a8_graph(w: np.ndarray):
    """``x @ w`` as the exporter's W8A8 projection (per-row uint8 activations, 7-bit weights):
    GraphBuilder._quantize_rows and _matmul_w8a8 in the fused op set."""
    from onnx import helper, numpy_helper

    from specdec_rt.export.graph import BLOCKED_QUANTIZE_OPSET

    k, n = w.shape
    q, scales = quantize_per_channel(w)
    c = {"eps": np.array(ACT_EPS, np.float32), "n127": np.array(127, np.float32),
         "zero_row": np.array([128], np.uint8), "zero": np.array(128, np.uint8), "one": np.array(1.0, np.float32)}
    nodes = [helper.make_node("Abs", ["x"], ["a"]),
             helper.make_node("ReduceMax", ["a", "axes"], ["peak"], keepdims=1),
             helper.make_node("Max", ["peak", "eps"], ["floor"]),
             helper.make_node("Div", ["floor", "n127"], ["sx"]),
             helper.make_node("Shape", ["sx"], ["rows"]),
             helper.make_node("Expand", ["zero_row", "rows"], ["zp"]),
             helper.make_node("QuantizeLinear", ["x", "sx", "zp"], ["qx"], axis=-1, block_size=k),
             helper.make_node("MatMulIntegerToFloat", ["qx", "wq", "one", "ws", "zero"], ["y0"], domain="com.microsoft"),
             helper.make_node("Mul", ["y0", "sx"], ["y"])]
    inits = [numpy_helper.from_array(q, "wq"), numpy_helper.from_array(scales, "ws"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    inits += [numpy_helper.from_array(v, name) for name, v in c.items()]
    return _model(nodes, inits, k, n, BLOCKED_QUANTIZE_OPSET)


def _time(sess, x: np.ndarray, reps: int) -> float:
    feeds = {"x": x}
    sess.run(None, feeds)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def _rows_invariant(sess, x: np.ndarray) -> bool:
    """A row alone gives the bits it gives among 8 rows (what ``probes.probe_row_invariance`` asks)."""
    many = sess.run(None, {"x": x[:8]})[0]
    return all(np.array_equal(sess.run(None, {"x": x[i:i + 1]})[0][0], many[i]) for i in range(8))


def _request_cost(t: dict[str, float], shape: tuple, one_row: float) -> float:
    prompt, new, per_call, rows = shape
    prefill = prompt / PREFILL_ROWS * t["prefill"]
    step = one_row if rows == 1 else t["verify"]
    return prefill + new / per_call * step


def choose_quantization(threads: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                        seed: int = 0) -> QuantChoice:
    """Measure int4 and W8A8 on this machine (a second or two) and pick the faster (module doc)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((PROBE_K, PROBE_N)) * 0.02).astype(np.float32)
    x = rng.standard_normal((PREFILL_ROWS, PROBE_K)).astype(np.float32)
    schemes = {"int4": _session(int4_graph(w, block_size), threads), "w8a8": _session(w8a8_graph(w), threads)}
    times = {name: {"one_row": _time(s, x[:1], 20), "two_rows": _time(s, x[:2], 20), "verify": _time(s, x[:8], 10),
                    "prefill": _time(s, x, 3)} for name, s in schemes.items()}
    exact = _rows_invariant(schemes["int4"], x)
    estimate = {}
    for name, t in times.items():
        one_row = t["one_row"] if (name == "w8a8" or exact) else t["two_rows"]  # padded where rows differ
        estimate[name] = {"chat": _request_cost(t, CHAT, one_row), "grounded": _request_cost(t, GROUNDED, one_row)}
        estimate[name]["total"] = estimate[name]["chat"] + estimate[name]["grounded"]
    best = min(estimate, key=lambda s: estimate[s]["total"])
    other = "int4" if best == "w8a8" else "w8a8"
    ti, tw = times["int4"], times["w8a8"]
    reason = (f"{best}: estimated {estimate[other]['total'] / estimate[best]['total']:.2f}x faster than {other} on this CPU "
              f"(one-token step int4 {ti['one_row']:.2f} ms{'' if exact else ' (padded to 2 rows: ' + format(ti['two_rows'], '.2f') + ')'}"
              f" vs w8a8 {tw['one_row']:.2f}; 8-row verify {ti['verify']:.2f} vs {tw['verify']:.2f}; "
              f"256-row prefill {ti['prefill']:.1f} vs {tw['prefill']:.1f}, on one {PROBE_K}x{PROBE_N} projection)")
    return QuantChoice(best, block_size, reason, times, estimate, exact)
