"""Sampled speculative output follows the target's processed distribution exactly.

The exact distribution of the first three new tokens is computed from the PyTorch target with
transformers' own temperature / top-k / top-p warpers (an implementation independent of ours).
Token 1 comes from prefill; tokens 2-3 come from the first verify call, i.e. from speculative
acceptance, residual resampling and the bonus token. A chi-square goodness-of-fit test at
alpha = 1e-3 (false alarm rate 0.1% per test for random seeds; the seeds here are fixed, so a
run is reproducible) checks the joint law of (token 2, token 3) and the law of token 1.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats as sps

from specdec_rt.runtime.loop.tree_step import Template

ALPHA = 1e-3
N_RUNS = 3000
PROMPT = [3, 7, 3, 7, 3, 1]
CONFIGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="model", num_draft_tokens=2),
    dict(temperature=0.8, top_k=5, top_p=1.0, drafter="model", num_draft_tokens=2),
    dict(temperature=1.3, top_k=0, top_p=0.8, drafter="model", num_draft_tokens=3),
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="prompt_lookup", num_draft_tokens=2),
    # the free and mixed drafters, and the default, whatever it resolves to on this machine
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="suffix", num_draft_tokens=2),
    dict(temperature=0.8, top_k=0, top_p=0.9, drafter="hybrid", num_draft_tokens=3),
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="suffix_hybrid", num_draft_tokens=2),
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="auto", num_draft_tokens=2),
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="model", num_draft_tokens=6, speculation="tree"),
    dict(temperature=0.8, top_k=6, top_p=0.9, drafter="model", num_draft_tokens=9, speculation="tree"),
    # the shape policy (whatever it chooses; its draft made cheap, or on this pair, where the
    # draft costs half a target call and agrees half the time, it rightly chooses not to draft),
    # and a fixed branching template: two draws at the root and at its first child, one at its second
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="model", num_draft_tokens="auto", speculation="tree",
         cheap_draft=True),
    dict(temperature=0.9, top_k=0, top_p=1.0, drafter="model", num_draft_tokens="auto", speculation="tree",
         tree_shape=Template((-1, 0, 0, 1, 1, 2), (0, 0, 1, 0, 1, 0))),
]


def _warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    x = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.softmax(x, dim=-1)


def exact_joint(ckpt, temperature, top_k, top_p) -> np.ndarray:
    """P[x1, x2, x3] for the first three tokens after PROMPT."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64).eval()
    v = model.config.vocab_size
    with torch.no_grad():
        p1 = _warp(model(torch.tensor([PROMPT])).logits[:, -1], temperature, top_k, top_p)[0]
        seq2 = torch.tensor([PROMPT + [a] for a in range(v)])
        p2 = _warp(model(seq2).logits[:, -1], temperature, top_k, top_p)  # [x1, x2]
        seq3 = torch.tensor([PROMPT + [a, b] for a in range(v) for b in range(v)])
        p3 = _warp(model(seq3).logits[:, -1], temperature, top_k, top_p).reshape(v, v, v)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts = counts.ravel().astype(float)
    expected = probs.ravel() * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(sps.chisquare(obs[keep], exp[keep]).pvalue)


def assert_follows_joint(counts: np.ndarray, joint: np.ndarray, proposed: int, rejected: int) -> None:
    """Counts of (token 1, 2, 3) over N_RUNS runs against the exact law: token 1, (token 2, 3) and
    token 3 each pass the chi-square test; the runs both accepted and rejected draft tokens
    (otherwise the test would not exercise speculative acceptance at all)."""
    assert proposed > N_RUNS // 10 and 0 < rejected < proposed
    assert chi2_pvalue(counts.sum(axis=(1, 2)), joint.sum(axis=(1, 2))) > ALPHA
    assert chi2_pvalue(counts.sum(axis=0), joint.sum(axis=0)) > ALPHA
    assert chi2_pvalue(counts.sum(axis=(0, 1)), joint.sum(axis=(0, 1))) > ALPHA


def sampled_counts(gen, joint_shape, **kwargs) -> tuple[np.ndarray, int, int]:
    """N_RUNS seeded generations of 4 tokens after PROMPT with ``kwargs``: counts of tokens 1-3,
    draft tokens proposed, and rejected."""
    counts = np.zeros(joint_shape)
    proposed = rejected = 0
    for seed in range(N_RUNS):
        out = gen.generate_ids(PROMPT, max_new_tokens=4, seed=seed, ignore_eos=True, **kwargs)
        counts[out[0], out[1], out[2]] += 1
        proposed += gen.last_stats.proposed
        rejected += gen.last_stats.proposed - gen.last_stats.accepted
    return counts, proposed, rejected


@pytest.fixture(scope="module")
def gen(tiny_vocab_pair):
    import specdec_rt

    return specdec_rt.load(tiny_vocab_pair["bundle"], threads=1)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"T{c['temperature']}-k{c['top_k']}-p{c['top_p']}-"
                         f"{c['drafter']}-{c.get('speculation', 'chain')}-{c['num_draft_tokens']}"
                         f"{'-template' if c.get('tree_shape') else ''}")
