"""drafter="hybrid": prompt lookup where its n-gram matches, the draft model elsewhere; exact
(greedy token for token, sampled in distribution), both sources used, each learning apart."""
from __future__ import annotations

import numpy as np
import pytest



def _prompts():
    rng = np.random.default_rng(5)
    motif = rng.integers(1, 320, 6).tolist()
    return [motif * 4 + rng.integers(1, 320, 5).tolist(), rng.integers(1, 320, 12).tolist(),
            (motif + [7]) * 3]


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_hybrid_is_target_only_and_uses_both_sources(tiny_gen, k):
    for prompt in _prompts():
        ref = tiny_gen.generate_ids(prompt, max_new_tokens=30, drafter=None, ignore_eos=True)
        out = tiny_gen.generate_ids(prompt, max_new_tokens=30, drafter="hybrid", num_draft_tokens=k, ignore_eos=True)
        assert out == ref
        assert tiny_gen.last_stats.drafter == "hybrid"
    from specdec_rt.runtime.drafters.base import ModelDrafter
    from specdec_rt.runtime.drafters.hybrid import HybridDrafter

    d = HybridDrafter(ModelDrafter(tiny_gen.draft_engine, tiny_gen.vocab_size))  # counts its sources
    from specdec_rt.runtime.core.sampling import SamplingParams
    from specdec_rt.runtime.loop.speculative import LoopConfig, Row

    cfg = LoopConfig(max_new_tokens=8, params=SamplingParams(0.0, 0, 1.0))
    rows = [Row(p, cfg, np.random.default_rng(0), None) for p in (_prompts()[2], _prompts()[1])]
    for r in rows:
        r.tokens = list(r.prompt)
        r.seq = 0
    d.begin(rows[0].tokens)
    props = d.propose(rows[:1], [3])  # the repeated motif: lookup proposes
    assert d.lookup_proposals == 1 and len(props[0][0]) == 3 and props[0][1] is None
    d.begin(rows[1].tokens)
    d.propose(rows[1:], [3])  # no earlier occurrence of its last token: the draft model proposes
    assert d.model_proposals == 1


def test_hybrid_policy_routes_outcomes_to_their_source(tiny_gen):
    tiny_gen.generate_ids(_prompts()[0], max_new_tokens=40, drafter="hybrid", num_draft_tokens="auto",
                          ignore_eos=True)
    policies = tiny_gen.policies.chains
    lookup, model = policies[("hybrid:prompt_lookup", False)], policies[("hybrid:model", False)]
    assert lookup.cost.draft_step == 0.0 and model.cost.draft_step > 0.0  # lookup drafts for free
    assert lookup.accept[0] != lookup.prior  # lookup's outcomes reached lookup's estimates


def test_hybrid_batch_and_errors(tiny_pair, tiny_gen):
    import specdec_rt
    from specdec_rt.errors import GenerationInputError

    prompts = _prompts()
    refs = [tiny_gen.generate_ids(p, max_new_tokens=20, drafter=None, ignore_eos=True) for p in prompts]
    results = tiny_gen.generate_batch([{"prompt": p} for p in prompts], max_new_tokens=20, drafter="hybrid",
                                      num_draft_tokens="auto", ignore_eos=True)
    assert [r.token_ids for r in results] == refs
    with pytest.raises(GenerationInputError, match="overlap"):
        tiny_gen.generate_ids(prompts[0], max_new_tokens=4, drafter="hybrid", overlap=True)
    target_only = tiny_pair["bundle"].parent / "target_only"
    if not target_only.exists():
        from specdec_rt.export.pipeline import ExportOptions, export_pair

        export_pair(tiny_pair["target"], None, target_only, ExportOptions(progress=False, validate=False))
    with pytest.raises(GenerationInputError, match="no draft model"):
        specdec_rt.load(target_only, threads=1).generate_ids(prompts[0], max_new_tokens=4, drafter="hybrid")


def test_sampled_hybrid_follows_the_target(tiny_vocab_pair):
    import specdec_rt
    from test_sampling import assert_follows_joint, exact_joint, sampled_counts

    gen = specdec_rt.load(tiny_vocab_pair["bundle"], threads=1)
    joint = exact_joint(tiny_vocab_pair["target"], 1.0, 0, 1.0)
    counts, proposed, rejected = sampled_counts(gen, joint.shape, temperature=1.0, top_k=0, top_p=1.0,
                                                drafter="hybrid", num_draft_tokens=2)
    assert_follows_joint(counts, joint, proposed, rejected)
