"""EAGLE-3 heads, the export half (issue 22): the target's ``features`` output, the head's two graphs
(head/fc.onnx, head/model.onnx) against the PyTorch definition (specdec_rt.export.eagle), the
manifest entry, and the errors of ``specdec-export --draft-head``."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import llama_config, make_checkpoint  # noqa: E402

from specdec_rt.errors import ExportError  # noqa: E402

LAYERS = (0, 1, 2)  # feature layers of the tiny heads: every layer of a 3-layer target
DRAFT_VOCAB = 96


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       eos_token_id=0, bos_token_id=0, pad_token_id=0)


def make_head(target: Path, out: Path, seed: int = 1, vocab: int | None = None, layers=LAYERS, key_prefix=None,
              norm_before_residual: bool = False):
    """A random EagleHead for ``target`` (hidden = the target's, a d2t over DRAFT_VOCAB scattered
    target ids), saved with eagle.save_head; returns (folder, head)."""
    import torch
    from transformers import AutoConfig

    from specdec_rt.export.eagle import EagleConfig, EagleHead, save_head

    tc = AutoConfig.from_pretrained(str(target))
    v = vocab or tc.vocab_size
    cfg = EagleConfig(hidden_size=tc.hidden_size, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, vocab_size=v, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=tc.hidden_size,
                      feature_layers=tuple(layers), rope_theta=10000.0, norm_before_residual=norm_before_residual)
    gen = torch.Generator().manual_seed(seed)
    head = EagleHead(cfg, torch.randn(v, tc.hidden_size, generator=gen) * 0.5)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 if p.dim() > 1 else 1 + 0.2 * torch.rand(p.shape, generator=gen))
        ids = torch.randperm(v, generator=gen)[:DRAFT_VOCAB].sort().values
        head.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
    save_head(head, out)
    if key_prefix is not None:  # the other published naming: layers.0.* instead of midlayer.*
        from safetensors.torch import load_file, save_file

        state = load_file(str(out / "model.safetensors"))
        save_file({k.replace("midlayer.", key_prefix, 1): t for k, t in state.items()}, str(out / "model.safetensors"))
    return out, head


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def head_bundle(request, tmp_path_factory):
    """llama: target + head, no draft model; qwen2: target + draft (the target itself) + head."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp(f"eagle_{request.param}")
    cfg = llama_config(layers=3) if request.param == "llama" else _qwen2_config()
    target = make_checkpoint(cfg, base / "target", seed=0)
    head_dir, _ = make_head(target, base / "head")
    out = base / "bundle"
    draft = target if request.param == "qwen2" else None
    # a float head (the default is int4): its graphs are validated against PyTorch below
    manifest = export_pair(target, draft, out, ExportOptions(progress=False, draft_head=head_dir, head_quantize="none"))
    return {"name": request.param, "target": target, "head": head_dir, "bundle": out, "manifest": manifest}


def _session(path):
    import onnxruntime as ort

    from specdec_rt.runtime.engines.sessions import session_options

    # session_options: another test may have made the process-wide pool, which ORT then requires
    return ort.InferenceSession(str(path), session_options(1), providers=["CPUExecutionProvider"])


def _mask(s: int, p: int) -> np.ndarray:
    allowed = np.ones((s, p + s), dtype=bool)
    allowed[:, p:] = np.tril(np.ones((s, s), dtype=bool))
    return np.where(allowed, 0.0, -np.inf).astype(np.float32)[None, None]


