"""Greedy speculative output == target-only greedy == transformers' own greedy generate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

PROMPTS = [[5, 17, 42, 99, 3], [200, 201, 202, 7, 7, 7, 9, 310], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def hf_greedy(ckpt, prompt, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_target_only_matches_transformers(tiny_pair, tiny_gen, prompt):
    ours = tiny_gen.generate_ids(prompt, max_new_tokens=32, drafter=None, ignore_eos=True)
    assert ours == hf_greedy(tiny_pair["target"], prompt, 32)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_greedy_is_exact(any_gen, prompt, k):
    base = any_gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
    spec = any_gen.generate_ids(prompt, max_new_tokens=40, num_draft_tokens=k, ignore_eos=True)
    assert spec == base
    stats = any_gen.last_stats
    assert stats.proposed > 0
    assert stats.new_tokens == 40


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_lookup_greedy_is_exact(tiny_gen, prompt):
    base = tiny_gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
    spec = tiny_gen.generate_ids(prompt, max_new_tokens=40, drafter="prompt_lookup", num_draft_tokens=3,
                                 ignore_eos=True)
    assert spec == base


def test_identical_draft_accepts_everything(tiny_pair):
    import specdec_rt

    gen = specdec_rt.load(tiny_pair["bundle_same"], threads=1)
    for k in (1, 3, 8):
        base = gen.generate_ids(PROMPTS[0], max_new_tokens=30, drafter=None, ignore_eos=True)
        spec = gen.generate_ids(PROMPTS[0], max_new_tokens=30, num_draft_tokens=k, drafter="model", ignore_eos=True)
        assert spec == base
        assert gen.last_stats.acceptance_rate == 1.0
        assert all(r == 1.0 for r in gen.last_stats.per_position_acceptance)


def test_rollback_leaves_cache_equal_to_fresh_prefill(tiny_pair, any_gen):
    """After many accept/reject rounds, the committed cache equals a fresh prefill's."""
    prompt = PROMPTS[1]
    tiny_gen = any_gen
    out = tiny_gen.generate_ids(prompt, max_new_tokens=48, num_draft_tokens=4, drafter="model", ignore_eos=True)
    stats = tiny_gen.last_stats
    assert 0 < stats.accepted < stats.proposed  # both accepts and rejects happened
    tokens = prompt + out
    target = tiny_gen.target
    assert target.length == len(tokens) - 1
    spec_cache = [target.cache.read(l, 0, target.length) for l in range(target.info.num_layers)]
    draft = tiny_gen.draft_engine
    draft_len = draft.length
    draft_cache = [draft.cache.read(l, 0, draft_len) for l in range(draft.info.num_layers)]

    for eng, cached, n in ((target, spec_cache, target.length), (draft, draft_cache, draft_len)):
        assert_cache_equals_fresh_prefill(eng, cached, tokens, n)


def assert_cache_equals_fresh_prefill(eng, cached, tokens, n):
    """Re-prefill ``tokens[:n]`` into ``eng`` and compare its K/V with ``cached``."""
    from specdec_rt.runtime.core.masks import causal_mask

    eng.reset()
    pos = np.arange(n)
    eng.forward(np.asarray(tokens[:n]), pos, causal_mask(0, pos))
    eng.commit(n)
    for layer, (k, v) in enumerate(cached):
        fk, fv = eng.cache.read(layer, 0, n)
        np.testing.assert_allclose(k, fk, atol=1e-5)
        np.testing.assert_allclose(v, fv, atol=1e-5)


def test_stream_commits_the_same_tokens(tiny_gen):
    from specdec_rt.runtime.api.generator import GenerationResult
    from specdec_rt.runtime.core.stats import GenerationStats

    prompt = "def add(a, b):\n    return"
    result = tiny_gen.generate(prompt, max_new_tokens=24, ignore_eos=True)
    streamed = GenerationResult("", [], GenerationStats())
    pieces = list(tiny_gen.stream(prompt, max_new_tokens=24, ignore_eos=True, result=streamed))
    assert streamed.token_ids == result.token_ids
    assert "".join(pieces) == streamed.text
    assert pieces


