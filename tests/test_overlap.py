"""Drafting overlapped with verification: the same output as without, token for token (greedy)
and in distribution (sampled, chi-square against transformers' exact law of the first four
tokens, the fourth drafted by the previous step's look-ahead)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import specdec_rt
from specdec_rt.cli.demo import reference_dir
from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.core.sampling import accept_chain_sampled

from test_sampling import ALPHA, PROMPT, _warp, chi2_pvalue

PROMPTS = ["def add(a, b):", "for i in range(", "class Stack:\n    def", "import os\nimport",
           "x = [1, 2, 3]\nprint(", "while True:\n    "]


@pytest.fixture(scope="module")
def overlap_gen(tiny_pair):
    return specdec_rt.load(tiny_pair["bundle"], threads=1, overlap=True, max_batch=3)


@pytest.mark.parametrize("drafter, k", [("model", 1), ("model", 3), ("model", 6), ("model", "auto"),
                                        ("prompt_lookup", 3)])
def test_greedy_overlap_equals_target_only(overlap_gen, drafter, k):
    hits = 0
    for p in PROMPTS:
        base = overlap_gen.generate_ids(overlap_gen.tokenizer.encode(p), max_new_tokens=40, drafter=None,
                                        ignore_eos=True, temperature=0)
        out = overlap_gen.generate(p, max_new_tokens=40, drafter=drafter, num_draft_tokens=k,
                                   ignore_eos=True, temperature=0)
        assert out.token_ids == base, p
        assert out.stats.overlap
        hits += out.stats.lookahead_hits
    if drafter == "model" and k in (1, 3):  # the look-ahead was used, not only discarded
        assert hits > 0


def test_greedy_overlap_on_the_reference_pair(tmp_path_factory):
    """The shipped pair (a real draft with ~0.6-0.8 acceptance): identical to target-only, and
    most steps find their block already drafted at small K."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    ref = reference_dir()
    bundle = tmp_path_factory.mktemp("ref_overlap") / "bundle"
    export_pair(ref / "target", ref / "draft", bundle, ExportOptions(progress=False))
    gen = specdec_rt.load(bundle, overlap=True)
    prompts = [json.loads(line)["prompt"] for line in (ref / "eval_prompts.jsonl").read_text().splitlines()[:4]]
    steps = hits = 0
    for p in prompts:
        ids = gen.tokenizer.encode(p)
        base = gen.generate_ids(ids, max_new_tokens=64, drafter=None, ignore_eos=True, temperature=0)
        for k in (2, 5):
            assert gen.generate_ids(ids, max_new_tokens=64, num_draft_tokens=k, ignore_eos=True,
                                    temperature=0) == base
            steps += gen.last_stats.target_calls
            hits += gen.last_stats.lookahead_hits
    assert hits > 0.2 * steps


def test_overlapped_batch_rows_equal_single_sequences(overlap_gen):
    base = [overlap_gen.generate(p, max_new_tokens=30, drafter=None, ignore_eos=True, temperature=0).token_ids
            for p in PROMPTS]
    out = overlap_gen.generate_batch(PROMPTS, max_new_tokens=30, num_draft_tokens=3, ignore_eos=True,
                                     temperature=0)
    assert [r.token_ids for r in out] == base
    assert overlap_gen.last_batch_stats.mean_width > 1.5
    assert sum(r.stats.lookahead_hits for r in out) > 0


def test_stop_and_budget_with_a_look_ahead_in_flight(overlap_gen):
    """A row that ends mid-block (max_new_tokens, a stop string) ends exactly where it would
    without overlap; the discarded look-ahead leaves no trace in the next generation."""
    for n in (1, 2, 5, 17):
        a = overlap_gen.generate(PROMPTS[0], max_new_tokens=n, ignore_eos=True, temperature=0, num_draft_tokens=4)
        b = overlap_gen.generate(PROMPTS[0], max_new_tokens=n, ignore_eos=True, temperature=0,
                                 num_draft_tokens=4, overlap=False)
        assert a.token_ids == b.token_ids and len(a.token_ids) == n
    text = overlap_gen.generate(PROMPTS[1], max_new_tokens=40, ignore_eos=True, temperature=0).text
    stop = text[10:14]
    a = overlap_gen.generate(PROMPTS[1], max_new_tokens=40, ignore_eos=True, temperature=0, stop=stop)
    b = overlap_gen.generate(PROMPTS[1], max_new_tokens=40, ignore_eos=True, temperature=0, stop=stop,
                             overlap=False)
    assert a.text == b.text and a.finish_reason == b.finish_reason == "stop"


