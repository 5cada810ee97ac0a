"""Issue 12: the draft graph's attention as one ONNX ``Attention`` node per layer.

Draft graphs are exported with ``GraphOptions.fused_attention`` by default (opset 23, float32 sums
inside ONNX Runtime's kernel); the target never is. For the most common families, the fused draft
must export, validate against PyTorch like the plain one, and propose the same greedy drafts
(decode chain, chain verify, token tree); a bundle with a fused draft must still decode greedily
exactly as target-only. Every family's fused draft is also validated by
tests/test_architectures.py (``test_fused_export_validates`` exports each checkpoint as draft too).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_checkpoint  # noqa: E402
from test_architectures import VOCAB, _check_validation, _config  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "gemma2", "gpt2"]
PROMPTS = [[5, 17, 42, 99, 3], [200, 201, 202, 7, 7, 7, 9, 310], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
STEPS = 16


def _export_draft(ckpt: Path, out: Path, fused: bool):
    from specdec_rt.export.pipeline import ExportOptions, export_model

    return export_model(ckpt, out, "draft", ExportOptions(progress=False, draft_fused_attention=fused)).info


def _engine(root: Path, info: dict):
    from specdec_rt.runtime.core.bundle import ModelInfo
    from specdec_rt.runtime.engines.ort import OrtEngine

    return OrtEngine(root / info["graph"], ModelInfo.from_dict("draft", info), max_len=64, threads=1)


def _greedy_drafts(engine, prompt: list[int]) -> list[int]:
    """The draft's own greedy chain: prefill, then one token per call (the decode path)."""
    engine.reset()
    tok = int(np.argmax(engine.extend(prompt)))
    out = [tok]
    for _ in range(STEPS - 1):
        tok = int(np.argmax(engine.step(tok)))
        out.append(tok)
    return out


def _tree_argmax(engine, prompt: list[int]) -> list[int]:
    """Argmax of every node of a 5-node tree (root, two children, a grandchild on each) after the prompt."""
    from specdec_rt.runtime.core.masks import NEG_INF

    engine.reset()
    engine.extend(prompt)
    p = engine.length
    parents = [-1, 0, 0, 1, 2]
    depth = [0, 1, 1, 2, 2]
    mask = np.full((5, p + 5), NEG_INF, dtype=np.float32)
    mask[:, :p] = 0
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, p + j] = 0
            j = parents[j]
    logits = engine.forward(np.array([7, 11, 13, 17, 19]), np.array([p + d for d in depth]), mask)
    return [int(x) for x in np.argmax(logits, axis=-1)]


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_draft_validates_and_drafts_like_the_plain_one(tmp_path, name):
    import onnx

    ckpt = make_checkpoint(_config(name), tmp_path / "ckpt", tokenizer_vocab=VOCAB)
    fused = _export_draft(ckpt, tmp_path / "fused", True)
    plain = _export_draft(ckpt, tmp_path / "plain", False)

    assert fused["fused_attention"] is True and fused["opset"] == 23
    assert plain["fused_attention"] is False and plain["opset"] == 17
    assert fused["attention_accumulation"] == plain["attention_accumulation"] == "native"
    _check_validation(fused)
    _check_validation(plain)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "fused" / fused["graph"]), load_external_data=False).graph.node]
    assert ops.count("Attention") == fused["num_layers"] and "Softmax" not in ops
    assert "Identity" not in ops
    assert fused["num_nodes"] < plain["num_nodes"]
    plain_ops = [n.op_type for n in onnx.load(str(tmp_path / "plain" / plain["graph"]),
                                              load_external_data=False).graph.node]
    assert "Attention" not in plain_ops

    e_fused, e_plain = _engine(tmp_path / "fused", fused), _engine(tmp_path / "plain", plain)
    for prompt in PROMPTS:
        assert _greedy_drafts(e_fused, prompt) == _greedy_drafts(e_plain, prompt)
        assert _tree_argmax(e_fused, prompt) == _tree_argmax(e_plain, prompt)
        # chain verify: S = 5 rows at once give the decode path's drafts
        e_fused.reset()
        e_fused.extend(prompt)
        chain = _greedy_drafts(e_plain, prompt)[:5]
        p = e_fused.length
        from specdec_rt.runtime.core.masks import causal_mask

        pos = np.arange(p, p + 5)
        rows = e_fused.forward(np.array(chain), pos, causal_mask(p, pos))
        assert [int(x) for x in np.argmax(rows[:-1], axis=-1)] == chain[1:]


def test_bundle_defaults_and_switches(tiny_pair, tmp_path):
    """The tiny pair's bundle (default options): fused draft, float64 plain target; the switch and
    --portable give a plain draft."""
    import json

    from specdec_rt.export.pipeline import ExportOptions, export_pair

    models = json.loads((tiny_pair["bundle"] / "manifest.json").read_text())["models"]
    assert models["draft"]["fused_attention"] is True and models["draft"]["opset"] == 23
    assert models["target"]["fused_attention"] is False and models["target"]["opset"] == 17
    assert models["target"]["attention_accumulation"] == "fp64"

    plain = export_pair(tiny_pair["target"], tiny_pair["draft"], tmp_path / "plain",
                        ExportOptions(progress=False, draft_fused_attention=False, validate=False))
    assert plain["models"]["draft"]["fused_attention"] is False and plain["models"]["draft"]["opset"] == 17
    portable = export_pair(tiny_pair["target"], tiny_pair["draft"], tmp_path / "portable",
                           ExportOptions(progress=False, portable=True, validate=False))
    for role in ("target", "draft"):
        assert portable["models"][role]["fused_attention"] is False
        assert portable["models"][role]["opset"] == 17