def test_sampled_tokens_follow_target_distribution(tiny_vocab_pair, gen, cfg, monkeypatch):
    if cfg.get("cheap_draft"):  # modelled costs: the policy must not calibrate them to real timings
        from specdec_rt.runtime.policies.tree import TreePolicy

        policy = gen.policies.tree()
        monkeypatch.setattr(policy, "draft_rows", [0.01 * c for c in policy.draft_rows])
        monkeypatch.setattr(TreePolicy, "observe_step", lambda self, *a, **kw: None)
    joint = exact_joint(tiny_vocab_pair["target"], cfg["temperature"], cfg["top_k"], cfg["top_p"])
    counts = np.zeros_like(joint)
    rejected = proposed = 0
    for seed in range(N_RUNS):
        out = gen.generate_ids(PROMPT, max_new_tokens=4, seed=seed, ignore_eos=True,
                               temperature=cfg["temperature"], top_k=cfg["top_k"], top_p=cfg["top_p"],
                               drafter=cfg["drafter"], num_draft_tokens=cfg["num_draft_tokens"],
                               speculation=cfg.get("speculation", "chain"), tree_shape=cfg.get("tree_shape"))
        counts[out[0], out[1], out[2]] += 1
        proposed += gen.last_stats.proposed
        rejected += gen.last_stats.proposed - gen.last_stats.accepted
    assert_follows_joint(counts, joint, proposed, rejected)


def test_chi_square_detects_a_wrong_distribution(tiny_vocab_pair):
    """Power check: drawing token 2-3 from the draft instead of the target is caught."""
    joint = exact_joint(tiny_vocab_pair["target"], 1.0, 0, 1.0)
    wrong = exact_joint(tiny_vocab_pair["draft"], 1.0, 0, 1.0).sum(axis=0)
    rng = np.random.default_rng(0)
    draws = rng.choice(wrong.size, size=N_RUNS, p=wrong.ravel() / wrong.sum())
    counts = np.bincount(draws, minlength=wrong.size).reshape(wrong.shape)
    assert chi2_pvalue(counts, joint.sum(axis=0)) < ALPHA


def test_seed_reproducible(gen):
    """With a fixed K a seed reproduces the sampled tokens ("auto", the default, picks K per step
    from measured timings: the same distribution, not always the same draws)."""
    for k in (4, 0):
        a = gen.generate_ids(PROMPT, max_new_tokens=12, temperature=1.0, seed=123, ignore_eos=True, num_draft_tokens=k)
        b = gen.generate_ids(PROMPT, max_new_tokens=12, temperature=1.0, seed=123, ignore_eos=True, num_draft_tokens=k)
        assert a == b


def test_processed_probabilities_match_transformers_warpers():
    from specdec_rt.runtime.core.sampling import SamplingParams, probabilities

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)) * 3
    vocab = rng.normal(size=(5, 4096)) * 3
    tied = np.round(rng.normal(size=(5, 4096)) * 2)  # many ties at the k-th value: all of them kept
    cases = [(logits, t, k, p) for t, k, p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.5, 0, 0.9), (0.9, 7, 0.6)]]
    cases += [(vocab, 0.8, 50, 0.9), (vocab, 1.0, 1, 0.5), (vocab, 0.8, 0, 0.95)]
    # (top-p's cut among exactly tied probabilities is an order convention: not compared)
    cases += [(tied, 0.8, 50, 1.0), (tied, 1.0, 7, 1.0)]
    for x, t, k, p in cases:
        ours = probabilities(x, SamplingParams(t, k, p))
        ref = _warp(torch.tensor(x), t, k, p).numpy()
        np.testing.assert_allclose(ours, ref, atol=1e-9)
        assert np.array_equal(ours > 0, ref > 0)


SECOND_PAIR_CONFIGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="model", num_draft_tokens=2),
    dict(temperature=0.8, top_k=5, top_p=0.9, drafter="model", num_draft_tokens=3),
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="suffix", num_draft_tokens=2),
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="suffix_hybrid", num_draft_tokens=2),
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="auto", num_draft_tokens=2),
    dict(temperature=1.0, top_k=0, top_p=1.0, drafter="model", num_draft_tokens=6, speculation="tree"),
]


@pytest.fixture(scope="module")
def second_pair(tmp_path_factory):
    """Another pair, of other families: a Qwen2 target (q/k/v biases, grouped KV heads) with a
    GPT-2 draft (learned positions, LayerNorm, GELU), both over the 16-token vocabulary."""
    from transformers import GPT2Config, Qwen2Config

    from helpers import make_tiny_vocab_checkpoint
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("second_pair")
    cfg_t = Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    cfg_d = GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2, n_positions=64, eos_token_id=0,
                       bos_token_id=0, pad_token_id=0)
    target = make_tiny_vocab_checkpoint(cfg_t, base / "target", seed=5, scale=0.5)
    draft = make_tiny_vocab_checkpoint(cfg_d, base / "draft", seed=6, scale=0.5)
    bundle = base / "bundle"
    export_pair(target, draft, bundle, ExportOptions(progress=False))
    return {"target": target, "bundle": bundle}


@pytest.mark.parametrize("cfg", SECOND_PAIR_CONFIGS, ids=lambda c: f"{c['drafter']}-{c.get('speculation', 'chain')}-"
                         f"{c['num_draft_tokens']}")
def test_sampled_tokens_follow_target_distribution_on_a_second_pair(second_pair, cfg):
    import specdec_rt

    gen2 = specdec_rt.load(second_pair["bundle"], threads=1)
    joint = exact_joint(second_pair["target"], cfg["temperature"], cfg["top_k"], cfg["top_p"])
    counts, proposed, rejected = sampled_counts(gen2, joint.shape, **{"speculation": "chain", **cfg})
    assert_follows_joint(counts, joint, proposed, rejected)
