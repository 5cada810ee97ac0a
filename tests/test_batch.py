"""Batched speculative decoding: every row is exactly what it would be alone.

Rows at different lengths share each target (and draft) call; a row's logits must be bit for bit
what it gets alone (engine level), so greedy rows equal their single-sequence output token for
token, sampled rows draw for draw with the same seed (fixed K) and follow the target's
distribution (chi-square, as tests/test_sampling.py), and one row's stop, error or cancellation
changes nothing in another row.
"""
from __future__ import annotations

import numpy as np
import pytest

import specdec_rt
from specdec_rt.runtime.api.generator import GenerationInputError
from specdec_rt.runtime.core.masks import causal_mask

# different lengths, so rows sit at different cache positions throughout
PROMPTS = [[5, 17, 42, 99, 3], [200, 201, 202, 7, 7, 7, 9, 310], list(range(1, 13)), [77, 78],
           [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [150] * 7]


def _solo(gen, prompt, **kw):
    return gen.generate_ids(prompt, **kw)


# -- engine: bits ----------------------------------------------------------------------------
def test_forward_rows_equals_each_sequence_alone_bit_for_bit(tiny_gen):
    eng = tiny_gen.target
    rng = np.random.default_rng(0)
    lengths, widths = [4, 11, 7, 1, 20], [1, 5, 3, 2, 4]
    seqs = [0, 3, 1, 5, 2]  # not in order, not contiguous
    prompts = [rng.integers(1, 300, p + s) for p, s in zip(lengths, widths)]
    eng.reset()
    args, alone = [], []
    for q, toks, p, s in zip(seqs, prompts, lengths, widths):
        eng.extend(toks[:p], seq=q)
        pos = np.arange(p, p + s)
        args.append((toks[p:], pos, causal_mask(p, pos)))
        alone.append((eng.forward(*args[-1], seq=q).copy(), eng.cache.read(1, p, p + s, q)))
    for order, given in ((list(range(5)), True), ([4, 2, 0], False), ([1, 3], True), ([3, 0, 1, 2, 4], False)):
        ids, positions, masks = map(list, zip(*[args[i] for i in order]))
        # given masks, or the engine's own causal masks (the loop's path)
        rows = eng.forward_rows([seqs[i] for i in order], ids, positions if given else None,
                                masks if given else None)
        for i, row in zip(order, rows):
            assert np.array_equal(row, alone[i][0])
            k, v = eng.cache.read(1, lengths[i], lengths[i] + widths[i], seqs[i])
            assert np.array_equal(k, alone[i][1][0]) and np.array_equal(v, alone[i][1][1])
    eng.reset()


def test_load_probes_batch_invariance_and_falls_back_when_it_fails(tiny_pair, monkeypatch):
    from specdec_rt.runtime.engines import ort as engine_mod

    gen = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=4)
    assert gen.target.batch_calls  # measured: batched rows are bit-identical here
    # a backend whose batched rows differ is detected, and batches fall back to one-sequence calls
    real = engine_mod.OrtEngine._forward_batch

    def perturbed(self, *a):
        return [r + np.float32(1e-3) for r in real(self, *a)]

    monkeypatch.setattr(engine_mod.OrtEngine, "_forward_batch", perturbed)
    with pytest.warns(engine_mod.RowInvarianceWarning, match="batched decoding runs one sequence per call"):
        bad = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=4)
    assert not bad.target.batch_calls
    base = [_solo(bad, p, max_new_tokens=20, drafter=None, ignore_eos=True) for p in PROMPTS[:3]]
    out = bad.generate_batch(PROMPTS[:3], max_new_tokens=20, ignore_eos=True)
    assert [r.token_ids for r in out] == base