def test_overlap_arguments(overlap_gen, tiny_gen):
    with pytest.raises(GenerationInputError, match="tree"):
        overlap_gen.generate(PROMPTS[0], max_new_tokens=4, speculation="tree", overlap=True)
    with pytest.raises(GenerationInputError, match="overlap must be"):
        overlap_gen.generate(PROMPTS[0], max_new_tokens=4, overlap="yes")
    # a generator loaded without overlap can still overlap a generation, and vice versa
    assert tiny_gen.generate(PROMPTS[0], max_new_tokens=8, overlap=True, temperature=0).stats.overlap
    assert not overlap_gen.generate(PROMPTS[0], max_new_tokens=8, overlap=False).stats.overlap
    # the generator's default applies to chains only: a tree request on it just runs
    assert overlap_gen.generate(PROMPTS[0], max_new_tokens=8, speculation="tree", num_draft_tokens=5).token_ids
    # no drafter: nothing to overlap (and nothing breaks)
    assert not overlap_gen.generate(PROMPTS[0], max_new_tokens=8, drafter=None).stats.overlap


def test_guess_at_the_bonus_position_returns_no_extra_token():
    p = np.array([[0.0, 1.0], [1.0, 0.0]])
    q = np.array([[0.0, 1.0], [1.0, 0.0]])
    rng = np.random.default_rng(0)
    assert accept_chain_sampled(p, q, [1, 0], rng) == (2, -1)  # both accepted: no row left to draw from
    assert accept_chain_sampled(p, q, [1], rng) == (1, 0)  # the usual bonus draw
    n, nxt = accept_chain_sampled(p, np.array([[0.0, 1.0], [0.0, 1.0]]), [1, 1], rng)
    assert (n, nxt) == (1, 0)  # the guess is rejected: the residual draw takes its place


