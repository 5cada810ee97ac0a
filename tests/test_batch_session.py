"""The public BatchSession (issue 20): prepare rows from requests, add them, step them together,
cancel one; every finished row equals what the same request gives alone, and the request layer
refuses bad input where it enters."""
from __future__ import annotations

import pytest

from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.loop.batch_session import BatchSession
from specdec_rt.runtime.loop.requests import RowRequest, SpeculationConfig

PROMPTS = [[5, 17, 42, 99, 3], [200, 201, 202, 7, 7, 7, 9, 310], list(range(1, 13)), [77, 78]]


@pytest.mark.parametrize("k", [3, "auto"])
def test_session_steps_rows_to_their_solo_outputs_and_cancels_one(tiny_gen, k):
    solo = [tiny_gen.generate_ids(p, max_new_tokens=20, num_draft_tokens=3, ignore_eos=True) for p in PROMPTS]
    session = BatchSession(tiny_gen, SpeculationConfig(num_draft_tokens=k), max_rows=2)
    rows = [session.prepare(RowRequest(p, max_new_tokens=20, ignore_eos=True), i) for i, p in enumerate(PROMPTS)]
    waiting = list(rows)
    finished = set()
    steps = 0
    while waiting or session.active:
        while waiting and session.has_room:
            first = session.add(waiting.pop(0))
            assert first.tokens and not first.finished
        assert session.active <= 2
        for update in session.step():
            if update.finished:
                finished.add(update.index)
        steps += 1
        if steps == 2 and 1 in session.rows:
            session.cancel(1)  # mid-way: only row 1 ends, the others go on unchanged
            finished.add(1)
        session.loop.release()
    assert finished == {0, 1, 2, 3}
    for i, srow in enumerate(rows):
        res = srow.result
        if i == 1:
            assert res.finish_reason == "cancelled"
            assert res.token_ids == solo[1][: len(res.token_ids)] and len(res.token_ids) < 20
        else:
            assert res.token_ids == solo[i] and res.finish_reason == "length"


def test_session_run_drives_a_row_source(tiny_gen):
    session = BatchSession(tiny_gen, SpeculationConfig(num_draft_tokens=2, drafter="prompt_lookup"), max_rows=3)
    rows = [session.prepare(RowRequest(p, max_new_tokens=12, ignore_eos=True), i) for i, p in enumerate(PROMPTS)]
    done = [u.index for u in session.run(rows) if u.finished]
    assert sorted(done) == [0, 1, 2, 3]
    for p, srow in zip(PROMPTS, rows):
        assert srow.result.token_ids == tiny_gen.generate_ids(p, max_new_tokens=12, drafter="prompt_lookup",
                                                              num_draft_tokens=2, ignore_eos=True)
    assert session.stats.new_tokens == 4 * 12


def test_request_layer_refuses_bad_settings_where_they_enter(tiny_gen):
    for bad, match in ((dict(num_draft_tokens=65), "num_draft_tokens"), (dict(num_draft_tokens="4"), "num_draft_tokens"),
                       (dict(drafter="medusa"), "unknown drafter"), (dict(speculation="beam"), "speculation"),
                       (dict(overlap="yes"), "overlap"), (dict(overlap=True, speculation="tree"), "overlap"),
                       (dict(overlap=True, drafter="hybrid"), "hybrid")):
        with pytest.raises(GenerationInputError, match=match):
            SpeculationConfig(**bad)
    assert SpeculationConfig(drafter="none").drafter is None
    session = BatchSession(tiny_gen, SpeculationConfig(), max_rows=1)
    with pytest.raises(GenerationInputError, match="max_new_tokens"):
        session.prepare(RowRequest([1, 2, 3], max_new_tokens=0), 0)
    with pytest.raises(GenerationInputError, match="empty"):
        session.prepare(RowRequest(""), 0)