def test_sliding_window_batches_match_single_sequences(tmp_path):
    """Mistral with a window shorter than the generation: batched rows get the window too."""
    from helpers import windowed_mistral_bundle

    _ckpt, bundle = windowed_mistral_bundle(tmp_path)
    gen = specdec_rt.load(bundle, threads=1, max_batch=4)
    base = [_solo(gen, p, max_new_tokens=24, drafter=None, ignore_eos=True) for p in PROMPTS[:5]]
    for k in (0, 3):
        out = gen.generate_batch(PROMPTS[:5], max_new_tokens=24, batch_size=4, num_draft_tokens=k,
                                 drafter="model" if k else None, ignore_eos=True)
        assert [r.token_ids for r in out] == base


# -- greedy: token for token ----------------------------------------------------------------
@pytest.mark.parametrize("drafter, k", [("model", 1), ("model", 3), ("model", "auto"), (None, 0),
                                        ("prompt_lookup", 3)])
def test_greedy_rows_equal_single_sequence_output(any_gen, drafter, k):
    base = [_solo(any_gen, p, max_new_tokens=30, drafter=None, ignore_eos=True) for p in PROMPTS]
    # batch_size 3 < 6 prompts: rows join as others leave (continuous batching)
    out = any_gen.generate_batch(PROMPTS, max_new_tokens=30, batch_size=3, drafter=drafter,
                                 num_draft_tokens=k, ignore_eos=True)
    assert [r.token_ids for r in out] == base
    stats = any_gen.last_batch_stats
    assert stats.mean_width > 1.5 and stats.new_tokens == 30 * len(PROMPTS)
    if drafter == "model" and k != "auto":
        assert all(r.stats.proposed > 0 for r in out)


def test_rows_leave_at_different_times_and_slots_are_reused(tiny_gen, monkeypatch):
    """Per-row max_new_tokens: short rows leave early and waiting prompts take their cache
    sequence; each prompt is prefilled exactly once (nobody else's prefill is re-run)."""
    budgets = [3, 25, 8, 1, 17, 12]
    base = [_solo(tiny_gen, p, max_new_tokens=n, ignore_eos=True) for p, n in zip(PROMPTS, budgets)]
    prefills = []
    real = tiny_gen.target.extend

    def counting(tokens, chunk=256, seq=0):
        prefills.append((len(tokens), seq))
        return real(tokens, chunk, seq)

    monkeypatch.setattr(tiny_gen.target, "extend", counting)
    monkeypatch.setattr(tiny_gen.target, "prefix_reuse", False)  # whole prompts (the solo runs are cached)
    rows = [{"prompt": p, "max_new_tokens": n} for p, n in zip(PROMPTS, budgets)]
    out = tiny_gen.generate_batch(rows, batch_size=2, num_draft_tokens=3, ignore_eos=True)
    assert [r.token_ids for r in out] == base
    assert sorted(n for n, _ in prefills) == sorted(len(p) for p in PROMPTS)  # one prefill each
    assert {q for _, q in prefills} == {0, 1}  # two sequences, reused
    assert [r.finish_reason for r in out] == ["length"] * len(PROMPTS)


def test_cache_of_every_row_equals_fresh_prefill(tiny_pair):
    """Per-row rollback: after many accept/reject rounds each sequence's committed K/V equals a
    fresh prefill of its tokens."""
    gen = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=4)
    prompts = PROMPTS[:4]
    out = gen.generate_batch(prompts, max_new_tokens=40, num_draft_tokens=4, ignore_eos=True)
    assert 0 < sum(r.stats.accepted for r in out) < sum(r.stats.proposed for r in out)
    eng = gen.target
    cached = []
    for seq, (p, r) in enumerate(zip(prompts, out)):  # admitted in order: row i on sequence i
        tokens = p + r.token_ids
        assert eng.lengths[seq] == len(tokens) - 1
        cached.append((tokens, [eng.cache.read(l, 0, len(tokens) - 1, seq) for l in range(eng.info.num_layers)]))
    for tokens, kv in cached:
        eng.reset()
        eng.extend(tokens[:-1])
        for layer, (k, v) in enumerate(kv):
            fk, fv = eng.cache.read(layer, 0, len(tokens) - 1)
            np.testing.assert_allclose(k, fk, atol=1e-5)
            np.testing.assert_allclose(v, fv, atol=1e-5)


