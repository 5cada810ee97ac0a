"""Tree speculation with the shape policy (``speculation="tree"``, ``num_draft_tokens="auto"``):
the shape choice on synthetic cost models, and greedy output equal to target-only whatever shape
runs (chains, fixed branching templates, the policy forced to branch)."""
from __future__ import annotations

import pytest

from test_exactness import PROMPTS

STEEP = [1.0, 1.09, 1.19, 1.22, 1.31, 1.37, 1.68, 1.73, 1.79, 1.85, 1.98, 2.1, 2.43, 2.5, 2.5, 2.58]
DRAFT_ROWS = [0.07, 0.075, 0.08, 0.083, 0.09, 0.097, 0.11, 0.12]


def _policy(target_times, a, b, draft_rows=DRAFT_ROWS):
    from specdec_rt.runtime.policies.cost_model import CostModel
    from specdec_rt.runtime.policies.tree import TreePolicy

    pol = TreePolicy(CostModel(list(target_times), draft_rows[0]), draft_rows=list(draft_rows))
    pol.accept = [a] * len(pol.accept)
    pol.second = [b] * len(pol.second)
    return pol


def _rate(pol, tpl) -> float:
    """Expected tokens per second of a template under the policy's own model."""
    tokens, seconds = pol.expected(tpl)
    return tokens / seconds


def test_template_structure():
    from specdec_rt.runtime.loop.tree_step import Template

    chain = Template.chain(4)
    assert chain.is_chain and chain.size == 5 and chain.max_depth == 4
    assert [len(l) for l in chain.levels] == [1, 1, 1]
    tree = Template((-1, 0, 0, 1, 1, 2), (0, 0, 1, 0, 1, 0))
    assert not tree.is_chain and tree.max_depth == 2
    assert tree.width == [2, 2, 1, 0, 0, 0]
    # node 5 (under the root's second child) sees the root, node 2 and itself only
    assert tree.visible[5].tolist() == [True, False, True, False, False, True]
    # the draft feeds the two depth-1 nodes in one call, each seeing only itself in the region
    assert tree.levels[0].tolist() == [1, 2] and tree.level_visible[0].tolist() == [[True, False], [False, True]]
    with pytest.raises(ValueError):
        Template((-1, 0, 1, 0), (0, 0, 0, 1))  # not breadth-first


def test_policy_chooses_a_chain_when_branches_cannot_pay():
    # steep T(S) (this CPU) and a draft whose second choice is rarely right: the best chain
    pol = _policy(STEEP, a=0.8, b=0.05)
    tpl = pol.plan()
    assert tpl.is_chain and 3 <= tpl.size - 1 <= 8
    # a useless draft: no drafting at all
    assert _policy(STEEP, a=0.02, b=0.02).plan().size == 1
    # with max_rank 1 the policy is the chain policy: same choice
    pol1 = _policy(STEEP, a=0.8, b=0.05)
    pol1.max_rank = 1
    assert pol1.plan() is not None and pol1.plan().key == tpl.key


def test_policy_chooses_branches_when_second_choices_pay_and_t_is_flat():
    flat = [1.0 + 0.005 * s for s in range(16)]
    pol = _policy(flat, a=0.7, b=0.6)
    tpl = pol.plan()
    assert not tpl.is_chain and any(tpl.ranks[1:]) and tpl.size - 1 >= 8
    # and it expects more tokens per second than the best chain it could have run
    chains = [pol.chain(k) for k in range(0, 13)]
    assert _rate(pol, tpl) > max(_rate(pol, c) for c in chains) * 1.05


def test_policy_plan_is_never_worse_than_the_best_chain():
    for times in (STEEP, [1.0 + 0.02 * s for s in range(16)], [1.0] * 16):
        for a in (0.3, 0.6, 0.9):
            for b in (0.0, 0.3, 0.7):
                pol = _policy(times, a, b)
                best_chain = max(_rate(pol, pol.chain(k)) for k in range(0, 13))
                assert _rate(pol, pol.plan()) >= best_chain * (1 - 1e-9)


def test_policy_learns_second_choice_rate():
    pol = _policy(STEEP, a=0.6, b=0.3)
    for _ in range(60):
        pol.observe(1, 0.0, 1.0)  # first choice wrong, second right
        pol.observe(2, 1.0)
        pol.end_step()
    assert pol.second[0] > 0.9 and pol.accept[0] < 0.1 and pol.accept[1] > 0.9
    assert pol.accept[5] == pol.accept[1]  # untested depths inherit the deepest tested estimate
    # probing deepens the plan every probe_every steps
    sizes = [pol.choose().max_depth for _ in range(pol.probe_every)]
    assert sizes[-1] >= max(sizes[:-1]) + 1 or sizes[-1] == pol.max_depth


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tree_auto_greedy_is_exact(any_gen, prompt):
    base = any_gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
    assert any_gen.generate_ids(prompt, max_new_tokens=40, speculation="tree", num_draft_tokens="auto",
                                ignore_eos=True) == base


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fixed_templates_greedy_are_exact(any_gen, prompt):
    from specdec_rt.runtime.loop.tree_step import Template

    base = any_gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
    for tpl in (Template.chain(0), Template.chain(3), Template((-1, 0, 0), (0, 0, 1)),
                Template((-1, 0, 0, 1, 1, 2, 3, 5, 6), (0, 0, 1, 0, 1, 0, 0, 0, 0)),
                Template((-1, 0, 0, 0, 1, 2, 3), (0, 0, 1, 2, 0, 0, 0))):
        out = any_gen.generate_ids(prompt, max_new_tokens=40, speculation="tree", tree_shape=tpl,
                                   ignore_eos=True)
        assert out == base, tpl


def test_policy_forced_to_branch_is_exact_and_branches(tiny_pair):
    """A flat cost model makes the policy grow wide trees: output still equals target-only and
    the cache after the run equals a fresh prefill (compaction of branching paths)."""
    import specdec_rt
    from test_exactness import assert_cache_equals_fresh_prefill

    from specdec_rt.runtime.policies.cost_model import CostModel

    gen = specdec_rt.load(tiny_pair["bundle"], threads=1)
    pol = gen.policies.tree()  # measured once, then kept: override its costs
    pol.cost = CostModel([1.0] * 16, 0.01)
    pol.draft_rows = [0.01] * 8
    pol.second = [0.5] * len(pol.second)
    for prompt in PROMPTS:
        base = gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
        out = gen.generate_ids(prompt, max_new_tokens=40, speculation="tree", num_draft_tokens="auto",
                               ignore_eos=True)
        assert out == base
        assert max(gen.last_stats.draft_lengths) > pol.last.max_depth  # branches were verified
        tokens = prompt + out
        n = gen.target.length
        assert n == len(tokens) - 1
        cached = [gen.target.cache.read(l, 0, n) for l in range(gen.target.info.num_layers)]
        assert_cache_equals_fresh_prefill(gen.target, cached, tokens, n)
    assert any(not t.is_chain for t in pol._templates.values())
