"""A draft with its LM head cut to part of the vocabulary (specdec-export --draft-vocab N):
proposals only among the kept tokens, output exactly the target's (greedy token for token,
sampled in distribution), the graph contract unchanged."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specdec_rt.errors import ExportError
from specdec_rt.export.draft_vocab import draft_vocab_ids
from specdec_rt.export.pipeline import ExportOptions, export_pair

KEEP = 64


@pytest.fixture(scope="module")
def cut_bundle(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft_vocab") / "bundle"
    manifest = export_pair(tiny_pair["target"], tiny_pair["draft"], out, ExportOptions(progress=False, draft_vocab=KEEP))
    return out, manifest


def test_manifest_graph_and_validation(cut_bundle):
    import onnxruntime as ort

    from specdec_rt.runtime.engines.sessions import session_options

    out, manifest = cut_bundle
    draft = manifest["models"]["draft"]
    assert draft["output_ids"] == "draft/output_ids.npy" and draft["output_vocab"] == KEEP
    assert "draft/output_ids.npy" in manifest["files"]  # checksummed like every bundle file
    assert manifest["models"]["target"]["output_ids"] is None
    ids = np.load(out / draft["output_ids"])
    assert list(ids) == list(range(KEEP))  # the tiny tokenizer's one special token is id 0
    # the float graph was validated against PyTorch on the kept columns (enforced for fp32)
    assert draft["validation"]["max_logit_error"] < 1e-3 * max(1.0, draft["validation"]["max_abs_logit"])
    # session_options: another test may have made the process-wide pool, which ORT then requires
    sess = ort.InferenceSession(str(out / "draft/model.onnx"), session_options(1), providers=["CPUExecutionProvider"])
    info = json.loads((out / "manifest.json").read_text())["models"]["draft"]
    feeds = {"input_ids": np.array([[5, 9, 200]], dtype=np.int64), "position_ids": np.arange(3)[None],
             "attention_mask": np.triu(np.full((3, 3), -np.inf, dtype=np.float32), 1)[None, None]}
    for i in range(info["num_layers"]):
        for kind in ("key", "value"):
            feeds[f"past_{kind}.{i}"] = np.zeros((1, 0, info["num_kv_heads"], info["head_dim"]), np.float32)
    logits = sess.run(["logits"], feeds)[0]
    assert logits.shape == (1, 3, info["vocab_size"])  # the contract: the whole vocabulary
    assert np.isneginf(logits[..., KEEP:]).all() and np.isfinite(logits[..., :KEEP]).all()


def test_greedy_output_is_target_only(cut_bundle):
    import specdec_rt

    gen = specdec_rt.load(cut_bundle[0], threads=1)
    rng = np.random.default_rng(0)
    proposed = 0
    for n in range(4):
        prompt = rng.integers(1, 320, 8).tolist()
        ref = gen.generate_ids(prompt, max_new_tokens=24, drafter=None, ignore_eos=True)
        for kw in (dict(num_draft_tokens=4), dict(num_draft_tokens="auto"),
                   dict(num_draft_tokens=6, speculation="tree")):
            assert gen.generate_ids(prompt, max_new_tokens=24, ignore_eos=True, **kw) == ref, kw
            proposed += gen.last_stats.proposed
    assert proposed > 0


def test_draft_vocab_ids_keeps_special_tokens_and_eos():
    class Tok:
        def get_added_tokens_decoder(self):
            return {151643: None, 151645: None}

    ids = draft_vocab_ids(Tok(), 151936, 1000, eos_ids=[151645, 7])
    assert ids[:1000].tolist() == list(range(1000)) and ids[1000:].tolist() == [151643, 151645]
    with pytest.raises(ExportError, match="at least"):
        draft_vocab_ids(Tok(), 151936, 4)
    with pytest.raises(ExportError, match="--draft-vocab"):
        ExportOptions(draft_vocab=3).check()


@pytest.mark.parametrize("kwargs, says", [(dict(draft_vocab=64), "--draft-vocab cuts the draft model's LM head"),
                                          (dict(draft_quantize="int4"), "--draft-quantize sets the draft model's"),
                                          (dict(quantize="int4", quantize_roles=("target", "drfat")), "--quantize-models takes")])
def test_draft_options_without_a_draft_or_with_a_typo_are_errors(tiny_pair, tmp_path, kwargs, says):
    """Options that would do nothing are said to do nothing, before any model is loaded (they
    were silently ignored)."""
    draft = tiny_pair["draft"] if "quantize_roles" in kwargs else None
    with pytest.raises(ExportError, match=says):
        export_pair(tiny_pair["target"], draft, tmp_path / "b", ExportOptions(progress=False, **kwargs))
    assert not (tmp_path / "b").exists()


def test_sampled_output_follows_the_target(tiny_vocab_pair, tmp_path):
    """The 16-token pair with a draft that may propose 8 of them: the first three sampled tokens
    follow the target's law (chi-square, as tests/test_sampling.py), rejections included."""
    import specdec_rt
    from test_sampling import N_RUNS, PROMPT, assert_follows_joint, exact_joint

    out = tmp_path / "bundle"
    export_pair(tiny_vocab_pair["target"], tiny_vocab_pair["draft"], out, ExportOptions(progress=False, draft_vocab=8))
    gen = specdec_rt.load(out, threads=1)
    joint = exact_joint(tiny_vocab_pair["target"], 1.0, 0, 1.0)
    counts = np.zeros_like(joint)
    proposed = rejected = outside = 0
    for seed in range(N_RUNS):
        out_ids = gen.generate_ids(PROMPT, max_new_tokens=4, seed=seed, ignore_eos=True, temperature=1.0,
                                   top_k=0, top_p=1.0, num_draft_tokens=2)
        counts[out_ids[0], out_ids[1], out_ids[2]] += 1
        proposed += gen.last_stats.proposed
        rejected += gen.last_stats.proposed - gen.last_stats.accepted
        outside += any(t >= 8 for t in out_ids[1:3])
    assert_follows_joint(counts, joint, proposed, rejected)
    assert outside > 0  # tokens the draft can never propose still come out, from the target