# -- sampling ---------------------------------------------------------------------------------
def test_mixed_greedy_and_sampled_rows_equal_their_single_runs(tiny_gen):
    """With a fixed K each row draws from its own generator in the same order as alone: sampled
    rows are draw for draw their single-sequence output with the same seed."""
    rows = [
        {"prompt": PROMPTS[0], "temperature": 0.9, "seed": 1},
        {"prompt": PROMPTS[1]},
        {"prompt": PROMPTS[2], "temperature": 1.2, "top_k": 20, "seed": 2},
        {"prompt": PROMPTS[3], "temperature": 0.7, "top_p": 0.8, "seed": 3},
        {"prompt": PROMPTS[4]},
    ]
    for drafter in ("model", "prompt_lookup"):
        base = []
        for r in rows:
            kw = {k: v for k, v in r.items() if k != "prompt"}
            base.append(_solo(tiny_gen, r["prompt"], max_new_tokens=24, drafter=drafter, num_draft_tokens=3,
                              ignore_eos=True, **kw))
        out = tiny_gen.generate_batch(rows, max_new_tokens=24, batch_size=3, drafter=drafter,
                                      num_draft_tokens=3, ignore_eos=True)
        assert [r.token_ids for r in out] == base


@pytest.mark.parametrize("drafter, k, speculation", [("model", 2, "chain"), ("prompt_lookup", 2, "chain"),
                                                     ("model", 4, "tree")])
def test_sampled_rows_in_batches_follow_target_distribution(tiny_vocab_pair, drafter, k, speculation):
    """tests/test_sampling.py's chi-square test with every run a row of a batch of 8, next to
    greedy rows (which must stay target-only greedy); chains, and trees (each row its own tree,
    draws and acceptance)."""
    from test_sampling import N_RUNS, PROMPT, assert_follows_joint, exact_joint

    gen = specdec_rt.load(tiny_vocab_pair["bundle"], threads=1)
    joint = exact_joint(tiny_vocab_pair["target"], 1.0, 0, 1.0)
    greedy = _solo(gen, PROMPT, max_new_tokens=4, drafter=None, ignore_eos=True)
    rows = []
    for seed in range(N_RUNS):
        rows.append({"prompt": PROMPT, "temperature": 1.0, "seed": seed})
        if seed % 4 == 0:
            rows.append({"prompt": PROMPT, "temperature": 0.0})
    out = gen.generate_batch(rows, max_new_tokens=4, batch_size=8, drafter=drafter, num_draft_tokens=k,
                             top_k=0, top_p=1.0, ignore_eos=True, speculation=speculation)
    assert gen.last_batch_stats.mean_width > 7
    counts = np.zeros_like(joint)
    proposed = rejected = 0
    for row, res in zip(rows, out):
        if row["temperature"] == 0.0:
            assert res.token_ids == greedy
            continue
        a, b, c = res.token_ids[:3]
        counts[a, b, c] += 1
        proposed += res.stats.proposed
        rejected += res.stats.proposed - res.stats.accepted
    assert_follows_joint(counts, joint, proposed, rejected)


