"""drafter="suffix" / "suffix_hybrid": suffix-tree proposals from the request and (opt-in) a pool of
earlier requests; exact (greedy token for token, sampled in distribution), the pool bounded and
isolated per user, the request's own index never carried into the next request."""
from __future__ import annotations

import numpy as np
import pytest

from specdec_rt.runtime.drafters.suffix import SuffixDrafter, SuffixPool, SuffixTrie


def _prompts():
    rng = np.random.default_rng(5)
    motif = rng.integers(1, 320, 6).tolist()
    return [motif * 4 + rng.integers(1, 320, 5).tolist(), rng.integers(1, 320, 12).tolist(),
            (motif + [7]) * 3]


def _row(tokens, user=None, seq=0):
    from specdec_rt.runtime.core.rows import LoopConfig, RowView
    from specdec_rt.runtime.core.sampling import SamplingParams

    cfg = LoopConfig(max_new_tokens=8, params=SamplingParams(0.0, 0, 1.0), user=user)
    return RowView(list(tokens), cfg, np.random.default_rng(0), seq)


# -- the index --------------------------------------------------------------------------------------
def test_trie_counts_matches_and_proposes_by_frequency_then_recency():
    trie = SuffixTrie(depth=6)
    seq = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 1, 2]
    trie.extend(trie.cursor(), seq)
    node, m = trie.find(seq, max_match=5)
    # "4 1 2" occurs only at the end; "1 2" occurred three times before, followed by 3, 3, 4
    assert m == 2 and node.cont == 3 and set(node.children) == {3, 4}
    p = trie.propose(seq, 4, max_match=5, min_prob=0.0, max_spec_factor=10)
    assert p.match == 2 and p.tokens[:3] == [3, 9, 1] and p.probs[0] == pytest.approx(2 / 3)
    assert p.score == pytest.approx(sum(p.probs))
    # a tie in counts goes to the most recent continuation
    tie = SuffixTrie(depth=6)
    seq2 = [1, 2, 3, 1, 2, 4, 1, 2]
    tie.extend(tie.cursor(), seq2)
    p2 = tie.propose(seq2, 1, max_match=5, min_prob=0.0)
    assert p2.tokens == [4] and p2.probs == [pytest.approx(0.5)]
    # min_prob stops the walk once the estimated chance of acceptance falls below it
    assert trie.propose(seq, 4, max_match=5, min_prob=0.7, max_spec_factor=10).tokens == []
    # nothing after a token never seen
    assert trie.propose([5], 3, max_match=5).tokens == []


def test_trie_remove_restores_counts_exactly():
    trie = SuffixTrie(depth=4)
    a, b = [1, 2, 3, 1, 2, 5], [2, 3, 1, 4]
    trie.extend(trie.cursor(), a)
    snapshot = trie.propose([1, 2], 3, max_match=3, min_prob=0.0, max_spec_factor=5)
    trie.extend(trie.cursor(), b)
    trie.remove(b)
    assert trie.propose([1, 2], 3, max_match=3, min_prob=0.0, max_spec_factor=5).tokens == snapshot.tokens
    trie.remove(a)
    assert trie.root.children == {} and trie.root.cont == 0 and trie.tokens == 0


def test_proposal_length_is_capped_by_the_match():
    trie = SuffixTrie()
    seq = list(range(10, 30)) + [10, 11]
    trie.extend(trie.cursor(), seq)
    assert len(trie.propose(seq, 8, max_match=12, max_spec_factor=1.0).tokens) == 2  # a 2-token match
    assert trie.propose(seq, 8, max_match=12, max_spec_factor=3.0).tokens == list(range(12, 18))


# -- the pool --------------------------------------------------------------------------------------
def test_pool_is_bounded_and_evicts_oldest_first():
    pool = SuffixPool(max_tokens=10, per_user=False)
    pool.add(None, [1, 2, 3, 4, 5, 6])
    assert pool.propose(None, [1, 2], 3, max_match=4, min_prob=0.1, max_spec_factor=2).tokens == [3, 4, 5]
    pool.add(None, [7, 8, 9, 10, 11, 12])  # 12 tokens > 10: the first request leaves
    assert pool.tokens == 6
    assert pool.propose(None, [1, 2], 3, max_match=4, min_prob=0.1, max_spec_factor=2).tokens == []
    assert pool.propose(None, [7, 8], 3, max_match=4, min_prob=0.1, max_spec_factor=2).tokens == [9, 10, 11]
    with pytest.raises(Exception, match="max_tokens"):
        SuffixPool(max_tokens=0)