def _run(sess, **feeds):
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def test_manifest_entries(head_bundle):
    from specdec_rt.runtime.core.bundle import load_bundle

    out, manifest = head_bundle["bundle"], head_bundle["manifest"]
    models = manifest["models"]
    head, target = models["head"], models["target"]
    assert list(models) == (["target", "head"] if head_bundle["name"] == "llama" else ["target", "draft", "head"])
    assert target["feature_layers"] == list(LAYERS) == head["feature_layers"]
    assert "feature_layers" not in models.get("draft", {})
    expected = {"graph": "head/model.onnx", "fc_graph": "head/fc.onnx", "family": "eagle3", "num_layers": 1,
                "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64, "vocab_size": 320,
                "draft_vocab_size": DRAFT_VOCAB, "dtype": "float32", "kv_dtype": "float32",
                "max_positions": target["max_positions"], "features_dim": 3 * 64, "quantization": None,
                "opset": 23, "fused_ops": True, "fused_attention": True,
                "source": {"format": "eagle3", "path": str(head_bundle["head"])}}
    assert {k: head[k] for k in expected} == expected
    assert head["num_parameters"] > 320 * 64  # the embedding table is in the graph
    for rel in ("head/model.onnx", "head/model.onnx.data", "head/fc.onnx", "head/fc.onnx.data"):
        assert manifest["files"][rel] == hashlib.sha256((out / rel).read_bytes()).hexdigest(), rel
    # validation recorded and within tolerance: the head's cases, the target's features
    v = head["validation"]
    assert v["neg_inf_pattern_identical"] and v["decode_vs_verify_error"] <= v["tolerance"]
    assert max(v["max_logit_error"], v["max_hidden_error"], v["max_kv_error"], v["fc_error"]) < 1e-4
    assert {"prefill_P0.logits", "verify_S4.logits", "decode_S1.logits"} <= set(v["cases"])
    f = target["validation"]["features"]
    assert set(f["cases"]) == {"prefill_P0", "verify_S4"} and f["max_error"] < 1e-4
    assert {"load head", "reference head", "build head", "validate head"} <= set(manifest["stage_seconds"])
    bundle = load_bundle(out)  # the runtime's loader: checksums, external data inside the bundle
    if getattr(bundle, "head", None) is not None:
        assert bundle.head.fc_graph == "head/fc.onnx" and bundle.target.feature_layers == list(LAYERS)