# -- isolation: stop, error, cancellation --------------------------------------------------------
def test_stop_error_and_cancel_change_no_other_row(tiny_gen):
    first = tiny_gen.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True)
    stop = first.text[4:8]
    stopped_alone = tiny_gen.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True, stop=[stop])
    assert stopped_alone.finish_reason == "stop"
    others = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[5]]
    base = [_solo(tiny_gen, p, max_new_tokens=24, ignore_eos=True) for p in others]
    too_long = [7] * (tiny_gen.max_length + 5)
    rows = [others[0], {"prompt": PROMPTS[1], "stop": [stop]}, too_long, others[1],
            {"prompt": PROMPTS[3], "temperature": -1}, others[2], PROMPTS[0], others[3]]
    run = tiny_gen.stream_batch(rows, max_new_tokens=24, batch_size=3, ignore_eos=True)
    cancelled_at = None
    for index, _piece in run:
        if index == 6 and cancelled_at is None:  # cancel a running row after its first text
            cancelled_at = len(run.results[6].token_ids)
            run.cancel(6)
    res = run.results
    assert [res[i].token_ids for i in (0, 3, 5, 7)] == base
    assert res[1].finish_reason == "stop" and res[1].text == stopped_alone.text
    assert res[1].token_ids == stopped_alone.token_ids
    assert res[2].finish_reason == "error" and "context" in res[2].error and not res[2].token_ids
    assert res[4].finish_reason == "error" and "temperature" in res[4].error
    assert res[6].finish_reason == "cancelled" and len(res[6].token_ids) == cancelled_at < 24
    assert run.stats.errors == 2


def test_cancel_before_start_never_runs(tiny_gen):
    run = tiny_gen.stream_batch(PROMPTS[:4], max_new_tokens=10, batch_size=1, ignore_eos=True)
    run.cancel(3)
    events = list(run)
    assert all(i != 3 for i, _ in events)
    assert run.results[3].finish_reason == "cancelled" and run.results[3].token_ids == []
    assert all(r.finish_reason == "length" for r in run.results[:3])


# -- bad input ------------------------------------------------------------------------------------
def test_batch_bad_input(tiny_gen):
    with pytest.raises(GenerationInputError, match="empty"):
        tiny_gen.generate_batch([])
    with pytest.raises(GenerationInputError, match="list of prompts"):
        tiny_gen.generate_batch("one prompt")
    with pytest.raises(GenerationInputError, match="exceeds this generator's maximum of 8"):
        tiny_gen.generate_batch(PROMPTS, batch_size=9)
    with pytest.raises(GenerationInputError, match="batch_size"):
        tiny_gen.generate_batch(PROMPTS, batch_size=0)
    with pytest.raises(GenerationInputError, match="num_draft_tokens"):
        tiny_gen.generate_batch(PROMPTS, num_draft_tokens=-1)
    res = tiny_gen.generate_batch(["", {"prompt": [1, 2], "colour": 1}, "x = 1"], max_new_tokens=4)
    assert [r.finish_reason for r in res[:2]] == ["error", "error"]
    assert "empty" in res[0].error and "colour" in res[1].error
    assert len(res[2].token_ids) >= 1 and res[2].error is None


def test_max_batch_on_load(tiny_pair):
    gen = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=2)
    assert gen.max_batch == 2 and gen.target.cache.keys[0].shape[0] == 2
    with pytest.raises(GenerationInputError, match="maximum of 2 sequences"):
        gen.generate_batch(PROMPTS, batch_size=3)
    # default batch size: all prompts, at most max_batch
    gen.generate_batch(PROMPTS, max_new_tokens=3)
    assert gen.last_batch_stats.max_rows == 2
    with pytest.raises(GenerationInputError, match="max_batch"):
        specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=0)


# -- adaptive K per batch width -------------------------------------------------------------------
def test_policy_prefers_shorter_drafts_for_wide_batches():
    """Once verification cost grows with B x S, the same acceptance estimates give a shorter K for
    a wide batch than for one sequence."""
    from specdec_rt.runtime.policies.adaptive import AdaptivePolicy
    from specdec_rt.runtime.policies.cost_model import CostModel

    one = [1.0 + 0.03 * s for s in range(16)]  # one sequence: weight-bound, extra rows cheap
    eight = [2.0 + 0.8 * s for s in range(16)]  # eight sequences: compute-bound
    cost = CostModel(one, 0.05, {8: (eight, 0.1)})
    policy = AdaptivePolicy(cost, accept=[0.8] * 12)
    assert policy.best_k(1) >= 6
    assert 1 <= policy.best_k(8) <= 3
    assert policy.best_k(8) < policy.best_k(4) <= policy.best_k(1)  # 4: interpolated


