"""num_draft_tokens="auto" on pairs its tuning never saw, judged without a stopwatch.

The policy was tuned on the shipped reference pair (scripts/policy_pairs.py adds three more). Here
it runs on the tiny test pairs (a noisy copy of the target as draft, and the target as its own
draft) under several injected cost models, and every run is charged the same modelled time per
step (K c + T(K + 1)). Auto must reach 0.95x of the best fixed K's tokens per modelled second:
a timing-free test of what the policy decides from what it observes.
"""
from __future__ import annotations

import pytest

import specdec_rt
from specdec_rt.runtime.policies.adaptive import AdaptivePolicy
from specdec_rt.runtime.policies.cost_model import CostModel, expected_chain_tokens
from specdec_rt.runtime.policies.tree import TreePolicy

PROMPTS = ["def add(a, b):", "for i in range(", "class Stack:\n    def", "import os\nimport",
           "x = [1, 2, 3]\nprint(", "while True:\n    ", "if x is None:\n", "return self."]
COSTS = {  # name -> (T(S) slope per extra token, c = draft step / target step)
    "cheap draft, flat T": (0.02, 0.05),
    "cheap draft, steep T": (0.15, 0.05),
    "costly draft": (0.04, 0.4),
    "draft as costly as the target": (0.04, 1.0),
}


def modelled_rate(stats_list, cost: CostModel) -> float:
    tokens = seconds = 0.0
    for st in stats_list:
        tokens += st.new_tokens - 1  # decoded after prefill
        seconds += sum(k * cost.draft_step + cost.target(k + 1) for k in st.draft_lengths)
    return tokens / seconds


@pytest.mark.parametrize("bundle_key", ["bundle", "bundle_same"])
@pytest.mark.parametrize("cost_name", list(COSTS))
def test_auto_reaches_the_best_fixed_k_on_unseen_pairs(tiny_pair, bundle_key, cost_name, monkeypatch):
    slope, c = COSTS[cost_name]
    cost = CostModel([1.0 + slope * s for s in range(16)], c)
    gen = specdec_rt.load(tiny_pair[bundle_key], threads=1)
    gen.policies.cost_model = cost  # injected: the policies use it instead of measuring
    # the costs are modelled, so the policy must not calibrate them against real draft timings
    monkeypatch.setattr(AdaptivePolicy, "observe_step", lambda self, *a, **kw: None)

    def run(k):
        out = []
        for p in PROMPTS:
            out.append(gen.generate(p, max_new_tokens=48, num_draft_tokens=k, drafter="model", ignore_eos=True,
                                    temperature=0).stats)
        return out

    auto = modelled_rate(run("auto") + run("auto"), cost)  # second pass: estimates carried over
    fixed = {k: modelled_rate(run(k) * 2, cost) for k in (0, 1, 2, 3, 4, 6, 8, 10)}
    best = max(fixed, key=fixed.get)
    assert auto >= 0.95 * fixed[best], (cost_name, bundle_key, auto, fixed)


def test_step_overhead_is_learned_and_favours_longer_blocks():
    """observe_step folds what the micro-benchmarks miss (a fixed cost per step) into the model,
    which makes longer blocks pay: K grows."""
    cost = CostModel([1.0 + 0.08 * s for s in range(16)], 0.3)
    policy = AdaptivePolicy(cost, accept=[0.85] * 12)
    k_before = policy.best_k()
    for _ in range(200):  # every step took 0.8 T(1) more than modelled
        policy.observe_step(4, policy.model_step_time(4) + 0.8)
    assert 0.75 < policy.step_overhead <= 0.8
    assert policy.best_k() > k_before


def test_in_loop_model_costs_are_learned_apart_from_the_step_overhead():
    """Drafting that costs 2x its micro-benchmark in the loop is a cost per draft token, not per
    step: learned as draft_scale it shortens K, where folded into step_overhead it lengthened it.
    A verify call slower than measured (target_scale) is learned the same way."""
    cost = CostModel([1.0 + 0.08 * s for s in range(16)], 0.3)
    policy = AdaptivePolicy(cost, accept=[0.85] * 12)
    k_before = policy.best_k()
    for k in [4, 6] * 100:  # drafting took 2 k c, verifying 1.2 T(k + 1); nothing else was missed
        drafting = 2.0 * k * cost.draft_step
        verify = 1.2 * cost.target(k + 1)
        policy.observe_step(k, drafting + verify, draft_seconds=drafting, verify_seconds=verify)
    assert 1.9 < policy.draft_scale <= 2.0 and 1.18 < policy.target_scale <= 1.2
    assert policy.step_overhead < 0.01
    assert policy.best_k() < k_before