def test_features_output_is_target_features(head_bundle):
    """Prefill and a verify call on the graph's own past: ``features`` equals the hidden states
    eagle.target_features hooks out of the transformers model."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_rt.export.eagle import target_features

    info = head_bundle["manifest"]["models"]["target"]
    sess = _session(head_bundle["bundle"] / info["graph"])
    assert sess.get_outputs()[-1].name == "features" and sess.get_outputs()[-1].shape[-1] == 3 * 64
    tokens = np.random.default_rng(5).integers(0, 320, (1, 12))
    past = {f"past_{k}.{i}": np.zeros((1, 0, info["num_kv_heads"], info["head_dim"]), np.float32)
            for i in range(info["num_layers"]) for k in ("key", "value")}
    a = _run(sess, input_ids=tokens[:, :8], position_ids=np.arange(8)[None], attention_mask=_mask(8, 0), **past)
    past = {f"past_{k}.{i}": a[f"new_{k}.{i}"] for i in range(info["num_layers"]) for k in ("key", "value")}
    b = _run(sess, input_ids=tokens[:, 8:], position_ids=np.arange(8, 12)[None], attention_mask=_mask(4, 8), **past)
    model = AutoModelForCausalLM.from_pretrained(str(head_bundle["target"]), dtype=torch.float32).eval()
    ref, logits = target_features(model, torch.from_numpy(tokens), LAYERS)
    got = np.concatenate([a["features"], b["features"]], axis=1)
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_allclose(got, ref.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.concatenate([a["logits"], b["logits"]], axis=1), logits.numpy(), atol=1e-4, rtol=0)


def test_head_graphs_match_eagle_step(head_bundle):
    """fc, prefill (P = 0, S = 6), verify (S = 4 on P = 6, causal), a decode row equal to the
    verify call's row, and two draft steps feeding ``hidden_out`` back: all as EagleHead.step."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_rt.export.eagle import load_head

    out = head_bundle["bundle"]
    info = head_bundle["manifest"]["models"]["head"]
    embed = AutoModelForCausalLM.from_pretrained(str(head_bundle["target"]), dtype=torch.float32).get_input_embeddings()
    head = load_head(head_bundle["head"], embed.weight.detach(), 3)
    fc, sess = _session(out / info["fc_graph"]), _session(out / info["graph"])
    rng = np.random.default_rng(7)
    feats = rng.standard_normal((1, 10, info["features_dim"])).astype(np.float32)
    tokens = rng.integers(0, 320, (1, 12))
    hidden = _run(fc, features=feats)["hidden_states"]
    with torch.no_grad():
        ref_hidden = head.fc(torch.from_numpy(feats))
    np.testing.assert_allclose(hidden, ref_hidden.numpy(), atol=1e-5, rtol=0)

    def ort_step(rows, hid, past, start):
        s = hid.shape[1]
        return _run(sess, input_ids=tokens[:, rows], hidden_states=hid, position_ids=np.arange(start, start + s)[None],
                    attention_mask=_mask(s, past[0].shape[1]), logits_to_keep=np.array([s]),
                    **{"past_key.0": past[0], "past_value.0": past[1]})

    def torch_step(rows, hid, past, start):
        with torch.no_grad():
            s = hid.shape[1]
            lg, h, (k, v) = head.step(torch.from_numpy(tokens[:, rows]), torch.from_numpy(hid),
                                      torch.arange(start, start + s)[None], past=past)
        return lg.numpy(), h.numpy(), (k, v)

    def check(got, want, kv):
        lg, h, _ = want
        assert np.array_equal(np.isneginf(got["logits"]), np.isneginf(lg))
        finite = ~np.isneginf(lg)
        np.testing.assert_allclose(got["logits"][finite], lg[finite], atol=1e-4, rtol=0)
        np.testing.assert_allclose(got["hidden_out"], h, atol=1e-4, rtol=0)
        for name, t in zip(("new_key.0", "new_value.0"), kv):
            np.testing.assert_allclose(got[name], t.transpose(1, 2).numpy(), atol=1e-4, rtol=0)

    empty = np.zeros((1, 0, 2, 16), np.float32)
    a = ort_step(slice(0, 6), hidden[:, :6], (empty, empty), 0)
    ra = torch_step(slice(0, 6), hidden[:, :6], None, 0)
    check(a, ra, ra[2])
    # -inf exactly outside the draft vocabulary, at target ids d + d2t[d]
    allowed = np.zeros(320, dtype=bool)
    allowed[head.draft_ids().numpy()] = True
    assert np.isneginf(a["logits"][..., ~allowed]).all() and np.isfinite(a["logits"][..., allowed]).all()
    assert allowed.sum() == DRAFT_VOCAB

    past = (a["new_key.0"], a["new_value.0"])
    b = ort_step(slice(6, 10), hidden[:, 6:10], past, 6)
    rb = torch_step(slice(6, 10), hidden[:, 6:10], ra[2], 6)
    check(b, rb, rb[2])
    c = ort_step(slice(6, 7), hidden[:, 6:7], past, 6)
    assert np.array_equal(np.isneginf(c["logits"][0, 0]), np.isneginf(b["logits"][0, 0]))
    np.testing.assert_allclose(c["logits"][0, 0], b["logits"][0, 0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(c["hidden_out"][0, 0], b["hidden_out"][0, 0], atol=1e-5, rtol=0)

    # drafting: rows at positions 10, 11 read the previous row's hidden_out (the row convention)
    full = (np.concatenate([past[0], b["new_key.0"]], 1), np.concatenate([past[1], b["new_value.0"]], 1))
    tfull = tuple(torch.cat([x, y], dim=2) for x, y in zip(ra[2], rb[2]))
    d1 = ort_step(slice(10, 11), b["hidden_out"][:, -1:], full, 10)
    t1 = torch_step(slice(10, 11), rb[1][:, -1:], tfull, 10)
    check(d1, t1, t1[2])
    full = (np.concatenate([full[0], d1["new_key.0"]], 1), np.concatenate([full[1], d1["new_value.0"]], 1))
    tfull = tuple(torch.cat([x, y], dim=2) for x, y in zip(tfull, t1[2]))
    d2 = ort_step(slice(11, 12), d1["hidden_out"], full, 11)
    t2 = torch_step(slice(11, 12), t1[1], tfull, 11)
    check(d2, t2, t2[2])


def _tiny(name):
    from test_architectures import _config

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(name)).eval()


FAMILY_CASES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "phi3",
                "smollm3", "olmo2", "starcoder2"]


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_features_every_verified_family(name):
    """The features output of every family it is allowed for (fused and portable op sets, fp16
    cast to float32) against eagle.target_features; 7 tokens (inside the tests' 8-token windows)."""
    import onnxruntime as ort
    import torch

    from specdec_rt.export.arch import extract
    from specdec_rt.export.eagle import target_features
    from specdec_rt.export.graph import FEATURE_FAMILIES, GraphOptions, build_model
    from specdec_rt.runtime.engines.sessions import session_options

    model = _tiny(name)
    assert model.config.model_type in FEATURE_FAMILIES
    tokens = np.random.default_rng(0).integers(0, 320, (1, 7))
    ref = target_features(model, torch.from_numpy(tokens), (1, 0))[0].numpy()
    for opt, atol in ((GraphOptions(feature_layers=(1, 0)), 1e-4),
                      (GraphOptions(fused=False, attention_accumulation="native", feature_layers=(1, 0)), 1e-4),
                      (GraphOptions(dtype="fp16", feature_layers=(1, 0)), 2e-2 * max(1.0, float(np.abs(ref).max())))):
        spec, weights = extract(model, 256)
        sess = ort.InferenceSession(build_model(spec, weights, opt).SerializeToString(), session_options(1),
                                    providers=["CPUExecutionProvider"])
        kv = np.float16 if opt.dtype == "fp16" else np.float32
        feed = {"input_ids": tokens, "position_ids": np.arange(7)[None], "attention_mask": _mask(7, 0)}
        feed.update({f"past_{k}.{i}": np.zeros((1, 0, spec.num_kv_heads, spec.head_dim), kv)
                     for i in range(spec.num_layers) for k in ("key", "value")})
        got = _run(sess, **feed)["features"]
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, ref, atol=atol, rtol=0, err_msg=f"{name} {opt.dtype} fused={opt.fused}")


