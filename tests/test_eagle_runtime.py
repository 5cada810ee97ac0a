"""drafter="eagle": an EAGLE-3 head drafting from the target's features, exact as every drafter.

The head here has random weights (acceptance is whatever it is): what is tested is that output
never depends on it, that the runtime's proposals are the PyTorch head's (the row convention, the
catch-up, the feature cache through commits and rollbacks), and the errors users meet.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import specdec_rt
from helpers import llama_config, make_checkpoint

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):", "for i in range(10):"]


def _random_head(target_dir, out_dir, seed: int = 1, draft_vocab: int | None = None):
    """A random head for the checkpoint at ``target_dir`` (feature layers 0, 1, 1 of 2)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_rt.export.eagle import EagleConfig, EagleHead, save_head

    model = AutoModelForCausalLM.from_pretrained(str(target_dir))
    c = model.config
    vocab = c.vocab_size
    cfg = EagleConfig(hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      head_dim=c.hidden_size // c.num_attention_heads, vocab_size=vocab,
                      draft_vocab_size=draft_vocab or vocab, target_hidden_size=c.hidden_size,
                      feature_layers=(0, 1, 1), max_position_embeddings=c.max_position_embeddings)
    torch.manual_seed(seed)
    head = EagleHead(cfg, model.get_input_embeddings().weight.detach())
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() >= 2 and p.requires_grad:
                p.normal_(0, 0.08)
        if draft_vocab:  # even ids first, then odd ones
            ids = torch.cat([torch.arange(0, vocab, 2), torch.arange(1, vocab, 2)])[:draft_vocab]
            head.d2t.copy_(ids - torch.arange(draft_vocab))
    save_head(head, out_dir)
    return head, model


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory):
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("eagle")
    target = make_checkpoint(llama_config(), base / "target", seed=0)
    head, model = _random_head(target, base / "head", draft_vocab=40)
    bundle = base / "bundle"
    # a float head: its proposals are compared with PyTorch's below (the default is int4)
    export_pair(target, None, bundle, ExportOptions(progress=False, draft_head=str(base / "head"), head_quantize="none"))
    return {"target": target, "bundle": bundle, "head": head, "model": model, "head_dir": base / "head"}


@pytest.fixture(scope="module")
def eagle_gen(eagle_pair):
    return specdec_rt.load(eagle_pair["bundle"], threads=1)


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_eagle_greedy_is_target_only(eagle_gen, k):
    for prompt in PROMPTS:
        base = eagle_gen.generate(prompt, max_new_tokens=24, drafter=None, ignore_eos=True)
        spec = eagle_gen.generate(prompt, max_new_tokens=24, drafter="eagle", num_draft_tokens=k, ignore_eos=True)
        assert spec.token_ids == base.token_ids
        assert spec.stats.drafter == "eagle"
        if k != "auto":
            assert spec.stats.proposed > 0  # it drafted


def test_default_head_is_int4_and_exact(eagle_pair, tmp_path):
    """By default the head is exported int4 with one fused Attention node (cheap proposals); the
    output stays the target's, chains and trees alike."""
    import json

    from specdec_rt.export.pipeline import ExportOptions, export_pair

    bundle = tmp_path / "bundle"
    export_pair(eagle_pair["target"], None, bundle, ExportOptions(progress=False, draft_head=str(eagle_pair["head_dir"])))
    info = json.loads((bundle / "manifest.json").read_text())["models"]["head"]
    assert info["quantization"] == "int4" and info["fused_attention"]
    gen = specdec_rt.load(bundle, threads=1)
    for prompt in PROMPTS:
        base = gen.generate(prompt, max_new_tokens=24, drafter=None, ignore_eos=True)
        for kw in ({"num_draft_tokens": 3}, {"speculation": "tree", "num_draft_tokens": 6}):
            spec = gen.generate(prompt, max_new_tokens=24, drafter="eagle", ignore_eos=True, **kw)
            assert spec.token_ids == base.token_ids and spec.stats.proposed > 0


