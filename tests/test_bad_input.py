"""Bad input gets a clear error naming the problem, and nothing is half-loaded."""
from __future__ import annotations

import json
import shutil

import pytest

import specdec_rt
from specdec_rt.errors import ContextOverflowError
from specdec_rt.runtime.api.generator import GenerationInputError
from specdec_rt.runtime.core.bundle import BundleError, external_data_locations, sha256_file
from specdec_rt.runtime.core.sampling import SamplingParamsError

from helpers import RUNTIME_FORBIDDEN, assert_runs_without


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


@pytest.mark.parametrize("speculation", ["chain", "tree"])
def test_every_drafter_ends_at_the_context_end_where_plain_decoding_does(tiny_pair, speculation):
    """A step that accepts every draft near the context end must not add a token plain decoding
    would not have: the free drafters, whose last step could fill the last cache slot and add the
    target's token, ended one token later than target-only (33 tokens in a context of 32)."""
    gen = specdec_rt.load(tiny_pair["bundle_same"], max_length=32, threads=1)  # a draft that is always right
    plain = gen.generate([5, 6, 7], max_new_tokens=100, ignore_eos=True, drafter=None)
    assert plain.finish_reason == "context" and len(plain.token_ids) + 3 == 32
    drafters = ("model", "eagle") if speculation == "tree" else ("auto", "model", "prompt_lookup", "suffix",
                                                                  "hybrid", "suffix_hybrid")
    for drafter in drafters:
        if drafter == "eagle" and gen.head is None:
            continue
        for k in ((3, 6) if speculation == "tree" else (1, 3, 5)):
            res = gen.generate([5, 6, 7], max_new_tokens=100, ignore_eos=True, drafter=drafter, num_draft_tokens=k,
                               speculation=speculation)
            assert res.token_ids == plain.token_ids and res.finish_reason == "context", (drafter, k)


@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1.0, top_k=-2), "top_k"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=10 ** 400), "temperature"),  # an int no float holds (was a TypeError past int64)
    (dict(temperature=1.0, top_p=-(10 ** 30)), "top_p"),
])
def test_invalid_sampling_values(tiny_gen, kwargs, word):
    with pytest.raises(SamplingParamsError, match=word):
        tiny_gen.generate([1, 2, 3], max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("kwargs, word", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(num_draft_tokens=-1), "num_draft_tokens"),
    (dict(drafter="medusa"), "drafter"),
    (dict(speculation="forest"), "speculation"),
    (dict(temperature=1.0, seed=-1), "seed"),  # numpy's own ValueError before
    (dict(temperature=1.0, seed=1.5), "seed"),
    (dict(stop=""), "stop"),  # an empty stop string would end every generation at once
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=[3]), "stop"),
    (dict(stop=3), "stop"),
])
def test_invalid_generation_arguments(tiny_gen, kwargs, word):
    with pytest.raises(GenerationInputError, match=word):
        tiny_gen.generate([1, 2, 3], **kwargs)


@pytest.mark.parametrize("kwargs", [dict(threads=0), dict(threads=-1), dict(draft_threads=0), dict(threads=1.5)])
def test_invalid_thread_counts(tiny_pair, kwargs):
    """ONNX Runtime would take 0 or a negative count as its default without a word."""
    with pytest.raises(GenerationInputError, match="threads must be an integer >= 1"):
        specdec_rt.load(tiny_pair["bundle"], **kwargs)


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

    from specdec_rt.runtime.engines.providers import BackendUnavailableError

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
    )
    assert_runs_without(code, **RUNTIME_FORBIDDEN)


# -- broken checkpoints and a full disk: one line naming the file or field, no bundle left behind ----

def _export_fails(ckpt, out, exc_type=None, **opts):
    """Export ``ckpt`` to ``out``; return the one-line error, after checking nothing was left."""
    from specdec_rt.export.pipeline import ExportError, ExportOptions, export_pair

    with pytest.raises(exc_type or ExportError) as err:
        export_pair(ckpt, None, out, ExportOptions(progress=False, **opts))
    msg = str(err.value)
    assert "\n" not in msg, msg
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(out.name + ".")]
    assert not leftovers, leftovers  # no <out>.partial-<pid> folder
    return msg