def test_features_only_append_to_the_graph():
    """Without feature_layers the graph is what it was: with them, the same nodes, initializers and
    outputs come first, then only the features nodes and one output."""
    from specdec_rt.export.arch import extract
    from specdec_rt.export.graph import GraphOptions, build_model

    model = _tiny("qwen3")
    for kw in ({}, {"fused": False, "attention_accumulation": "native"}, {"dtype": "fp16"}, {"quantize": "int4"}):
        plain = build_model(*extract(model, 256), GraphOptions(**kw))
        with_f = build_model(*extract(model, 256), GraphOptions(feature_layers=(0, 1), **kw))
        n = len(plain.graph.node)
        assert [x.SerializeToString() for x in with_f.graph.node[:n]] == [x.SerializeToString() for x in plain.graph.node]
        assert [x.SerializeToString() for x in with_f.graph.initializer] == [x.SerializeToString() for x in plain.graph.initializer]
        assert list(with_f.graph.output[:-1]) == list(plain.graph.output) and with_f.graph.output[-1].name == "features"
        assert {x.op_type for x in with_f.graph.node[n:]} <= {"Concat", "Cast", "Identity"}


def test_unverified_family_is_refused():
    from specdec_rt.export.arch import extract
    from specdec_rt.export.graph import GraphOptions, build_model

    with pytest.raises(ExportError, match="not verified for gpt_neox"):
        build_model(*extract(_tiny("gpt_neox"), 256), GraphOptions(feature_layers=(0, 1)))
    with pytest.raises(ExportError, match="feature layers \\[0, 5\\]"):
        build_model(*extract(_tiny("llama"), 256), GraphOptions(feature_layers=(0, 5)))


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    return make_checkpoint(llama_config(layers=3), tmp_path_factory.mktemp("eagle_small") / "target", seed=2)


def test_head_for_another_vocabulary(small_target, tmp_path):
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    head_dir, _ = make_head(small_target, tmp_path / "head", vocab=400)
    with pytest.raises(ExportError, match="vocabulary 400 != the target's 320"):
        export_pair(small_target, None, tmp_path / "out", ExportOptions(progress=False, draft_head=head_dir))
    assert not (tmp_path / "out").exists()
    head_dir, _ = make_head(small_target, tmp_path / "head_deep", layers=(0, 1, 7))
    with pytest.raises(ExportError, match="feature layers \\[7\\]"):  # before the target is loaded
        export_pair(small_target, None, tmp_path / "out", ExportOptions(progress=False, draft_head=head_dir))