@pytest.mark.parametrize("budget", [4, "auto"])
def test_eagle_trees_are_target_only(eagle_gen, budget):
    """Dynamic trees grown by the head (each node's row reads its parent's hidden output)."""
    for prompt in PROMPTS:
        base = eagle_gen.generate(prompt, max_new_tokens=20, drafter=None, ignore_eos=True)
        spec = eagle_gen.generate(prompt, max_new_tokens=20, drafter="eagle", speculation="tree",
                                  num_draft_tokens=budget, ignore_eos=True)
        assert spec.token_ids == base.token_ids
        assert spec.stats.proposed > 0
    rows = eagle_gen.generate_batch(PROMPTS, max_new_tokens=12, drafter="eagle", speculation="tree",
                                    num_draft_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in rows] == [eagle_gen.generate(p, max_new_tokens=12, drafter=None,
                                                              ignore_eos=True).token_ids for p in PROMPTS]


def test_eagle_batch_is_target_only(eagle_gen):
    """A batch's rows share every head call (catch-up and draft steps) and stay the target's."""
    base = [eagle_gen.generate(p, max_new_tokens=16, drafter=None, ignore_eos=True).token_ids for p in PROMPTS]
    head = eagle_gen.head.engine
    calls = head.calls
    for p in PROMPTS:
        eagle_gen.generate(p, max_new_tokens=16, drafter="eagle", num_draft_tokens=3, ignore_eos=True)
    alone, calls = head.calls - calls, head.calls
    out = eagle_gen.generate_batch(PROMPTS, max_new_tokens=16, drafter="eagle", num_draft_tokens=3, ignore_eos=True)
    assert [r.token_ids for r in out] == base
    assert all(r.stats.proposed > 0 for r in out)
    assert head.calls - calls < 0.6 * alone  # ~1/3: three rows per call
    # "auto" prices a batched head step by measuring one (not B one-row steps), and stays exact
    auto = eagle_gen.generate_batch(PROMPTS, max_new_tokens=16, drafter="eagle", num_draft_tokens="auto",
                                    ignore_eos=True)
    assert [r.token_ids for r in auto] == base
    store = eagle_gen.policies
    cost = store.chain("eagle", max_width=len(PROMPTS)).cost
    assert set(store.head_widths) == set(cost.widths) and len(PROMPTS) in store.head_widths
    assert all(cost.widths[b][1] == store.head_widths[b] > 0 for b in cost.widths)
    # sampled rows drafted together: seeded, reproducible, valid ids
    kw = dict(max_new_tokens=16, drafter="eagle", num_draft_tokens=3, temperature=0.9, seed=5, ignore_eos=True)
    a = [r.token_ids for r in eagle_gen.generate_batch(PROMPTS, **kw)]
    assert a == [r.token_ids for r in eagle_gen.generate_batch(PROMPTS, **kw)]
    assert all(len(t) == 16 and all(0 <= x < eagle_gen.vocab_size for x in t) for t in a)


def test_feature_cache_holds_the_committed_positions(eagle_gen, eagle_pair):
    """After a speculative generation (rollbacks of rejected drafts included), the target's
    per-position features are those of one forward over the committed tokens."""
    import torch

    from specdec_rt.export.eagle import target_features

    res = eagle_gen.generate(PROMPTS[1], max_new_tokens=20, drafter="eagle", num_draft_tokens=4, ignore_eos=True)
    tokens = eagle_gen.encode_prompt(PROMPTS[1]) + res.token_ids
    held = eagle_gen.target.lengths[0]
    assert held == len(tokens) - 1
    want, _ = target_features(eagle_pair["model"], torch.tensor([tokens[:held]]), (0, 1, 1))
    np.testing.assert_allclose(eagle_gen.target.features[0, :held], want[0].numpy(), atol=2e-4)