def test_tree_policy_learns_step_overheads_for_chains_and_branches():
    """TreePolicy learns the same per-step overhead as AdaptivePolicy, for chain steps and, apart,
    for branching steps (more Python per step): a chain overhead lengthens the best chain, a
    large branching overhead makes the tree mode run chains."""
    cost = CostModel([1.0 + 0.01 * s for s in range(16)], 0.1)  # flat T(S): trees can pay
    policy = TreePolicy(cost, draft_rows=[0.1, 0.11, 0.12, 0.13], accept=[0.8] * 20, second=[0.5] * 20)
    _, chain_before = policy.best_chain(15)
    assert not policy.plan().is_chain  # with these costs a tree beats every chain
    for _ in range(200):
        policy.observe_step(chain_before, policy.model_seconds(chain_before) + 1.0)
    assert 0.9 < policy.step_overhead <= 1.0 and policy.tree_overhead is None
    _, chain_after = policy.best_chain(15)
    assert chain_after.size > chain_before.size  # a fixed cost per step favours longer blocks
    tree = policy.plan()
    for _ in range(200):  # branching steps cost 2 T(1) more than modelled (the clip's limit)
        policy.observe_step(tree, policy.model_seconds(tree) + 5.0)
    assert policy.tree_overhead > 1.9
    assert policy.plan().is_chain


def test_tree_policy_learns_in_loop_model_costs_like_the_chain_policy():
    """Draft calls at 2x their micro-benchmark in the loop are a cost per drafted level: the tree
    policy learns it as draft_scale (not as a per-step overhead, which lengthened its chains past
    chain "auto"'s), so its best chain shortens, and it agrees with AdaptivePolicy's K."""
    cost = CostModel([1.0 + 0.08 * s for s in range(16)], 0.3)
    tree = TreePolicy(cost, draft_rows=[0.3, 0.33, 0.36, 0.39], accept=[0.85] * 20, second=[0.3] * 20)
    chain = AdaptivePolicy(cost, accept=[0.85] * 12)
    _, before = tree.best_chain(15)
    for k in [4, 6] * 100:  # drafting took 2 k c, verifying 1.2 T(k + 1); nothing else was missed
        tpl = tree.chain(k)
        drafting = 2.0 * k * cost.draft_step
        verify = 1.2 * cost.target(k + 1)
        tree.observe_step(tpl, drafting + verify, draft_seconds=drafting, verify_seconds=verify)
        chain.observe_step(k, drafting + verify, draft_seconds=drafting, verify_seconds=verify)
    assert 1.9 < tree.draft_scale <= 2.0 and 1.18 < tree.target_scale <= 1.2
    assert tree.step_overhead < 0.01
    _, after = tree.best_chain(15)
    assert after.size < before.size
    assert after.size - 1 == chain.best_k()


def test_a_draft_that_never_drafts_costs_nothing(tiny_pair, monkeypatch):
    """Where "auto" settles at K = 0 the draft model never runs, not even the prompt's prefill
    (ModelDrafter.start is lazy: the prompt is caught up at the first proposal)."""
    gen = specdec_rt.load(tiny_pair["bundle"], threads=1)
    reference = gen.generate(PROMPTS[2], max_new_tokens=24, drafter=None, temperature=0).text
    gen.generate(PROMPTS[0], max_new_tokens=4, num_draft_tokens="auto", drafter="model")  # measures the cost model
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, width=1: 0)
    calls = gen.draft_engine.calls
    out = gen.generate(PROMPTS[2], max_new_tokens=24, num_draft_tokens="auto", drafter="model", temperature=0)
    assert out.text == reference
    assert gen.draft_engine.calls == calls
    monkeypatch.undo()  # and once it drafts, the catch-up brings the whole prompt in
    out = gen.generate(PROMPTS[2], max_new_tokens=24, num_draft_tokens=4, drafter="model", temperature=0)
    assert out.text == reference and out.stats.acceptance_rate > 0


def test_tree_policy_backs_off_probing_where_drafting_never_pays():
    """A costly, rarely right draft: the plan is K = 0, and the probes that re-test it back off
    (as AdaptivePolicy's do) instead of costing one drafting step in every probe_every."""
    cost = CostModel([1.0 + 0.1 * s for s in range(16)], 0.8)
    policy = TreePolicy(cost, draft_rows=[0.8, 0.9, 1.0, 1.1], accept=[0.05] * 20, second=[0.05] * 20)
    drafted = 0
    for _ in range(512):
        tpl = policy.choose()
        if tpl.size > 1:
            drafted += 1
            policy.observe(1, 0.0, 0.0)  # the probe's first token was wrong
            policy.end_step()
    assert policy.plan().size == 1
    assert drafted <= 10, drafted  # 64 probes without the back-off


