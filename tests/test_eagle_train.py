"""EAGLE-3 head training (specdec_rt.export.eagle_train): the training-time-test unroll equals the
step-by-step drafting procedure, the loss goes down, the vocabulary maps survive save/load, and a
resumed run continues exactly where the interrupted one stopped."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import llama_config, make_chat_checkpoint, make_checkpoint  # noqa: E402

from specdec_rt.export import eagle_train as et  # noqa: E402
from specdec_rt.export.eagle import load_head, save_head, target_features  # noqa: E402

LAYERS = (0, 1, 3)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_checkpoint(llama_config(layers=4), tmp_path_factory.mktemp("eagle_target") / "target", seed=5)
    torch.set_num_threads(1)
    return path, et.load_target(path)


def _stream(n=3000, vocab=320, seed=0):
    """Token ids with some repetition (so a head has something to learn)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(1, vocab, size=97)
    return np.concatenate([base[rng.integers(0, 97 - 8):][:8] if i % 3 else rng.integers(1, vocab, size=8)
                           for i in range(n // 8)]).astype(np.int32)


def _cfg(**kw):
    d = dict(steps=4, seq_len=24, batch=2, lr=3e-3, warmup=1, ttt_steps=3, feature_layers=LAYERS,
             intermediate_size=96, seed=11, checkpoint_every=2)
    d.update(kw)
    return et.TrainConfig(**d)


def _random_head(model, draft_ids, seed=0):
    torch.manual_seed(seed)
    cfg = _cfg()
    head = et.init_head(model, et.head_config(model, cfg, len(draft_ids)), draft_ids, "random")
    with torch.no_grad():  # break the copied init so every part matters
        for p in et.trainable(head):
            p.add_(torch.randn_like(p) * 0.05)
    return head.eval()


def test_target_forward_matches_target_features(target):
    _, model = target
    x = torch.from_numpy(_stream()[:40].astype(np.int64)).view(2, 20)
    feats, logits = target_features(model, x, LAYERS)
    f2, final = et.target_forward(model, x, LAYERS)
    ids = torch.tensor([0, 3, 17, 200, 319])
    torch.testing.assert_close(f2, feats)
    torch.testing.assert_close(et.draft_logits(model, final, ids), logits[..., ids], atol=1e-5, rtol=1e-5)
    assert torch.equal(et.target_argmax(model, final, chunk=7), logits.argmax(-1))


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_ttt_unroll_equals_stepwise_drafting(target, norm_before_residual):
    """Step-j output of the unrolled training forward at row i == catch-up over rows 0..i-j with
    the target's features, then j draft steps fed back through EagleHead.step with its KV cache
    (either residual: EAGLE's, or the speculators heads' normed one)."""
    _, model = target
    draft_ids = et.build_draft_vocab(np.arange(320)[::-1].astype(np.int64), 200, keep=[0])
    head = _random_head(model, draft_ids)
    head.cfg.norm_before_residual = norm_before_residual
    rng = np.random.default_rng(3)
    s, steps = 14, 4
    feats = torch.from_numpy(rng.normal(size=(2, s, 3 * 64)).astype(np.float32)) * 3
    ids = torch.from_numpy(rng.integers(0, 320, size=(2, s)))   # ids[:, i] = token i + 1 of row i
    with torch.no_grad():
        outs = et.unrolled_forward(head, feats, ids, steps)
        fc = head.fc(feats)
        for j in range(steps):
            for i in range(j, s):
                m = i - j
                pos = torch.arange(m + 1).expand(2, m + 1)
                _, out, (k, v) = head.step(ids[:, :m + 1], fc[:, :m + 1], pos)
                hidden = out[:, -1:]
                for t in range(1, j + 1):
                    p = m + t
                    _, hidden, (k1, v1) = head.step(ids[:, p:p + 1], hidden, torch.full((2, 1), p), past=(k, v))
                    k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
                expect = hidden[:, 0] if j else out[:, -1]
                torch.testing.assert_close(outs[j][:, i], expect, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(head.logits(outs[j][:, i]), head.logits(expect), atol=1e-4, rtol=1e-4)


def test_ttt_mask_pattern():
    m = et.ttt_mask(5, 2)[0, 0]
    allowed = (m == 0).int()
    # row 3 at step 2: step-0 rows 0..1, the step-1 row 2, the step-2 row 3
    assert allowed[3].tolist() == [1, 1, 0, 0, 0] + [0, 0, 1, 0, 0] + [0, 0, 0, 1, 0]
    assert bool((allowed.sum(-1) >= 1).all())   # no row without a key (no NaN)


def test_training_lowers_loss_on_fixed_batch(target):
    _, model = target
    cfg = _cfg()
    torch.manual_seed(0)
    draft_ids = np.arange(320)
    head = et.init_head(model, et.head_config(model, cfg, 320), draft_ids, "identity")
    src = et.StreamSource(model, _stream(), cfg, LAYERS, torch.as_tensor(draft_ids))
    batch = src.next(np.random.default_rng(0))
    probs = torch.softmax(batch.labels, -1)
    entropy = [-(probs[:, j:] * torch.log(probs[:, j:])).sum(-1).mean().item() for j in range(cfg.ttt_steps)]
    opt = et.make_optimizer(head, cfg)
    for it in range(12):
        loss, ces, accs = et.ttt_loss(head, batch, cfg)
        if it == 0:
            first, kl_first = loss.item(), [c - h for c, h in zip(ces, entropy)]
        opt.zero_grad()
        loss.backward()
        opt.step()
    last, ces_last, _ = et.ttt_loss(head, batch, cfg)
    kl_last = [c - h for c, h in zip(ces_last, entropy)]
    # a random target is nearly uniform: the soft cross-entropy can only fall to its entropy,
    # so the part above it (the KL to the target) is what must shrink, at every step
    assert last.item() < first
    assert all(b < 0.6 * a for a, b in zip(kl_first, kl_last)), (kl_first, kl_last)
    assert len(accs) == cfg.ttt_steps and all(0 <= a <= 1 for a in accs)


def test_draft_vocab_maps_round_trip(target, tmp_path):
    _, model = target
    counts = np.bincount(_stream(), minlength=320)
    draft_ids = et.build_draft_vocab(counts, 64, keep=[0, 5])
    assert len(draft_ids) == 64 and {0, 5} <= set(draft_ids.tolist())
    assert list(draft_ids) == sorted(draft_ids)
    top = set(np.argsort(-counts, kind="stable")[:50].tolist())
    assert top <= set(draft_ids.tolist())
    d2t, t2d = et.vocab_maps(draft_ids, 320)
    assert torch.equal(torch.arange(64) + d2t, torch.as_tensor(draft_ids))
    assert t2d.sum() == 64 and bool(t2d[torch.as_tensor(draft_ids)].all())
    head = _random_head(model, draft_ids)
    save_head(head, tmp_path / "head")
    back = load_head(tmp_path / "head", model.get_input_embeddings().weight.detach(), 4)
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
    assert torch.equal(back.draft_ids(), torch.as_tensor(draft_ids))
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    h = torch.randn(3, 64)
    torch.testing.assert_close(back.target_logits(h), head.target_logits(h))
    assert torch.isinf(back.target_logits(h)[:, ~t2d]).all()


def test_resume_continues_like_uninterrupted(target, tmp_path):
    path, model = target
    stream = _stream()
    full = et.train_head(path, stream, tmp_path / "a", _cfg(), model=model, progress=False)
    part = et.train_head(path, stream, tmp_path / "b", _cfg(stop_after=2), model=model, progress=False)
    assert [s["step"] for s in part["steps"]] == [1, 2] and not (tmp_path / "b" / "config.json").exists()
    assert (tmp_path / "b" / "checkpoint" / et.CHECKPOINT_NAME).is_file()
    resumed = et.train_head(path, stream, tmp_path / "b", _cfg(), model=model, resume=True, progress=False)
    assert resumed["resumed_at"] == [2]
    assert [s["step"] for s in resumed["steps"]] == [1, 2, 3, 4]
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in full["steps"]]
    assert [s["acc"] for s in resumed["steps"]] == [s["acc"] for s in full["steps"]]
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert not (tmp_path / "b" / "checkpoint").exists()   # removed once the run is complete
    with pytest.raises(et.ExportError, match="other settings"):
        et.train_head(path, stream, tmp_path / "c", _cfg(stop_after=1), model=model, progress=False)
        et.train_head(path, stream, tmp_path / "c", _cfg(lr=1e-2), model=model, resume=True, progress=False)


def test_feature_cache_built_once_and_matches(target, tmp_path):
    path, model = target
    stream = _stream()
    cfg = _cfg(steps=2, draft_vocab=100, cache_windows=10, cache_shard=4)
    log = et.train_head(path, stream, tmp_path / "h", cfg, model=model, feature_cache=tmp_path / "fc",
                        special_ids=[0], progress=False)
    assert log["draft_vocab"] == {**log["draft_vocab"], "size": 100, "source": "argmax"}
    index = json.loads((tmp_path / "fc" / "index.json").read_text())
    assert index["complete"] and [s["n"] for s in index["shards"]] == [4, 4, 2]
    stamp = (tmp_path / "fc" / "shard-00000.features").stat().st_mtime_ns
    et.train_head(path, stream, tmp_path / "h2", cfg, model=model, feature_cache=tmp_path / "fc", progress=False)
    assert (tmp_path / "fc" / "shard-00000.features").stat().st_mtime_ns == stamp
    # the cached window 0 gives what the target computes on the fly (up to float16)
    cache = et.FeatureCache(tmp_path / "fc", index["key"])
    arr = cache.arrays(index["shards"][0])
    x = torch.from_numpy(stream[:cfg.seq_len].astype(np.int64))[None]
    assert np.array_equal(arr["tokens"][0], stream[:cfg.seq_len])
    feats, logits = target_features(model, x, LAYERS)
    torch.testing.assert_close(torch.from_numpy(np.array(arr["features"][0])).float(), feats[0], atol=2e-2, rtol=2e-3)
    assert np.array_equal(arr["argmax"][0], logits[0].argmax(-1).numpy())
    ids = torch.arange(0, 320, 3)
    lab = et.draft_logits(model, torch.from_numpy(np.array(arr["final"][0])).float(), ids)
    torch.testing.assert_close(lab, logits[0][:, ids], atol=2e-2, rtol=1e-2)
    with pytest.raises(et.ExportError, match="another target"):
        et.train_head(path, stream, tmp_path / "h3", _cfg(steps=1, seq_len=20), model=model,
                      feature_cache=tmp_path / "fc", progress=False)


def test_cli_text_and_jsonl(target, tmp_path):
    path, _ = target
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.py").write_text("def f(x):\n    return x + 1\n" * 30)
    (tmp_path / "d" / "b.jsonl").write_text("\n".join(json.dumps({"text": f"print({i} * {i})\n" * 20})
                                                      for i in range(5)) + "\n")
    rc = et.main(["--target", str(path), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "head"),
                  "--steps", "3", "--seq-len", "32", "--batch", "2", "--feature-layers", "0,1,3",
                  "--intermediate-size", "64", "--draft-vocab", "128", "--no-progress", "--dtype", "float16"])
    assert rc == 0
    log = json.loads((tmp_path / "head" / "training_log.json").read_text())
    assert log["data"]["files"] == 2 and log["data"]["documents"] == 6 and log["seed"] == 0
    assert len(log["steps"]) == 3 and log["draft_vocab"]["size"] == 128 and log["wall_s"] >= 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "head" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.float16
        assert "embed_tokens.weight" not in f.keys()
    assert et.main(["--target", str(path), "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    # --device: cpu by default; a device this torch cannot use is one line, before anything loads
    assert et.main(["--target", str(path), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "y"),
                    "--device", "tpu"]) == 2
    if not torch.cuda.is_available():
        with pytest.raises(et.ExportError, match="no CUDA device"):
            et.resolve_device("cuda")
    assert et.resolve_device("cpu") == torch.device("cpu")


def test_chat_records_use_the_template(tmp_path):
    from transformers import AutoTokenizer

    ckpt = make_chat_checkpoint(tmp_path / "chat", "chatml")
    tok = AutoTokenizer.from_pretrained(ckpt)
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                              {"role": "assistant", "content": "x = 1"}]}) + "\n")
    ids, stats = et.tokenize_data([tmp_path / "c.jsonl"], tok)
    assert stats["chat_records"] == 1
    text = tok.decode(ids.tolist())
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("x = 1<|im_end|>\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") in et.special_token_ids(tok)