def test_pool_isolates_users():
    pool = SuffixPool(per_user=True)
    secret = [41, 42, 43, 44, 45, 46, 47]
    pool.add("alice", secret)
    pool.add(None, secret)  # no user: no pool at all when users are isolated
    opts = dict(max_match=6, min_prob=0.1, max_spec_factor=3)
    assert pool.propose("alice", [41, 42, 43], 4, **opts).tokens == [44, 45, 46, 47]
    assert pool.propose("bob", [41, 42, 43], 4, **opts).tokens == []
    assert pool.propose(None, [41, 42, 43], 4, **opts).tokens == []
    shared = SuffixPool(per_user=False)
    shared.add("alice", secret)
    assert shared.propose("bob", [41, 42, 43], 4, **opts).tokens == [44, 45, 46, 47]


def test_drafter_feeds_the_pool_at_the_end_and_reads_it_in_the_next_request():
    pool = SuffixPool(per_user=True)
    d = SuffixDrafter(pool)
    prompt, answer = [5, 6, 7], [20, 21, 22, 23, 24, 25, 26, 27]
    d.begin(prompt, 0)
    row = _row(prompt, user="alice")
    d.propose([row], [4])
    from specdec_rt.runtime.core.rows import StepReport

    d.observe(StepReport(0, prompt + answer))
    d.end(0)
    assert pool.tokens == len(answer)  # the output, not the prompt
    d.begin([9, 9], 0)
    props = d.propose([_row([9, 9, 20, 21, 22], user="alice")], [4])
    assert props[0][0] == [23, 24, 25] and d.last[0].source == "pool"  # 3: capped by the 3-token match
    d.begin([9, 9], 1)
    assert d.propose([_row([9, 9, 20, 21, 22], user="bob", seq=1)], [4])[0][0] == []


def test_a_new_request_on_a_reused_sequence_starts_a_fresh_index():
    """llama.cpp's ngram-cache kept a sequence's index across requests (begin() was a no-op) and
    its acceptance fell from 86% to 11% (ggml-org/llama.cpp#27852): here the second request ends
    with an n-gram only the first one had, and nothing is proposed."""
    d = SuffixDrafter(None)
    first = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    d.begin(first, 0)
    assert d.propose([_row(first)], [3])[0][0] == [4, 5, 6]
    d.end(0)
    d.begin([9, 1, 2], 0)
    assert d.propose([_row([9, 1, 2])], [3])[0][0] == []


def test_weak_matches_fall_back_to_the_model_in_the_suffix_hybrid(tiny_gen):
    from specdec_rt.runtime.drafters.base import ModelDrafter
    from specdec_rt.runtime.drafters.hybrid import HybridDrafter

    d = HybridDrafter(ModelDrafter(tiny_gen.draft_engine, tiny_gen.vocab_size),
                      SuffixDrafter(None, min_score=1.0), name="suffix_hybrid")
    strong, weak = _prompts()[2], _prompts()[1]
    d.begin(strong, 0)
    out = d.propose([_row(strong)], [3])
    assert d.lookup_proposals == 1 and len(out[0][0]) >= 1
    d.begin(weak, 0)
    d.propose([_row(weak)], [3])  # nothing repeats: the draft model proposes
    assert d.model_proposals == 1


# -- exactness through the generator ---------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["suffix", "suffix_hybrid"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_suffix_is_target_only(tiny_pair, drafter, k):
    import specdec_rt

    gen = specdec_rt.load(tiny_pair["bundle"], threads=1, suffix_pool=SuffixPool(per_user=False))
    for rep in range(2):  # the second pass proposes from the pool too
        for prompt in _prompts():
            ref = gen.generate_ids(prompt, max_new_tokens=30, drafter=None, ignore_eos=True)
            out = gen.generate_ids(prompt, max_new_tokens=30, drafter=drafter, num_draft_tokens=k, ignore_eos=True)
            assert out == ref
            assert gen.last_stats.drafter == drafter
    assert gen.suffix_pool.added == 6 and gen.last_stats.proposed > 0