def test_broken_head_folders(small_target, tmp_path):
    from specdec_rt.cli.export_cli import main
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="config.json is missing"):
        export_pair(small_target, None, tmp_path / "out", ExportOptions(progress=False, draft_head=tmp_path / "empty"))
    with pytest.raises(ExportError, match="is not a folder"):
        export_pair(small_target, None, tmp_path / "out", ExportOptions(progress=False, draft_head=tmp_path / "nope"))
    head_dir, _ = make_head(small_target, tmp_path / "head")
    (head_dir / "model.safetensors").unlink()
    with pytest.raises(ExportError, match="holds no head weights"):
        export_pair(small_target, None, tmp_path / "out", ExportOptions(progress=False, draft_head=head_dir))
    # the command line: one line, exit status 1
    assert main(["--target", str(small_target), "--draft-head", str(tmp_path / "empty"), "--out",
                 str(tmp_path / "out"), "--quiet"]) != 0


def test_layers_0_key_names_load(small_target, tmp_path):
    import torch

    from specdec_rt.export.eagle import load_head

    head_dir, head = make_head(small_target, tmp_path / "head", key_prefix="layers.0.")
    from safetensors import safe_open

    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        assert any(k.startswith("layers.0.") for k in f.keys()) and not any(k.startswith("midlayer.") for k in f.keys())
    loaded = load_head(head_dir, head.embed_tokens.weight, 3)
    for k, t in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], t), k
    assert json.loads((head_dir / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def _speculators_layout(folder: Path) -> None:
    """Rewrite a saved head the way Red Hat's speculators publish them: the decoder layer's fields
    nested in transformer_layer_config, layers.0.* weights, norm_before_residual implied."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    ids = cfg.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    own = {k: cfg.pop(k) for k in ("draft_vocab_size", "target_hidden_size", "norm_before_residual") if k in cfg}
    own.pop("norm_before_residual", None)  # the nested layout's default: true
    (folder / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                                                    "transformer_layer_config": cfg, **own,
                                                    "eagle_aux_hidden_state_layer_ids": ids}))
    state = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0.", 1): t for k, t in state.items()}, str(folder / "model.safetensors"))


def test_speculators_heads_with_norm_before_residual(small_target, tmp_path):
    """A Red Hat speculators head (nested config, residual = hidden_norm(hidden)) loads with the
    switch on and exports to graphs equal to its PyTorch step; the switch changes the output, so
    a graph that ignored it would fail the comparison."""
    from specdec_rt.export.eagle import load_head
    from specdec_rt.export.eagle_graph import check_head_folder, compare_head, head_reference, write_head

    head_dir, head = make_head(small_target, tmp_path / "head", norm_before_residual=True)
    _speculators_layout(head_dir)
    check_head_folder(head_dir, small_target)
    loaded = load_head(head_dir, head.embed_tokens.weight, 3).eval()
    assert loaded.cfg.norm_before_residual and loaded.cfg.feature_layers == LAYERS
    assert loaded.cfg.draft_vocab_size == DRAFT_VOCAB
    ref = head_reference(loaded)
    write_head(loaded, tmp_path / "g", max_positions=256)
    assert compare_head(str(tmp_path / "g/model.onnx"), str(tmp_path / "g/fc.onnx"), ref)["max_logit_error"] < 1e-4
    loaded.cfg.norm_before_residual = False  # the same weights read the other way: other logits
    assert not np.allclose(head_reference(loaded).hidden_out, ref.hidden_out, atol=1e-3)
    cfg = json.loads((head_dir / "config.json").read_text())
    for switch in ("norm_before_fc", "fc_norm"):
        (head_dir / "config.json").write_text(json.dumps({**cfg, switch: True}))
        with pytest.raises(ExportError, match=f"sets {switch}"):
            check_head_folder(head_dir, small_target)
    for key in ("rope_scaling", "rope_parameters"):  # another scaled rope, either name: refused, not ignored
        nested = {**cfg["transformer_layer_config"], key: {"rope_type": "yarn", "factor": 4.0}}
        (head_dir / "config.json").write_text(json.dumps({**cfg, "transformer_layer_config": nested}))
        with pytest.raises(ExportError, match=f"head {key} .*not supported"):
            check_head_folder(head_dir, small_target)
    nested = {**cfg["transformer_layer_config"], "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    (head_dir / "config.json").write_text(json.dumps({**cfg, "transformer_layer_config": nested}))
    with pytest.raises(ExportError, match="llama3 rope_scaling lacks low_freq_factor"):
        check_head_folder(head_dir, small_target)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_heads_with_llama3_rope(small_target, tmp_path, key):
    """A speculators head copying Llama 3.1's rope scaling: its frequencies are transformers'
    "llama3" ones, and its graphs (whose rotary tables are precomputed) equal its PyTorch step."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specdec_rt.export.eagle import load_head, rope_inv_freq
    from specdec_rt.export.eagle_graph import compare_head, head_reference, write_head

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    head_dir, head = make_head(small_target, tmp_path / "head", norm_before_residual=True)
    _speculators_layout(head_dir)
    cfg = json.loads((head_dir / "config.json").read_text())
    layer = {**cfg["transformer_layer_config"], key: {**llama3, "rope_theta": 500000.0}, "rope_theta": 500000.0}
    (head_dir / "config.json").write_text(json.dumps({**cfg, "transformer_layer_config": layer}))
    loaded = load_head(head_dir, head.embed_tokens.weight, 3).eval()
    assert loaded.cfg.rope_scaling == {k: float(v) for k, v in llama3.items() if k != "rope_type"}
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                                          rope_parameters={**llama3, "rope_theta": 500000.0}))
    ours = rope_inv_freq(16, 500000.0, loaded.cfg.rope_scaling)
    torch.testing.assert_close(ours, hf.inv_freq.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, rope_inv_freq(16, 500000.0))  # the scaling changes low frequencies
    ref = head_reference(loaded)
    write_head(loaded, tmp_path / "g", max_positions=256)
    assert compare_head(str(tmp_path / "g/model.onnx"), str(tmp_path / "g/fc.onnx"), ref)["max_logit_error"] < 1e-4
    from specdec_rt.export.eagle import EagleConfig

    assert EagleConfig.from_json(loaded.cfg.to_json(), 3) == loaded.cfg  # our config.json keeps it