def test_second_stage_on_fixed_windows(target, tmp_path):
    """init_from starts from a saved head (same shapes/vocabulary, else an error); ``windows``
    trains on fixed sequences (e.g. the target's own generations) at random offsets."""
    path, model = target
    first = _random_head(model, np.arange(320))
    save_head(first, tmp_path / "stage1")
    head = et.init_head(model, et.head_config(model, _cfg(), 320), np.arange(320), "random")
    et.start_from(head, tmp_path / "stage1", 4)
    for k, v in first.state_dict().items():
        assert torch.equal(head.state_dict()[k], v), k
    small = et.init_head(model, et.head_config(model, _cfg(), 64), np.arange(64), "random")
    with pytest.raises(et.ExportError, match="other shapes"):
        et.start_from(small, tmp_path / "stage1", 4)
    first.cfg.norm_before_residual = True  # a speculators head: the next stage keeps its residual
    save_head(first, tmp_path / "stage1-nbr")
    head = et.init_head(model, et.head_config(model, _cfg(), 320), np.arange(320), "random")
    et.start_from(head, tmp_path / "stage1-nbr", 4)
    assert head.cfg.norm_before_residual and head.midlayer.cfg.norm_before_residual
    windows = np.stack([np.full(30, 7 + r) for r in range(5)]).astype(np.int32)
    src = et.StreamSource(model, _stream(), _cfg(), LAYERS, torch.arange(320), windows=windows)
    batch = src.next(np.random.default_rng(0))
    assert all(len(set(row.tolist())) == 1 and 7 <= row[0] < 12 for row in batch.input_ids)
    log = et.train_head(path, _stream(), tmp_path / "stage2", _cfg(steps=2, init_from=str(tmp_path / "stage1")),
                        model=model, windows=windows, progress=False)
    assert log["args"]["init_from"] == str(tmp_path / "stage1") and len(log["steps"]) == 2
    with pytest.raises(et.ExportError, match="training windows"):
        et.StreamSource(model, _stream(), _cfg(), LAYERS, torch.arange(320), windows=windows[:, :10])