def exact_joint4(ckpt, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """P[x1, x2, x3, x4] for the first four tokens after PROMPT."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64).eval()
    v = model.config.vocab_size
    joint = np.ones([1])
    prefixes = [[]]
    with torch.no_grad():
        for _ in range(4):
            seqs = torch.tensor([PROMPT + pre for pre in prefixes])
            probs = _warp(model(seqs).logits[:, -1], temperature, top_k, top_p).numpy()  # [n_prefix, v]
            joint = (joint.reshape(-1)[:, None] * probs).reshape(*([v] * (len(prefixes[0]) + 1)))
            prefixes = [pre + [t] for pre in prefixes for t in range(v)]
    return joint


N_RUNS = 3000


@pytest.mark.parametrize("cfg", [dict(temperature=1.0, top_k=0, top_p=1.0, drafter="model", k=1),
                                 dict(temperature=0.8, top_k=5, top_p=1.0, drafter="model", k=2),
                                 dict(temperature=1.0, top_k=0, top_p=1.0, drafter="prompt_lookup", k=1)],
                         ids=lambda c: f"T{c['temperature']}-k{c['top_k']}-{c['drafter']}-K{c['k']}")
def test_sampled_overlap_follows_target_distribution(tiny_vocab_pair, cfg):
    """With K = 1, token 3 is the look-ahead's guess tested at the bonus position and token 4 the
    block it drafted ahead (when the guess was taken); K = 2 puts the look-ahead at token 4."""
    gen = specdec_rt.load(tiny_vocab_pair["bundle"], threads=1, overlap=True)
    joint = exact_joint4(tiny_vocab_pair["target"], cfg["temperature"], cfg["top_k"], cfg["top_p"])
    counts = np.zeros_like(joint)
    hits = 0
    for seed in range(N_RUNS):
        out = gen.generate_ids(PROMPT, max_new_tokens=4, seed=seed, ignore_eos=True, temperature=cfg["temperature"],
                               top_k=cfg["top_k"], top_p=cfg["top_p"], drafter=cfg["drafter"],
                               num_draft_tokens=cfg["k"])
        counts[tuple(out)] += 1
        hits += gen.last_stats.lookahead_hits
    if cfg["drafter"] == "model":
        assert 0 < hits < N_RUNS  # the look-ahead was both kept and discarded
    assert chi2_pvalue(counts.sum(axis=(0, 2, 3)), joint.sum(axis=(0, 2, 3))) > ALPHA
    assert chi2_pvalue(counts.sum(axis=(0, 1)), joint.sum(axis=(0, 1))) > ALPHA  # (x3, x4)
    assert chi2_pvalue(counts.sum(axis=(0, 1, 2)), joint.sum(axis=(0, 1, 2))) > ALPHA  # x4
    assert chi2_pvalue(counts.sum(axis=(0, 3)), joint.sum(axis=(0, 3))) > ALPHA  # (x2, x3)


def test_overlapped_sampling_is_reproducible(tiny_vocab_pair):
    gen = specdec_rt.load(tiny_vocab_pair["bundle"], threads=1, overlap=True)
    a = gen.generate_ids(PROMPT, max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True, num_draft_tokens=3)
    b = gen.generate_ids(PROMPT, max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True, num_draft_tokens=3)
    assert a == b


def test_policy_learns_the_overlapped_regime():
    """Hiding the draft behind verification when the look-ahead survives makes a step cheaper;
    since a shorter block survives more often, "auto" may pick a shorter K (cheap draft) or a
    longer one (expensive draft, high acceptance) than without overlap."""
    from specdec_rt.runtime.policies.adaptive import AdaptivePolicy
    from specdec_rt.runtime.policies.cost_model import CostModel

    def best(c: float, a: float, slope: float, overlap: bool) -> int:
        cost = CostModel([1.0 + slope * s for s in range(16)], c)
        return AdaptivePolicy(cost, accept=[a] * 12, overlap=overlap).best_k()

    cost = CostModel([1.0 + 0.05 * s for s in range(16)], 0.3)
    seq, ov = AdaptivePolicy(cost, accept=[0.9] * 12), AdaptivePolicy(cost, accept=[0.9] * 12, overlap=True)
    assert ov.step_time(4) < seq.step_time(4)
    assert best(0.1, 0.9, 0.05, True) < best(0.1, 0.9, 0.05, False)  # cheap draft: survive more often
    assert best(0.5, 0.95, 0.1, True) > best(0.5, 0.95, 0.1, False)  # costly draft: hide more of it


@pytest.mark.parametrize("attention", ["native", "fused"])
def test_float32_target_attention_is_exact_for_chains_and_refuses_trees(tiny_pair, tmp_path, attention):
    """--target-attention native / fused: float32 sums in the target (faster), chains still
    token-identical (overlapped or not), trees refused with a clear error rather than run inexactly."""
    from specdec_rt.cli.export_cli import main as export_main
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    out = tmp_path / attention
    manifest = export_pair(tiny_pair["target"], tiny_pair["draft"], out,
                           ExportOptions(progress=False, target_attention=attention))
    target = manifest["models"]["target"]
    assert target["attention_accumulation"] == "native"
    assert target["fused_attention"] is (attention == "fused")
    assert target["opset"] == (23 if attention == "fused" else 17)
    gen = specdec_rt.load(out, threads=1)
    assert not gen.exact_trees
    for p in PROMPTS[:3]:
        base = gen.generate(p, max_new_tokens=30, drafter=None, ignore_eos=True, temperature=0).token_ids
        for ov in (False, True):
            assert gen.generate(p, max_new_tokens=30, num_draft_tokens=3, ignore_eos=True, temperature=0,
                                overlap=ov).token_ids == base
    with pytest.raises(GenerationInputError, match="--target-attention fp64"):
        gen.generate(PROMPTS[0], max_new_tokens=8, speculation="tree")
    assert specdec_rt.load(tiny_pair["bundle"], threads=1).exact_trees  # the default export
    with pytest.raises(SystemExit):
        export_main(["--target", str(tiny_pair["target"]), "--out", str(tmp_path / "x"), "--target-attention", "fp32"])
