"""Bad input gets a clear error naming the problem, and nothing is half-loaded."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import specdec_rt
from specdec_rt.runtime.bundle import BundleError, external_data_locations, sha256_file
from specdec_rt.runtime.engine import ContextOverflowError
from specdec_rt.runtime.generator import GenerationInputError
from specdec_rt.runtime.sampling import SamplingParamsError


def test_empty_prompt(tiny_gen):
    with pytest.raises(GenerationInputError, match="empty"):
        tiny_gen.generate("")
    with pytest.raises(GenerationInputError, match="empty"):
        tiny_gen.generate([])


def test_prompt_beyond_context(tiny_gen):
    with pytest.raises(ContextOverflowError, match="context"):
        tiny_gen.generate([5] * (tiny_gen.max_length + 3))


def test_generation_stops_at_context_end(tiny_pair):
    gen = specdec_rt.load(tiny_pair["bundle"], max_length=32, threads=1)
    res = gen.generate([5, 6, 7], max_new_tokens=100, ignore_eos=True)
    assert res.finish_reason == "context"
    assert len(res.token_ids) + 3 <= 32


@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1.0, top_k=-2), "top_k"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
])
def test_invalid_sampling_values(tiny_gen, kwargs, word):
    with pytest.raises(SamplingParamsError, match=word):
        tiny_gen.generate([1, 2, 3], max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("kwargs, word", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(num_draft_tokens=-1), "num_draft_tokens"),
    (dict(drafter="medusa"), "drafter"),
    (dict(speculation="forest"), "speculation"),
])
def test_invalid_generation_arguments(tiny_gen, kwargs, word):
    with pytest.raises(GenerationInputError, match=word):
        tiny_gen.generate([1, 2, 3], **kwargs)


def test_token_ids_outside_vocabulary(tiny_gen):
    with pytest.raises(GenerationInputError, match="outside the vocabulary"):
        tiny_gen.generate([1, 2, 10_000])
    with pytest.raises(GenerationInputError, match="outside the vocabulary"):
        tiny_gen.generate([-1, 2])


def _copy(bundle, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    return dst


def test_missing_bundle_dir(tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        specdec_rt.load(tmp_path / "nope")


def test_missing_file(tiny_pair, tmp_path):
    b = _copy(tiny_pair["bundle"], tmp_path)
    (b / "draft" / "model.onnx.data").unlink()
    with pytest.raises(BundleError, match="draft/model.onnx.data.*missing"):
        specdec_rt.load(b)


def test_wrong_checksum(tiny_pair, tmp_path):
    b = _copy(tiny_pair["bundle"], tmp_path)
    data = b / "target" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="sha256"):
        specdec_rt.load(b)


def test_corrupt_manifest(tiny_pair, tmp_path):
    b = _copy(tiny_pair["bundle"], tmp_path)
    (b / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        specdec_rt.load(b)


def test_external_data_path_traversal(tiny_pair, tmp_path):
    """A graph whose external data points outside the bundle is refused even with a valid checksum."""
    import onnx

    b = _copy(tiny_pair["bundle"], tmp_path)
    secret = tmp_path / "outside.data"
    shutil.copy(b / "target" / "model.onnx.data", secret)
    graph = b / "target" / "model.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "../../outside.data"
    onnx.save(model, str(graph))
    assert "../../outside.data" in external_data_locations(graph)
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["files"]["target/model.onnx"] = sha256_file(graph)  # a consistent, malicious bundle
    (b / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="outside the bundle"):
        specdec_rt.load(b)


def test_no_draft_model_requested(tiny_pair, tmp_path):
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    out = tmp_path / "target_only"
    export_pair(tiny_pair["target"], None, out, ExportOptions(progress=False))
    gen = specdec_rt.load(out)
    with pytest.raises(GenerationInputError, match="no draft model"):
        gen.generate([1, 2, 3], drafter="model")
    assert len(gen.generate([1, 2, 3], drafter="prompt_lookup", max_new_tokens=5).token_ids) == 5


def test_unknown_provider(tiny_pair):
    with pytest.raises(ValueError, match="unknown provider"):
        specdec_rt.load(tiny_pair["bundle"], provider="tpu")


def test_missing_gpu_backend_names_what_to_install(tiny_pair):
    import onnxruntime as ort

    from specdec_rt.runtime.providers import BackendUnavailableError

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is present here")
    with pytest.raises(BackendUnavailableError, match="onnxruntime-gpu"):
        specdec_rt.load(tiny_pair["bundle"], provider="cuda")


def test_runtime_never_imports_torch_or_the_export_package(tiny_pair):
    """A generation (and a user error reported the CLI way) loads neither torch nor specdec_rt.export."""
    code = (
        "import sys, specdec_rt.runtime, specdec_rt\n"
        "from specdec_rt.cli.common import fail\n"
        "from specdec_rt.runtime.errors import USER_ERRORS\n"
        f"g = specdec_rt.load({str(tiny_pair['bundle'])!r})\n"
        "r = g.generate('hello', max_new_tokens=5)\n"
        "assert r.token_ids\n"
        "assert fail(lambda: g.generate('hello', temperature=-1)) == 1\n"
        "bad = [m for m in sys.modules if m in ('torch', 'transformers', 'onnx')\n"
        "       or m.startswith(('torch.', 'transformers.', 'onnx.', 'specdec_rt.export'))]\n"
        "print('LOADED', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