def test_suffix_batch_equals_single_runs_and_errors(tiny_pair, tiny_gen):
    import specdec_rt
    from specdec_rt.errors import GenerationInputError

    prompts = _prompts()
    refs = [tiny_gen.generate_ids(p, max_new_tokens=20, drafter=None, ignore_eos=True) for p in prompts]
    for drafter in ("suffix", "suffix_hybrid"):
        results = tiny_gen.generate_batch([{"prompt": p, "user": f"u{i}"} for i, p in enumerate(prompts)],
                                          max_new_tokens=20, drafter=drafter, num_draft_tokens="auto",
                                          ignore_eos=True)
        assert [r.token_ids for r in results] == refs
    with pytest.raises(GenerationInputError, match="overlap"):
        tiny_gen.generate_ids(prompts[0], max_new_tokens=4, drafter="suffix", overlap=True)
    with pytest.raises(GenerationInputError, match="user"):
        tiny_gen.generate(prompts[0], max_new_tokens=4, drafter="suffix", user=3)
    with pytest.raises(GenerationInputError, match="suffix_pool"):
        specdec_rt.load(tiny_pair["bundle"], threads=1, suffix_pool="yes")
    # a generator that overlaps by default runs the suffix drafters sequentially (nothing to
    # draft ahead of), exactly
    gen = specdec_rt.load(tiny_pair["bundle"], threads=1, overlap=True)
    assert gen.generate_ids(prompts[0], max_new_tokens=20, drafter="suffix", ignore_eos=True) == refs[0]
    assert not gen.last_stats.overlap


def test_sampled_suffix_with_a_pool_follows_the_target(tiny_vocab_pair):
    """Proposals from the request and from earlier samples (a shared pool): the tokens still follow
    the target's law, chi-square tested against the exact joint of tokens 1-3."""
    import specdec_rt
    from test_sampling import assert_follows_joint, exact_joint, sampled_counts

    gen = specdec_rt.load(tiny_vocab_pair["bundle"], threads=1, suffix_pool=SuffixPool(2000, per_user=False))
    joint = exact_joint(tiny_vocab_pair["target"], 1.0, 0, 1.0)
    counts, proposed, rejected = sampled_counts(gen, joint.shape, temperature=1.0, top_k=0, top_p=1.0,
                                                drafter="suffix", num_draft_tokens=2)
    assert_follows_joint(counts, joint, proposed, rejected)


def test_goodput_cuts_each_proposal_where_its_tokens_per_second_peak():
    """"auto" for the suffix drafter: a sure proposal runs long where verification is cheap, a
    doubtful one is cut (or dropped) where verification is steep, and a drafter whose estimates
    ran ahead of what was accepted is trusted less."""
    from specdec_rt.runtime.drafters.suffix import SuffixGoodput
    from specdec_rt.runtime.policies.adaptive import AdaptivePolicy
    from specdec_rt.runtime.policies.cost_model import CostModel

    flat = SuffixGoodput(AdaptivePolicy(CostModel([1.0 + 0.05 * s for s in range(16)], 0.0)))
    steep = SuffixGoodput(AdaptivePolicy(CostModel([0.5 + 0.5 * (s + 1) for s in range(16)], 0.0)))
    sure, doubtful = [1.0] * 10, [0.6, 0.3, 0.15, 0.08]
    assert flat.length(sure, 1) == 10
    assert 1 <= flat.length(doubtful, 1) < 4
    assert steep.length([0.3, 0.1], 1) == 0  # each token costs half a step: a doubtful one does not pay
    assert steep.length(sure, 1) == 10  # ... a sure one does
    for _ in range(40):
        flat.learn(10.0, 1)  # predicted 10 accepted tokens, got 1
    assert flat.calibration < 0.2 and flat.length(doubtful, 1) < 2
    assert flat.choose(1) in (0, flat.policy.k_max)