def test_stop_string_and_eos(tiny_gen):
    first = tiny_gen.generate("x = 1", max_new_tokens=20, ignore_eos=True)
    assert first.finish_reason == "length"
    # stop at a string known to occur in the completion
    text = first.text
    stop = text[3:6] if len(text) >= 6 else text[:1]
    res = tiny_gen.generate("x = 1", max_new_tokens=20, ignore_eos=True, stop=[stop])
    assert res.finish_reason == "stop"
    assert stop not in res.text
    assert text.startswith(res.text)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tree_greedy_is_exact(any_gen, prompt):
    base = any_gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
    for budget in (1, 4, 15):
        tree = any_gen.generate_ids(prompt, max_new_tokens=40, speculation="tree", num_draft_tokens=budget,
                                    ignore_eos=True)
        assert tree == base


def test_tree_with_identical_draft_accepts_whole_depth(tiny_pair):
    import specdec_rt
    from specdec_rt.runtime.loop.tree_step import TreeShape

    gen = specdec_rt.load(tiny_pair["bundle_same"], threads=1)
    base = gen.generate_ids(PROMPTS[2], max_new_tokens=36, drafter=None, ignore_eos=True)
    # random weights give flat draft distributions: switch the confidence stop off
    shape = TreeShape(budget=15, depth=6, min_path_prob=0.0)
    tree = gen.generate_ids(PROMPTS[2], max_new_tokens=36, speculation="tree", tree_shape=shape,
                            ignore_eos=True)
    assert tree == base
    # the draft's greedy chain is always in the tree (as deep as the node budget allows) and the
    # target accepts all of it: far more than one token per call
    stats = gen.last_stats
    assert stats.tokens_per_target_call >= 3.0


def test_tree_cache_equals_fresh_prefill(any_gen):
    prompt = PROMPTS[1]
    out = any_gen.generate_ids(prompt, max_new_tokens=40, speculation="tree", ignore_eos=True)
    tokens = prompt + out
    target = any_gen.target
    n = target.length
    assert n == len(tokens) - 1
    cached = [target.cache.read(l, 0, n) for l in range(target.info.num_layers)]
    assert_cache_equals_fresh_prefill(target, cached, tokens, n)


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_adaptive_draft_length_is_exact(any_gen, drafter):
    for prompt in PROMPTS:
        base = any_gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
        auto = any_gen.generate_ids(prompt, max_new_tokens=40, drafter=drafter, num_draft_tokens="auto",
                                    ignore_eos=True)
        assert auto == base


def test_adaptive_policy_grows_k_when_everything_is_accepted(tiny_pair):
    import specdec_rt
    from specdec_rt.runtime.policies.adaptive import AdaptivePolicy
    from specdec_rt.runtime.policies.cost_model import CostModel

    gen = specdec_rt.load(tiny_pair["bundle_same"], threads=1)
    out = gen.generate_ids(PROMPTS[0], max_new_tokens=60, num_draft_tokens="auto", ignore_eos=True)
    assert out == gen.generate_ids(PROMPTS[0], max_new_tokens=60, drafter=None, ignore_eos=True)
    # the policy's logic on a fixed cost model: cheap draft + perfect acceptance -> long drafts,
    # useless draft -> no drafting
    cost = CostModel(target_times=[1.0 + 0.05 * s for s in range(16)], draft_step=0.05)
    good = AdaptivePolicy(cost, accept=[0.98] * 12)
    bad = AdaptivePolicy(cost, accept=[0.02] * 12)
    assert good.best_k() >= 8
    assert bad.best_k() == 0
    for _ in range(50):
        bad.update(4, 4)  # evidence of acceptance raises the estimates
    assert bad.best_k() >= 4


def test_sliding_window_matches_transformers(tmp_path):
    """Mistral with a window shorter than the generation: the runtime's masks apply it."""
    import specdec_rt

    from helpers import windowed_mistral_bundle

    ckpt, bundle = windowed_mistral_bundle(tmp_path)
    gen = specdec_rt.load(bundle, threads=1)
    assert gen.target.info.sliding_window == 6
    prompt = PROMPTS[2]
    ref = hf_greedy(ckpt, prompt, 24)
    assert gen.generate_ids(prompt, max_new_tokens=24, drafter=None, ignore_eos=True) == ref
    assert gen.generate_ids(prompt, max_new_tokens=24, num_draft_tokens=3, ignore_eos=True) == ref
    assert gen.generate_ids(prompt, max_new_tokens=24, speculation="tree", ignore_eos=True) == ref