def test_auto_measures_the_batch_surface_and_chooses_k_per_step(tiny_pair):
    gen = specdec_rt.load(tiny_pair["bundle"], threads=1, max_batch=4)
    base = [_solo(gen, p, max_new_tokens=20, drafter=None, ignore_eos=True) for p in PROMPTS[:4]]
    out = gen.generate_batch(PROMPTS[:4], max_new_tokens=20, num_draft_tokens="auto", ignore_eos=True)
    assert [r.token_ids for r in out] == base
    assert sorted(gen.policies.cost_model.widths) == [2, 4]
    assert len(gen.last_batch_stats.ks) == gen.last_batch_stats.steps


# -- command line ---------------------------------------------------------------------------------
def test_run_cli_batch_file(tiny_gen, tiny_pair, tmp_path, capsys):
    import json

    from specdec_rt.cli.run_cli import main

    lines = [{"prompt": "def add(a, b):"}, {"prompt": "x = 1", "max_new_tokens": 3},
             {"prompt": ""}, {"prompt": "import os", "temperature": 0.8, "seed": 3}]
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rc = main(["--bundle", str(tiny_pair["bundle"]), "--batch-file", str(batch), "--max-new-tokens", "6",
               "--batch-size", "2", "--ignore-eos", "-k", "3"])  # seeded sampling: same K on both sides
    cap = capsys.readouterr()
    assert rc == 1  # one row failed; the others are printed
    out = [json.loads(line) for line in cap.out.splitlines()]
    assert [o["index"] for o in out] == [0, 1, 2, 3]
    assert out[0]["token_ids"] == tiny_gen.generate("def add(a, b):", max_new_tokens=6, ignore_eos=True,
                                                     num_draft_tokens=3).token_ids
    assert len(out[1]["token_ids"]) == 3
    assert out[2]["finish_reason"] == "error" and "empty" in out[2]["error"]
    assert out[3]["token_ids"] == tiny_gen.generate("import os", max_new_tokens=6, ignore_eos=True,
                                                     temperature=0.8, seed=3, num_draft_tokens=3).token_ids
    assert "tok/s" in cap.err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["--bundle", str(tiny_pair["bundle"]), "--batch-file", str(bad)]) == 1
    assert "line 1" in capsys.readouterr().err


# -- trees in batches ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [6, "auto"])
def test_tree_batches_equal_single_trees_and_target_only(tiny_gen, k):
    """speculation="tree" in generate_batch: every row drafts its own tree on its own draft
    sequence, all rows verify in one target call (per-row tree masks), and each row's greedy
    output is target-only's; rows join and leave (batch of 3, 6 prompts)."""
    from specdec_rt.runtime.loop.tree_step import TreeShape

    prompts = PROMPTS[:6]
    base = [_solo(tiny_gen, p, max_new_tokens=20, drafter=None, ignore_eos=True) for p in prompts]
    out = tiny_gen.generate_batch(prompts, max_new_tokens=20, batch_size=3, speculation="tree",
                                  num_draft_tokens=k, ignore_eos=True)
    assert [r.token_ids for r in out] == base
    assert all(r.stats.speculation == "tree" for r in out) and sum(r.stats.proposed for r in out) > 0
    assert tiny_gen.last_batch_stats.mean_width > 1
    shaped = tiny_gen.generate_batch(prompts[:3], max_new_tokens=20, speculation="tree",
                                     tree_shape=TreeShape(budget=5, depth=3, width=2), ignore_eos=True)
    assert [r.token_ids for r in shaped] == base[:3]
    with pytest.raises(GenerationInputError, match="drafter='model'"):
        tiny_gen.generate_batch(prompts[:2], speculation="tree", drafter="prompt_lookup")