@pytest.mark.parametrize("speculation,k", [("chain", 4), ("chain", 8), ("tree", 8)])
def test_fused_draft_bundle_is_exact(tiny_gen, speculation, k):
    assert tiny_gen.bundle.draft.fused_attention
    for prompt in PROMPTS:
        base = tiny_gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
        spec = tiny_gen.generate_ids(prompt, max_new_tokens=40, num_draft_tokens=k, speculation=speculation,
                                     ignore_eos=True)
        assert spec == base
        assert tiny_gen.last_stats.proposed > 0


def test_fused_draft_batch_is_exact(tiny_pair):
    import specdec_rt

    gen = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=3)
    base = [gen.generate_ids(p, max_new_tokens=24, drafter=None, ignore_eos=True) for p in PROMPTS]
    out = gen.generate_batch(PROMPTS, max_new_tokens=24, num_draft_tokens=3, ignore_eos=True)
    assert [r.token_ids for r in out] == base


def test_old_onnxruntime_is_refused(tiny_pair, monkeypatch):
    import specdec_rt
    from specdec_rt.errors import BackendUnavailableError
    from specdec_rt.runtime.engines import ort as engine

    monkeypatch.setattr(engine, "_ort_version", lambda: (1, 22))
    with pytest.raises(BackendUnavailableError, match="--draft-plain-attention"):
        specdec_rt.load(tiny_pair["bundle"], threads=1)


def test_windowed_host_path_matches_session_run(tiny_pair):
    """The draft's host path (persistent bindings, past in windows of PAST_WINDOW positions, masked
    beyond the length) gives what session.run over exact-length views gives: logits to rounding,
    the same argmax, the same K/V in the cache, across window boundaries, several sequences of a
    batched cache (with a restride in between) and tree masks."""
    import specdec_rt
    from specdec_rt.runtime.core.masks import causal_mask
    from specdec_rt.runtime.engines.window_binding import PAST_WINDOW

    gen = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=3)
    win = gen.draft_engine
    ref = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=3).draft_engine
    ref.past_window = 0
    assert win.past_window == PAST_WINDOW and gen.target.past_window == 0
    # an explicit io_binding choice is honoured: False keeps session.run, True the per-call bindings
    for io in (False, True):
        assert specdec_rt.load(tiny_pair["bundle"], threads=1, io_binding=io).draft_engine.past_window == 0
    rng = np.random.default_rng(0)

    def both(fn):
        a, b = fn(win), fn(ref)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        assert np.array_equal(np.argmax(a, axis=-1), np.argmax(b, axis=-1))

    for e in (win, ref):
        e.reset()
    for seq, prompt_len in ((0, 30), (2, 5), (1, 64)):
        toks = rng.integers(1, 300, prompt_len)
        both(lambda e: e.extend(toks, seq=seq))
    for _ in range(40):  # steps across window boundaries, sequences interleaved
        seq = int(rng.integers(0, 3))
        tok = int(rng.integers(1, 300))
        both(lambda e: e.step(tok, seq))
    for _ in range(40):  # a draft's rhythm: S = 1 steps, S = 2 catch-ups, rollbacks across windows
        seq, kind = int(rng.integers(0, 3)), rng.random()
        toks = rng.integers(1, 300, 2)
        if kind < 0.3:
            back = max(1, win.lengths[seq] - int(rng.integers(1, PAST_WINDOW + 3)))
            for e in (win, ref):
                e.rollback(back, seq)
        elif kind < 0.6:
            both(lambda e: e.extend(toks, seq=seq))
        else:
            both(lambda e: e.step(int(toks[0]), seq))
    assert {s for s, _ in win._wins} >= {1, 2}  # bindings kept per S: no rebinding per step
    stride = win.cache.stride
    for e in (win, ref):  # a batched call re-lays the cache out (restride): the bindings follow
        e.forward_rows([0, 1], [[5, 6], [7]])
    assert win.cache.stride != stride
    for seq in (0, 1, 2):
        p = win.lengths[seq]
        pos = np.array([p, p + 1, p + 1])
        mask = causal_mask(p, np.arange(p, p + 3))
        mask[2, p + 1] = -np.inf  # a tree: node 2 is node 1's sibling
        both(lambda e: e.forward(np.array([3, 4, 5]), pos, mask, seq))
        both(lambda e: e.step(9, seq))
        for layer in range(win.info.num_layers):
            for x, y in zip(win.cache.read(layer, 0, win.lengths[seq] + 3, seq),
                            ref.cache.read(layer, 0, ref.lengths[seq] + 3, seq)):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)


def test_export_cli_switch(monkeypatch, tmp_path):
    """--draft-plain-attention reaches ExportOptions; --portable and --trt imply plain drafts anyway."""
    from specdec_rt.cli import export_cli
    from specdec_rt.export import pipeline

    seen = []

    def fake_export_pair(target, draft, out, opts):
        seen.append(opts)
        raise pipeline.ExportError("stop here")

    monkeypatch.setattr(pipeline, "export_pair", fake_export_pair)
    base = ["--target", str(tmp_path), "--draft", str(tmp_path), "--out", str(tmp_path / "b"), "--quiet"]
    export_cli.main(base)
    export_cli.main(base + ["--draft-plain-attention"])
    assert [o.draft_fused_attention for o in seen] == [True, False]
    assert pipeline.fused_attention("draft", portable=False)
    assert not pipeline.fused_attention("draft", portable=True)
    assert not pipeline.fused_attention("target", portable=False)
    assert not pipeline.fused_attention("draft", portable=False, draft_fused_attention=False)