def _copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_shard(tmp_path):
    """A sharded checkpoint whose index lists a shard that is not there."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import llama_config, make_tokenizer

    ckpt = tmp_path / "sharded"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(llama_config()).save_pretrained(str(ckpt), max_shard_size="100KB")
    make_tokenizer(320, ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (ckpt / shards[1]).unlink()
    msg = _export_fails(ckpt, tmp_path / "out")
    assert shards[1] in msg and "model.safetensors.index.json" in msg and "missing" in msg
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors(tiny_pair, tmp_path):
    ckpt = _copy_ckpt(tiny_pair["target"], tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) // 2])
    msg = _export_fails(ckpt, tmp_path / "out")
    assert str(weights) in msg and "truncated" in msg
    weights.write_bytes(raw[:5])  # not even a header
    assert "truncated" in _export_fails(ckpt, tmp_path / "out")


@pytest.mark.parametrize("key, value, field", [
    ("rope_parameters", {"rope_type": "proportional", "rope_theta": 10000.0}, "rope_parameters.rope_type"),
    ("rope_scaling", {"type": "su", "factor": 2.0}, "rope_scaling.type"),
    ("hidden_act", "swiglu_v9", "hidden_act"),
])
def test_known_family_unknown_feature(tiny_pair, tmp_path, key, value, field):
    """A llama config with a switch the exporter (or transformers) does not implement: refused
    before anything is loaded, naming config.json and the field."""
    from specdec_rt.export.arch import UnsupportedArchitectureError

    ckpt = _copy_ckpt(tiny_pair["target"], tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg[key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    msg = _export_fails(ckpt, tmp_path / "out", UnsupportedArchitectureError)
    assert field in msg and "config.json" in msg and "llama" in msg


def test_disk_full_leaves_previous_bundle_intact(tiny_pair, tmp_path, monkeypatch):
    """ENOSPC while writing external data: one line naming the data file; the partial output is
    removed and a bundle already at --out is untouched (the new one is built beside it)."""
    import errno

    from specdec_rt.export import graph
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    out = tmp_path / "bundle"
    export_pair(tiny_pair["target"], None, out, ExportOptions(progress=False))
    before = {p.name: sha256_file(p) for p in out.rglob("*") if p.is_file()}

    class SmallDisk:
        """A file on a disk with room for 64 KiB."""

        def __init__(self, path, mode):
            self.f, self.size = open(path, mode), 0

        def write(self, buf):
            self.size += len(buf)
            if self.size > 1 << 16:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(buf)

        def close(self):
            self.f.close()

        @property
        def closed(self):
            return self.f.closed

    monkeypatch.setattr(graph.TensorWriter, "opener", SmallDisk)
    msg = _export_fails(tiny_pair["target"], out)
    assert "no space left" in msg and "model.onnx.data" in msg
    after = {p.name: sha256_file(p) for p in out.rglob("*") if p.is_file()}
    assert after == before
    specdec_rt.load(out)  # still a complete, loadable bundle


def test_bf16_graph_refused_with_reason(tiny_pair, tmp_path, capsys):
    from specdec_rt.cli.export_cli import main

    rc = main(["--target", str(tiny_pair["target"]), "--out", str(tmp_path / "out"), "--dtype", "bf16", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err
    assert "bf16" in err and "CPU execution provider" in err and "fp16" in err and "fp32" in err
    assert not (tmp_path / "out").exists()


def test_out_folder_that_is_not_a_bundle_is_not_replaced(tiny_pair, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me")
    msg = _export_fails(tiny_pair["target"], out)
    assert "not a specdec-rt bundle" in msg
    assert (out / "todo.txt").read_text() == "keep me"


@pytest.mark.parametrize("flag, value, says", [
    ("-k", "-3", "expected an integer 0..64 or 'auto', got '-3'"),
    ("--num-draft-tokens", "65", "expected an integer 0..64 or 'auto'"),
    ("--num-draft-tokens", "four", "expected an integer 0..64 or 'auto'"),
    ("--batch-size", "0", "an integer >= 1"),
])
def test_run_flags_out_of_range_are_usage_errors(flag, value, says, capsys):
    """specdec-run's numbers are checked by argparse (one line, exit 2), before a bundle loads."""
    from specdec_rt.cli.run_cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--bundle", "b", flag, value])
    assert exc.value.code == 2 and says in capsys.readouterr().err
