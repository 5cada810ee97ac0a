"""``specdec-export --quantize auto``: int4 and W8A8 measured on this CPU, the faster exported,
the reason said in one line; the probe's graphs compute what the exporter's projections compute."""
from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.fixture(scope="module")
def choice():
    from specdec_rt.export.quant_choice import choose_quantization

    return choose_quantization(threads=1)


def test_choice_is_measured_and_consistent(choice):
    assert choice.scheme in ("int4", "w8a8")
    for scheme in ("int4", "w8a8"):
        t = choice.times_ms[scheme]
        assert all(v > 0 for v in t.values())
        e = choice.estimate[scheme]
        assert e["total"] == pytest.approx(e["chat"] + e["grounded"])
    other = "int4" if choice.scheme == "w8a8" else "w8a8"
    assert choice.estimate[choice.scheme]["total"] <= choice.estimate[other]["total"]
    assert choice.reason.startswith(choice.scheme + ": ") and "\n" not in choice.reason
    json.dumps(choice.to_json())


def test_probe_graphs_compute_the_projection():
    """Both probe graphs are x @ w up to their quantization error (not some other op)."""
    import onnxruntime as ort

    from specdec_rt.export.quant_choice import int4_graph, w8a8_graph
    from specdec_rt.runtime.engines.sessions import session_options

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 48)) * 0.1).astype(np.float32)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    ref = x @ w
    for model in (int4_graph(w, 32), w8a8_graph(w)):
        sess = ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])
        y = sess.run(None, {"x": x})[0]
        assert np.abs(y - ref).max() < 0.1 * np.abs(ref).max()
        # per-row activations: a row alone gives the bits it gives among the others (w8a8 always)
        if model.graph.node[-1].op_type == "Mul":
            assert np.array_equal(sess.run(None, {"x": x[2:3]})[0][0], y[2])


def test_probe_graphs_use_the_exporters_ops(tiny_pair, tmp_path):
    """What is timed is what the exporter builds: every op of the probe graphs occurs in the
    exported graph of that scheme (a change to the exporter's projections must reach the probe)."""
    import onnx

    from specdec_rt.export.pipeline import ExportOptions, export_pair
    from specdec_rt.export.quant_choice import int4_graph, w8a8_graph

    w = np.zeros((64, 32), np.float32)
    for scheme, probe in (("int4", int4_graph(w, 32)), ("w8a8", w8a8_graph(w))):
        out = tmp_path / scheme
        export_pair(tiny_pair["target"], None, out, ExportOptions(progress=False, quantize=scheme, validate=False))
        graph = onnx.load(str(out / "target" / "model.onnx"), load_external_data=False).graph
        exported = {(n.op_type, n.domain or "") for n in graph.node}
        assert {(n.op_type, n.domain or "") for n in probe.graph.node} <= exported, scheme


def test_export_cli_quantize_auto(tiny_pair, tmp_path, capsys):
    from specdec_rt.cli.export_cli import main

    out = tmp_path / "bundle"
    assert main(["--target", str(tiny_pair["target"]), "--out", str(out), "--quantize", "auto"]) == 0
    captured = capsys.readouterr()
    line = [ln for ln in captured.err.splitlines() if "--quantize auto ->" in ln]
    assert len(line) == 1
    summary = json.loads(captured.out[captured.out.index("{"):captured.out.rindex("}") + 1])
    scheme = summary["quantize_choice"]["scheme"]
    assert summary["models"]["target"]["quantization"] == scheme
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["models"]["target"]["quantization"] == scheme