@pytest.mark.parametrize("overlap", [False, True])
def test_best_k_is_the_argmax_of_step_time(overlap):
    """best_k's array form prices every K as step_time does (learned scales, the per-step
    overhead, the look-ahead's hit probability with overlap), at every batch width."""
    import numpy as np

    rng = np.random.default_rng(3)
    cost = CostModel([1.0 + 0.07 * s for s in range(16)], 0.2, {4: ([2.0 + 0.3 * s for s in range(16)], 0.5)})
    policy = AdaptivePolicy(cost, overlap=overlap)
    for _ in range(200):
        policy.accept = list(rng.uniform(0.2, 1.0, policy.k_max))
        policy.draft_scale, policy.target_scale = rng.uniform(0.5, 3.0, 2)
        policy.step_overhead = rng.uniform(0.0, 1.0)
        policy.first_draft_scale = None if rng.uniform() < 0.3 else rng.uniform(0.5, 6.0)
        tokens = expected_chain_tokens(policy.accept, policy.k_max)
        for width in (1, 4):
            rates = [tokens[k] / policy.step_time(k, width) for k in range(policy.k_max + 1)]
            assert policy.best_k(width) == int(np.argmax(rates))


def test_the_first_draft_call_is_priced_per_step_not_per_token():
    """A drafting step's first call (the catch-up, on caches the verify call evicted) costing 4 c
    while the others cost c: learned from the drafter's reported share as first_draft_scale, it
    is a cost per step and favours longer blocks, where averaged into draft_scale it made every
    drafted token look dear and shortened K."""
    cost = CostModel([1.0 + 0.08 * s for s in range(16)], 0.3)
    split = AdaptivePolicy(cost, accept=[0.9] * 12)
    averaged = AdaptivePolicy(cost, accept=[0.9] * 12)
    for k in [4, 6] * 100:
        drafting = (4.0 + (k - 1)) * cost.draft_step
        verify = cost.target(k + 1)
        split.observe_step(k, drafting + verify, draft_seconds=drafting, verify_seconds=verify,
                           first_draft_share=4.0 / (4.0 + k - 1))
        averaged.observe_step(k, drafting + verify, draft_seconds=drafting, verify_seconds=verify)
    assert 3.9 < split.first_draft_scale <= 4.0 and 0.99 < split.draft_scale <= 1.01
    assert split.step_overhead < 0.01
    assert split.best_k() > averaged.best_k()


def test_tree_policy_prices_the_first_draft_call_as_the_chain_policy_does():
    """The same first-call split in the tree policy: its best chain agrees with AdaptivePolicy's K
    and every branching template pays the first call's extra once."""
    cost = CostModel([1.0 + 0.08 * s for s in range(16)], 0.3)
    tree = TreePolicy(cost, draft_rows=[0.3, 0.33, 0.36, 0.39], accept=[0.9] * 20, second=[0.3] * 20)
    chain = AdaptivePolicy(cost, accept=[0.9] * 12)
    for k in [4, 6] * 100:
        drafting = (4.0 + (k - 1)) * cost.draft_step
        verify = cost.target(k + 1)
        share = 4.0 / (4.0 + k - 1)
        tree.observe_step(tree.chain(k), drafting + verify, drafting, verify, share)
        chain.observe_step(k, drafting + verify, draft_seconds=drafting, verify_seconds=verify,
                           first_draft_share=share)
    assert 3.9 < tree.first_draft_scale <= 4.0 and 0.99 < tree.draft_scale <= 1.01
    _, best = tree.best_chain(15)
    assert best.size - 1 == chain.best_k() and chain.best_k() > 0
    t = tree.template((-1, 0, 0, 1), (0, 0, 1, 0))  # a small branching tree
    # the root's call at the first-call scale, level 1 (one expanded node) at the later one
    assert tree.model_seconds(t) == pytest.approx(tree.first_draft_scale * 0.3 + tree.draft_scale * 0.3
                                                  + tree.target_scale * cost.target(4))