def test_proposals_are_the_torch_heads(eagle_gen, eagle_pair):
    """The runtime's greedy chain from a committed prefix equals EagleHead.step in PyTorch run
    the same way: catch-up rows on the target's features, then its own hidden fed back."""
    import torch

    from specdec_rt.export.eagle import target_features
    from specdec_rt.runtime.core.gen_config import GenerationDefaults  # noqa: F401 - the loop's types below
    from specdec_rt.runtime.drafters.eagle import EagleDrafter
    from specdec_rt.runtime.loop.requests import RowRequest

    gen, head = eagle_gen, eagle_pair["head"]
    tokens = gen.encode_prompt(PROMPTS[2])
    gen.target.reset(0)
    gen.target.extend(tokens[:-1])  # the loop's invariant: the target holds every token but the last
    drafter = EagleDrafter(gen.head.engine, gen.head.fc, gen.target, context=None)
    drafter.begin(tokens)
    cfg = RowRequest(PROMPTS[2], max_new_tokens=8).loop_config(gen.generation_defaults, gen.eos_token_ids)

    class _Row:  # what propose reads of a row
        seq, rng = 0, np.random.default_rng(0)

    row = _Row()
    row.tokens, row.cfg = tokens, cfg
    (drafts, q), = drafter.propose([row], [4])
    assert q is None and len(drafts) == 4

    feats, _ = target_features(eagle_pair["model"], torch.tensor([tokens[:-1]]), (0, 1, 1))
    with torch.no_grad():
        n = len(tokens) - 1
        hidden = head.fc(feats)
        logits, out, (k, v) = head.step(torch.tensor([tokens[1:]]), hidden, torch.arange(n)[None])
        want, last, pos = [], out[:, -1:], n
        x = logits[0, -1]
        for _ in range(4):
            tok = int(torch.argmax(x))
            want.append(tok)
            x, last, (k2, v2) = head.step(torch.tensor([[tok]]), last, torch.tensor([[pos]]), past=(k, v))
            k, v, x, pos = torch.cat([k, k2], 2), torch.cat([v, v2], 2), x[0, -1], pos + 1
    assert drafts == want
    # the head proposes only from its draft vocabulary (every other token id)
    assert all(t % 2 == 0 for t in drafts)
    gen.target.reset(0)


def test_eagle_sampling_is_seeded_and_valid(eagle_gen):
    a = eagle_gen.generate(PROMPTS[0], max_new_tokens=16, drafter="eagle", num_draft_tokens=3, temperature=0.9,
                           seed=5, ignore_eos=True)
    b = eagle_gen.generate(PROMPTS[0], max_new_tokens=16, drafter="eagle", num_draft_tokens=3, temperature=0.9,
                           seed=5, ignore_eos=True)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16


def test_eagle_errors(eagle_gen, tiny_gen, eagle_pair, tmp_path):
    from specdec_rt.errors import BundleError, GenerationInputError
    from specdec_rt.runtime.loop.tree_step import Template

    with pytest.raises(GenerationInputError, match="no EAGLE-3 head"):
        tiny_gen.generate("x = 1", max_new_tokens=4, drafter="eagle")
    with pytest.raises(GenerationInputError, match="dynamic trees"):
        eagle_gen.generate("x = 1", max_new_tokens=4, drafter="eagle", speculation="tree",
                           tree_shape=Template((-1, 0, 0), (0, 0, 1)))
    with pytest.raises(GenerationInputError, match="no draft model"):
        eagle_gen.generate("x = 1", max_new_tokens=4, drafter="model")
    # a tampered head graph is refused at load, naming the file
    bad = tmp_path / "bundle"
    shutil.copytree(eagle_pair["bundle"], bad)
    graph = bad / "head" / "model.onnx"
    graph.write_bytes(graph.read_bytes() + b"\0")
    with pytest.raises(BundleError, match="head/model.onnx"):
        specdec_rt.load(bad, threads=1)
    # a manifest whose head reads other layers than the target outputs
    manifest = json.loads((bad / "manifest.json").read_text())
    graph.write_bytes(graph.read_bytes()[:-1])
    manifest["models"]["head"]["feature_layers"] = [0, 0, 1]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="layers"):
        specdec_rt.load(bad, threads=1)


