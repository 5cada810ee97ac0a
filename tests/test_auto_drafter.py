"""``drafter="auto"``, the default of the Python API, ``specdec-run`` and the server: what it
resolves to (PolicyStore.auto_drafter, from the measured cost model), that the choice is visible
in the stats, and that the default call stays token for token target-only greedy."""
from __future__ import annotations

import json

import pytest

import specdec_rt
from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.policies.cost_model import CostModel

PROMPTS = [[5, 17, 42, 99, 3, 5, 17, 42], [200, 201, 202, 7, 7, 7, 9, 310], list(range(1, 13))]


def with_draft_cost(gen, share: float) -> None:
    """A cost model with a one-token target step of 1 and a drafted token of ``share`` of it."""
    gen.policies.cost_model = CostModel([1.0 + 0.05 * s for s in range(16)], share)


@pytest.fixture()
def fresh_gen(tiny_pair):
    return specdec_rt.load(tiny_pair["bundle"], threads=1)


def test_default_call_is_auto_and_says_what_ran(fresh_gen):
    with_draft_cost(fresh_gen, 0.05)  # as cheap as the reference pair's draft: the model alone
    out = fresh_gen.generate(PROMPTS[0], max_new_tokens=12, temperature=0)
    assert out.stats.drafter_requested == "auto" and out.stats.drafter == "model"
    with_draft_cost(fresh_gen, 0.25)  # dearer: suffix proposals where sure, the model elsewhere
    out = fresh_gen.generate(PROMPTS[0], max_new_tokens=12, temperature=0)
    assert out.stats.drafter_requested == "auto" and out.stats.drafter == "suffix_hybrid"
    with_draft_cost(fresh_gen, 0.45)  # as dear as Qwen2.5-Coder-0.5B beside the 1.5B int4: suffix alone
    out = fresh_gen.generate(PROMPTS[0], max_new_tokens=12, temperature=0)
    assert out.stats.drafter_requested == "auto" and out.stats.drafter == "suffix"
    named = fresh_gen.generate(PROMPTS[0], max_new_tokens=12, temperature=0, drafter="prompt_lookup")
    assert named.stats.drafter_requested == named.stats.drafter == "prompt_lookup"  # naming one still works
    plain = fresh_gen.generate(PROMPTS[0], max_new_tokens=12, temperature=0, drafter=None)
    assert plain.stats.drafter is None and plain.stats.drafter_requested is None


def test_auto_for_trees_batches_and_overlap_takes_a_model(fresh_gen):
    with_draft_cost(fresh_gen, 0.25)
    tree = fresh_gen.generate(PROMPTS[1], max_new_tokens=8, temperature=0, speculation="tree", num_draft_tokens=4)
    assert tree.stats.drafter == "model"  # trees need a model (or a head)
    over = fresh_gen.generate(PROMPTS[1], max_new_tokens=8, temperature=0, overlap=True, num_draft_tokens=2)
    assert over.stats.drafter == "model" and over.stats.overlap  # only the model drafts ahead
    rows = fresh_gen.generate_batch(PROMPTS, max_new_tokens=8, temperature=0)
    assert {r.stats.drafter for r in rows} == {"suffix_hybrid"}
    assert {r.stats.drafter_requested for r in rows} == {"auto"}


def test_auto_without_a_draft_model_drafts_by_suffix_matching(tiny_pair, tmp_path):
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    bundle = tmp_path / "target-only"
    export_pair(tiny_pair["target"], None, bundle, ExportOptions(progress=False))
    gen = specdec_rt.load(bundle, threads=1)
    out = gen.generate(PROMPTS[0] * 3, max_new_tokens=16, temperature=0, ignore_eos=True)
    assert out.stats.drafter == "suffix" and out.stats.proposed > 0
    assert out.token_ids == gen.generate(PROMPTS[0] * 3, max_new_tokens=16, temperature=0, ignore_eos=True,
                                         drafter=None).token_ids
    with pytest.raises(GenerationInputError, match="tree"):
        gen.generate(PROMPTS[0], max_new_tokens=4, speculation="tree")


@pytest.mark.parametrize("share", [0.05, 0.25, 0.45])
def test_default_call_is_target_only_greedy_with_rejections(fresh_gen, share):
    """Whatever "auto" resolves to, the default call is token for token target-only greedy, with
    drafts that get rejected (the tiny pair's draft is a different random model)."""
    with_draft_cost(fresh_gen, share)
    rejected = 0
    for prompt in PROMPTS:
        base = fresh_gen.generate(prompt, max_new_tokens=24, temperature=0, ignore_eos=True, drafter=None)
        for k in (2, "auto"):
            out = fresh_gen.generate(prompt, max_new_tokens=24, temperature=0, ignore_eos=True, num_draft_tokens=k)
            assert out.token_ids == base.token_ids, (share, prompt, k)
            rejected += out.stats.proposed - out.stats.accepted
    assert rejected > 0


def test_specdec_run_defaults_to_auto(tiny_pair, capsys):
    from specdec_rt.cli.run_cli import main

    assert main(["--bundle", str(tiny_pair["bundle"]), "--prompt", "def fib(n):", "--max-new-tokens", "6",
                 "--temperature", "0", "--json", "--threads", "1"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["drafter_requested"] == "auto" and stats["drafter"] in ("model", "suffix_hybrid", "suffix")