def test_quantized_and_portable_head_graphs(small_target, tmp_path):
    """write_head + compare_head directly: int8 MatMulNBits and a packed embedding (reported,
    not enforced), and the portable op set (no contrib ops, enforced)."""
    import onnx

    from specdec_rt.export.eagle_graph import compare_head, head_reference, write_head

    _, head = make_head(small_target, tmp_path / "head")
    head = head.eval()
    ref = head_reference(head)
    write_head(head, tmp_path / "q", max_positions=256, quantize="int8", block_size=32)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "q/model.onnx"), load_external_data=False).graph.node}
    assert {"MatMulNBits", "GatherBlockQuantized", "ScatterElements"} <= ops
    report = compare_head(str(tmp_path / "q/model.onnx"), str(tmp_path / "q/fc.onnx"), ref, enforce=False)
    assert report["neg_inf_pattern_identical"] and report["top1_agreement"] >= 0.8
    write_head(head, tmp_path / "p", max_positions=256, fused=False)
    model = onnx.load(str(tmp_path / "p/model.onnx"), load_external_data=False)
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    report = compare_head(str(tmp_path / "p/model.onnx"), str(tmp_path / "p/fc.onnx"), ref)
    assert report["max_logit_error"] < 1e-4


def test_head_quantization_choice():
    """--head-quantize auto: int4 unless --quantize decides (or leaves the head out) or the
    export is portable (MatMulNBits is a contrib op); explicit choices win."""
    from specdec_rt.export.pipeline import ExportOptions, head_quantization

    assert head_quantization(ExportOptions()) == "int4"
    assert head_quantization(ExportOptions(portable=True)) is None
    assert head_quantization(ExportOptions(quantize="int8")) == "int8"
    assert head_quantization(ExportOptions(quantize="int4", quantize_roles=("target", "draft"))) is None
    assert head_quantization(ExportOptions(head_quantize="none")) is None
    assert head_quantization(ExportOptions(quantize="int4", head_quantize="int8")) == "int8"
    with pytest.raises(ExportError, match="--head-quantize"):
        ExportOptions(head_quantize="int2").check()