def test_eagle_sampling_follows_the_target_distribution(tiny_vocab_pair, tmp_path):
    """Chi-square: the first three tokens of sampled eagle speculation follow the target's exact
    processed law (a head over 10 of the 16 tokens: the other 6 only come from the target)."""
    from test_sampling import N_RUNS, PROMPT, assert_follows_joint, exact_joint

    from specdec_rt.export.pipeline import ExportOptions, export_pair

    _random_head(tiny_vocab_pair["target"], tmp_path / "head", seed=2, draft_vocab=10)
    export_pair(tiny_vocab_pair["target"], None, tmp_path / "bundle",
                ExportOptions(progress=False, draft_head=str(tmp_path / "head")))
    gen = specdec_rt.load(tmp_path / "bundle", threads=1)
    joint = exact_joint(tiny_vocab_pair["target"], 0.9, 0, 1.0)
    counts = np.zeros_like(joint)
    proposed = rejected = 0
    for seed in range(N_RUNS):
        out = gen.generate_ids(PROMPT, max_new_tokens=4, seed=seed, ignore_eos=True, temperature=0.9, top_k=0,
                               top_p=1.0, drafter="eagle", num_draft_tokens=2)
        counts[out[0], out[1], out[2]] += 1
        proposed += gen.last_stats.proposed
        rejected += gen.last_stats.proposed - gen.last_stats.accepted
    assert_follows_joint(counts, joint, proposed, rejected)


def test_server_auto_drafter_is_the_cheaper_one(eagle_pair, eagle_gen, tiny_gen, tmp_path):
    """``specdec-serve --drafter auto``: the head or the draft model, whichever step measured
    cheaper; the only one a bundle has; none without either."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair
    from specdec_rt.serving import ServerConfig
    from specdec_rt.serving.app import SpecdecAPI

    assert eagle_gen.policies.cheaper_drafter() == "eagle"  # a head, no draft model
    assert tiny_gen.policies.cheaper_drafter() == "model"  # a draft model, no head
    bundle = tmp_path / "both"
    target = eagle_pair["target"]
    export_pair(target, target, bundle, ExportOptions(progress=False, draft_head=str(eagle_pair["head_dir"])))
    gen = specdec_rt.load(bundle, threads=1)
    store = gen.policies
    measured = store.cheaper_drafter()
    assert store.head_step is not None and store.head_step > 0 and store.cost_model.draft_step > 0
    assert measured == ("eagle" if store.head_step <= store.cost_model.draft_step else "model")
    cost = store.cost_model
    saved = cost.draft_step

    def chain_default(share: float) -> str:  # the draft's cost as this share of a target step
        cost.draft_step = share * cost.target(1)
        store.head_step = 10 * cost.target(1)  # a head dearer than any of these drafts
        return SpecdecAPI(gen, ServerConfig(model_name="both")).defaults["drafter"]

    try:
        assert chain_default(0.05) == "model"  # as cheap as the reference pair's draft
        assert chain_default(0.25) == "suffix_hybrid"  # dearer: suffix where sure, the model elsewhere
        assert chain_default(0.5) == "suffix"  # dearer still: suffix matching alone
        api = SpecdecAPI(gen, ServerConfig(model_name="both"))
        assert api.defaults["tree_drafter"] == "model"  # trees need the model (or the head)
        assert SpecdecAPI(gen, ServerConfig(model_name="both", speculation="tree")).defaults["drafter"] == "model"
    finally:
        cost.draft_step = saved  # the module's generator is shared by later tests
    store.head_step = store.cost_model.draft_step / 2
    assert SpecdecAPI(gen, ServerConfig(model_name="both")).defaults["drafter"] == "eagle"
