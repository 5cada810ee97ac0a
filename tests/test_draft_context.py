"""The draft's bounded catch-up (load(draft_context=N)): a long prompt or a long stretch without
drafting restarts the draft on its last N tokens; proposals change, the output never does."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def gens(tiny_pair):
    import specdec_rt

    return {n: specdec_rt.load(tiny_pair["bundle"], threads=1, draft_context=n) for n in (None, 8)}


def test_output_identical_with_a_cut_draft_history(gens):
    rng = np.random.default_rng(1)
    full, cut = gens[None], gens[8]
    for n in range(3):
        prompt = rng.integers(1, 320, 40).tolist()  # longer than the draft's 8-token context
        ref = full.generate_ids(prompt, max_new_tokens=30, drafter=None, ignore_eos=True)
        for kw in (dict(num_draft_tokens=3), dict(num_draft_tokens="auto"), dict(num_draft_tokens=5, speculation="tree"),
                   dict(num_draft_tokens="auto", speculation="tree")):
            assert cut.generate_ids(prompt, max_new_tokens=30, ignore_eos=True, **kw) == ref, kw
            assert full.generate_ids(prompt, max_new_tokens=30, ignore_eos=True, **kw) == ref, kw


def test_the_draft_runs_at_most_its_context_to_catch_up(gens, tiny_pair):
    """The first proposal after a 40-token prompt runs 8 tokens through the draft, not 40; later
    proposals continue from there (the draft's cache holds its own positions)."""
    from specdec_rt.runtime.drafters.base import ModelDrafter

    gen = gens[8]
    d = ModelDrafter(gen.draft_engine, gen.vocab_size, context=8)
    d.begin([], 0)
    tokens = list(range(1, 41))
    assert d.unseen(tokens) == tokens[-8:]
    d.advance(tokens[-8:])
    assert gen.draft_engine.length == 8
    assert d.unseen(tokens + [41, 42]) == [41, 42]  # a short gap: caught up, not restarted
    d.advance([41, 42])
    d.rollback_to(tokens + [41, 99])  # the target rejected 42: roll back one position
    assert gen.draft_engine.length == 9 and d.unseen(tokens + [41, 99]) == [99]
    gen.draft_engine.reset()


def test_bad_draft_context(tiny_pair):
    import specdec_rt
    from specdec_rt.errors import GenerationInputError

    for bad in (0, "256", True):
        with pytest.raises(GenerationInputError, match="draft_context"):
            specdec_rt.load(tiny_pair["bundle"], threads=1, draft_context=bad)


def test_a_draft_re_entering_after_a_stretch_without_it_resyncs_on_a_short_window(gens):
    """After tokens decoded without drafting ("auto" at K = 0, the hybrid on lookup) the draft
    restarts on its last ``resync`` tokens, not ``context``: a probe must be cheap. The first
    proposal of a sequence still gets ``context``; both count as a long catch-up (the policies
    do not learn step costs from them)."""
    from specdec_rt.runtime.core.sampling import SamplingParams
    from specdec_rt.runtime.core.stats import GenerationStats
    from specdec_rt.runtime.drafters.base import ModelDrafter
    from specdec_rt.runtime.loop.speculative import LoopConfig, Row

    gen = gens[None]
    d = ModelDrafter(gen.draft_engine, gen.vocab_size, context=16, resync=4)
    assert d.resync == 4
    prompt = list(range(1, 31))
    d.begin(prompt, 0)
    assert d.unseen(prompt + [31]) == (prompt + [31])[-16:]  # drafting starts with the sequence
    d.begin(prompt, 0)
    later = prompt + list(range(31, 41))  # 10 tokens decoded without the draft
    assert d.unseen(later) == later[-4:]
    d.advance(later[-4:])
    assert d.unseen(later + [41, 42]) == [41, 42]  # short gaps are caught up as before
    assert d.unseen(later + list(range(41, 61))) == list(range(57, 61))  # a long one resyncs
    cfg = LoopConfig(max_new_tokens=8, params=SamplingParams(temperature=0.0))
    row = Row(prompt, cfg, np.random.default_rng(0), GenerationStats(), seq=0)
    d.begin(prompt, 0)
    row.tokens = later
    d.propose([row], [1])
    assert d.report.long_catch_up  # fresh + a long gap
    row.tokens = later + [99]
    d.rollback_to(row.tokens[:-1], 0)
    d.propose([row], [1])
    assert not d.report.long_catch_up  # one or two tokens: a normal drafting step
    assert ModelDrafter(gen.draft_engine, gen.vocab_size, context=None).resync is None
    gen.draft_engine.reset()