def test_chain_probe_from_k0_is_a_burst_that_stops_on_a_miss():
    """From K = 0 a probe drafts probe_k tokens for probe_steps steps in a row (its cost is the
    draft's catch-up, paid once), ends at the first step that accepts nothing, and the interval
    between probes doubles while drafting does not pay."""
    cost = CostModel([1.0 + 0.1 * s for s in range(16)], 0.8)
    policy = AdaptivePolicy(cost, accept=[0.05] * 12)
    ks = [policy.choose() for _ in range(policy.probe_every)]
    assert ks[:-1] == [0] * (policy.probe_every - 1) and ks[-1] == policy.probe_k
    policy.observe(policy.probe_k, 1)  # a hit: the probe goes on
    burst = [policy.choose() for _ in range(policy.probe_steps - 1)]
    assert burst == [policy.probe_k] * (policy.probe_steps - 1)
    assert policy.choose() == 0  # the burst is over and the estimates still say K = 0
    # the next probe starts twice the interval after this one started, and stops at its first miss
    ks = [policy.choose() for _ in range(2 * policy.probe_every - policy.probe_steps)]
    assert ks[-1] == policy.probe_k and set(ks[:-1]) == {0}
    policy.observe(policy.probe_k, 0)
    assert policy.choose() == 0
    drafted = 0
    for _ in range(1024):
        if policy.choose():
            drafted += 1
            policy.observe(policy.probe_k, 0)
    assert drafted <= 8, drafted  # every 256 steps at most (the back-off's cap)


def test_brief_drafting_does_not_reset_the_probe_back_off():
    """Estimates carried over from an earlier prompt may make a few steps draft before this
    prompt's misses pull K back to 0: that must not reset the back-off (only probe_every steps
    of paying K in a row do), or a weak pair probes every few steps again."""
    cost = CostModel([1.0 + 0.1 * s for s in range(16)], 0.8)
    policy = AdaptivePolicy(cost, accept=[0.05] * 12)
    for _ in range(600):  # back-off at its cap
        if policy.choose():
            policy.observe(policy.probe_k, 0)
    backoff = policy._backoff
    assert backoff == 32
    policy.accept = [0.99] * 12
    assert policy.choose() > 0  # drafting pays for a moment ...
    for _ in range(5):
        policy.observe(4, 0)
    while policy.choose():
        policy.observe(4, 0)
    assert policy._backoff == backoff  # ... then it does not: the back-off is still at its cap
    policy.accept = [0.99] * 12
    for _ in range(policy.probe_every):
        assert policy.choose() > 0
    assert policy._backoff == 1  # drafting paid for probe_every steps: probes are frequent again


def test_plain_steps_teach_the_context_cost_that_flattens_verification():
    """The cost model's T(S) is measured over a short past; at a long context every call costs
    a fixed extra that does not grow with S. Steps without drafting teach it (plain_offset), so
    T(2)/T(1) at this context is priced right and a K = 1 that pays is taken; drafting steps
    then learn target_scale over T(K + 1) + plain_offset (no double count)."""
    cost = CostModel([1.0 + 0.23 * s for s in range(16)], 0.0)  # T(2)/T(1) = 1.23 when measured
    policy = AdaptivePolicy(cost, accept=[0.18] * 12)
    assert policy.best_k() == 0  # 1.18 tokens for 1.23 T(1): does not pay at the measured ratio
    for _ in range(100):  # plain calls take 1.5 T(1) at this context: T(2)/T(1) is really 1.73/1.5
        policy.observe_step(0, 1.5, verify_seconds=1.5)
    assert 0.49 < policy.plain_offset <= 0.5 and policy.target_scale == 1.0
    assert policy.best_k() == 1
    for _ in range(200):  # drafting steps verify at exactly T(2) + the offset: the scale stays 1
        policy.observe_step(1, 1.73, verify_seconds=1.73, draft_seconds=0.0)
    assert policy.target_scale == pytest.approx(1.0, abs=0.01)


def test_free_drafting_restarts_per_generation_and_probes_often():
    """Prompt lookup (drafting costs nothing) learns per prompt: a new generation restarts its
    estimates from the prior and its probes are single steps at most every 32 steps; a draft
    model's policy keeps what it learned and backs off up to 32x (its probes cost a catch-up)."""
    lookup = AdaptivePolicy(CostModel([1.0 + 0.23 * s for s in range(16)], 0.0))
    model = AdaptivePolicy(CostModel([1.0 + 0.23 * s for s in range(16)], 0.3))
    for policy in (lookup, model):
        for _ in range(60):
            policy.update(2, 0)  # misses everywhere: drafting stops paying
        assert policy.best_k() == 0
    ks = [lookup.choose() for _ in range(400)]
    probes = [i for i, k in enumerate(ks) if k]
    assert probes and max(b - a for a, b in zip(probes, probes[1:])) <= 33
    assert all(ks[i + 1] == 0 for i in probes if i + 1 < len(ks))  # one-step probes
    lookup.start()
    model.start()
    assert lookup.accept == [lookup.prior] * lookup.k_max and lookup.best_k() > 0
    assert max(model.accept) < 0.1 and model.best_k() == 0
