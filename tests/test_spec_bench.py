"""specdec-bench --suite spec-bench on a tiny chat pair: questions picked per category, the chat
template applied, every configuration exact, per-category rows and files written; onnxruntime-genai
as a peer in the same run."""
from __future__ import annotations

import json

import pytest

from helpers import make_chat_checkpoint
from specdec_rt.bench.spec_bench import load_questions
from specdec_rt.cli.bench_cli import main
from specdec_rt.errors import GenerationInputError

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about caches.", "Another."]},
    {"question_id": 2, "category": "writing", "turns": ["Write a limerick."]},
    {"question_id": 3, "category": "writing", "turns": ["Not picked with 2 per category."]},
    {"question_id": 4, "category": "coding", "turns": ["def fib(n):"]},
    {"question_id": 5, "category": "rag", "turns": ["Context: a b c a b c a b. Continue: a b"]},
]


@pytest.fixture(scope="module")
def spec_bench_files(tmp_path_factory):
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("spec_bench")
    ckpt = make_chat_checkpoint(base / "ckpt", "chatml")
    bundle = base / "bundle"
    export_pair(ckpt, ckpt, bundle, ExportOptions(progress=False))
    questions = base / "question.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return {"bundle": bundle, "questions": questions, "ckpt": ckpt}


def test_questions_are_picked_per_category_in_file_order(spec_bench_files):
    qs = load_questions(str(spec_bench_files["questions"]), None, 2)
    assert [q.question_id for q in qs] == [1, 2, 4, 5]
    assert qs[0].text == "Write a haiku about caches."  # the first turn
    assert [q.question_id for q in load_questions(str(spec_bench_files["questions"]), ["rag", "coding"], 1)] == [5, 4]
    with pytest.raises(GenerationInputError, match="unknown Spec-Bench categories"):
        load_questions(str(spec_bench_files["questions"]), ["poetry"], 1)
    with pytest.raises(GenerationInputError, match="not found"):
        load_questions(str(spec_bench_files["questions"]) + ".missing", None, 1)


def test_spec_bench_suite_end_to_end(spec_bench_files, tmp_path):
    out = tmp_path / "sb"
    rc = main(["--bundle", str(spec_bench_files["bundle"]), "--suite", "spec-bench", str(spec_bench_files["questions"]),
               "--questions-per-category", "2", "--max-new-tokens", "10", "--k", "2", "--repeats", "1",
               "--threads", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    for name in ("spec_bench.json", "spec_bench.md", "spec_bench.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "spec_bench.json").read_text())
    assert list(res["per_category"]) == ["writing", "coding", "rag"]
    names = [r["system"] for r in res["overall"]]
    assert names[0] == "target-only"
    assert {"model K=2", "model K=auto", "prompt_lookup K=2", "prompt_lookup K=auto", "model tree auto"} <= set(names)
    per_cat = {"writing": 2, "coding": 1, "rag": 1}
    for cat, rows in [("overall", res["overall"]), *res["per_category"].items()]:
        for r in rows:
            assert r["identical_to_own_target_only"], (cat, r["system"])  # greedy: every configuration exact
            assert r["tokens"] == 10 * (4 if cat == "overall" else per_cat[cat])  # EOS ignored
    overall = {r["system"]: r for r in res["overall"]}
    assert overall["model K=2"]["tokens_per_target_call"] > 1.0  # self-draft: everything accepted
    assert overall["target-only"]["ttft_ms"] > 0
    assert overall["target-only"]["decode_speedup"] == pytest.approx(1.0)
    assert overall["model K=2"]["decode_tokens_per_second"] > 0
    # the chat template was applied: prompts are longer than the raw questions' tokens
    assert all(n > 5 for n in res["prompt_tokens"].values())
    md = (out / "spec_bench.md").read_text()
    assert "| coding |" in md and "## Overall" in md


def test_spec_bench_with_onnxruntime_genai(spec_bench_files, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "sb"
    rc = main(["--bundle", str(spec_bench_files["bundle"]), "--suite", "spec-bench", str(spec_bench_files["questions"]),
               "--categories", "coding", "--questions-per-category", "1", "--max-new-tokens", "8", "--k", "2",
               "--drafter", "model", "--no-auto", "--no-tree", "--peers", "onnxruntime-genai", "--peer-k", "2",
               "--repeats", "1", "--threads", "1", "--peer-cache", str(tmp_path / "peers"), "--out", str(out),
               "--quiet"])
    assert rc == 0
    res = json.loads((out / "spec_bench.json").read_text())
    rows = {r["system"]: r for r in res["overall"]}
    assert not res["skipped"], res["skipped"]
    assert rows["onnxruntime-genai target-only"]["tokens"] == 8
    assert rows["onnxruntime-genai target-only"]["ttft_ms"] > 0  # timed to its first new token
    # genai's greedy output is the same model's: equal to ours token for token on this tiny pair
    assert rows["onnxruntime-genai spec K=2"]["identical_to_own_target_only"]


def test_baseline_bundle_joins_the_baselines(spec_bench_files, tmp_path):
    """--baseline-bundle: another export of the same checkpoint (here w8a8 beside the float one)
    runs target-only in the same run as a family of its own, and speedups are over the fastest
    target-only of either; a bundle whose tokens differ is refused before any run."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    other = tmp_path / "w8a8"
    export_pair(spec_bench_files["ckpt"], spec_bench_files["ckpt"], other,
                ExportOptions(progress=False, quantize="w8a8", validate=False))
    out = tmp_path / "sb"
    rc = main(["--bundle", str(spec_bench_files["bundle"]), "--suite", "spec-bench", str(spec_bench_files["questions"]),
               "--categories", "coding,rag", "--questions-per-category", "1", "--max-new-tokens", "8", "--k", "2",
               "--drafter", "model", "--no-auto", "--no-tree", "--baseline-bundle", str(other), "--repeats", "1",
               "--threads", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    rows = {r["system"]: r for r in json.loads((out / "spec_bench.json").read_text())["overall"]}
    extra = rows["target-only [w8a8]"]
    assert extra["family"] == "ours [w8a8]" and extra["tokens"] == 16 and extra["identical_to_own_target_only"]
    fastest = min(rows["target-only"]["seconds"], extra["seconds"])
    assert rows["model K=2"]["speedup"] == pytest.approx(fastest / rows["model K=2"]["seconds"])
    assert max(rows["target-only"]["speedup"], extra["speedup"]) == pytest.approx(1.0)

    foreign = tmp_path / "foreign"
    ckpt = make_chat_checkpoint(tmp_path / "ckpt2", "llama3")
    export_pair(ckpt, ckpt, foreign, ExportOptions(progress=False, validate=False))
    with pytest.raises(GenerationInputError, match="other tokens"):
        from specdec_rt.bench.spec_bench import SpecBenchConfig, run_spec_bench

        run_spec_bench(SpecBenchConfig(bundle=str(spec_bench_files["bundle"]), questions=str(spec_bench_files["questions"]),
                                       categories=["coding"], per_category=1, max_new_tokens=4, ks=[], drafters=[],
                                       auto=False, tree=False, threads=1, progress=False,
                                       baseline_bundles=[str(foreign)]))


def test_bad_suite_arguments(spec_bench_files, tmp_path, capsys):
    rc = main(["--bundle", str(spec_bench_files["bundle"]), "--suite", "mt-bench", "--out", str(tmp_path)])
    assert rc == 1
    assert "--suite takes 'spec-bench [PATH]'" in capsys.readouterr().err
    rc = main(["--bundle", str(spec_bench_files["bundle"]), "--suite", "spec-bench", "--out", str(tmp_path)])
    assert rc == 1
    assert "question.jsonl" in capsys.readouterr().err


def test_edits_suite_end_to_end(spec_bench_files, tiny_pair, tmp_path):
    """--suite edits: multi-turn sessions (chat template or plain text), every drafter exact, rows
    per turn; the shipped workload loads; a bad workload is a clear error."""
    from specdec_rt.bench.edits import load_sessions, shipped_workload

    shipped = load_sessions("")
    assert len(shipped) == 3 and all(len(s.edits) == 4 for s in shipped) and shipped_workload().endswith(".jsonl")
    work = tmp_path / "edits.jsonl"
    work.write_text(json.dumps({"session": "s", "path": "a.py", "file": "def f(x):\n    return x\n",
                                "edits": ["Rename f to g.", "Add a docstring."]}) + "\n")
    # a chat template, then plain text, then plain text prefilling every turn's whole history
    for bundle, extra in ((spec_bench_files["bundle"], []), (tiny_pair["bundle"], []),
                          (tiny_pair["bundle"], ["--no-prefix-cache"])):
        out = tmp_path / (bundle.name + "".join(extra))
        rc = main(["--bundle", str(bundle), "--suite", "edits", str(work), "--max-new-tokens", "12",
                   "--repeats", "1", "--threads", "1", "--out", str(out), "--quiet", *extra])
        assert rc == 0
        res = json.loads((out / "edits.json").read_text())
        assert res["settings"]["prefix_cache"] is not bool(extra)
        assert res["suite"] == "edits" and list(res["per_category"]) == ["turn 1", "turn 2"]
        names = [r["system"] for r in res["overall"]]
        assert names[0] == "target-only" and {"suffix K=auto", "suffix_hybrid K=auto", "model K=auto"} <= set(names)
        assert all(r["identical_to_own_target_only"] for r in res["overall"])
        assert "# Multi-turn code edits" in (out / "edits.md").read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "s"}\n')
    with pytest.raises(GenerationInputError, match="not an edit session"):
        load_sessions(str(bad))


def test_grounded_suite_stops_at_eos_and_runs_every_question(spec_bench_files, tmp_path):
    """--suite grounded: the Spec-Bench machinery on requests whose answers copy from the prompt,
    every question of the file, answers ending at EOS (the tiny chat model may end early), the
    default drafter among the systems, every system identical to target-only."""
    out = tmp_path / "grounded"
    rc = main(["--bundle", str(spec_bench_files["bundle"]), "--suite", "grounded", str(spec_bench_files["questions"]),
               "--max-new-tokens", "12", "--k", "", "--drafter", "auto,suffix", "--no-tree", "--repeats", "1",
               "--threads", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    for name in ("grounded.json", "grounded.md", "grounded.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "grounded.json").read_text())
    assert res["settings"]["ignore_eos"] is False and res["settings"]["per_category"] >= 3
    assert len(res["prompt_tokens"]) == len(QUESTIONS)  # every question, not 2 per category
    assert res["title"].startswith("Grounded") and (out / "grounded.md").read_text().startswith("# Grounded")
    names = {r["system"] for r in res["overall"]}
    assert {"target-only", "auto K=auto", "suffix K=auto"} <= names
    assert all(r["identical_to_own_target_only"] for r in res["overall"])


def test_shipped_grounded_questions():
    """The shipped grounded set: four kinds of request, prompts long enough to copy from."""
    from specdec_rt.bench.spec_bench import EVERY_QUESTION, GROUNDED_QUESTIONS

    qs = load_questions(str(GROUNDED_QUESTIONS), None, EVERY_QUESTION)
    assert list(dict.fromkeys(q.category for q in qs)) == ["edit", "refactor", "tests", "doc_qa"]
    assert len(qs) >= 12 and all(len(q.text) > 1000 for q in qs)


def test_agent_suite_through_the_server(spec_bench_files, tmp_path):
    """--suite agent: tool-call loops sent to a real specdec-serve with the OpenAI client, the
    conversation growing with target-only's answers and scripted tool results; every configuration
    returns the same text per turn; the shipped workload loads; a bad workload is a clear error."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from specdec_rt.bench.agent import conversation, load_sessions, shipped_workload

    shipped = load_sessions("")
    assert len(shipped) == 3 and all(s.turns == 4 for s in shipped) and shipped_workload().endswith(".jsonl")
    msgs = conversation(shipped[0], ["READ inventory.py", "WRITE ..."], 2)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[3]["content"] == shipped[0].results[0] and msgs[-1]["content"] == shipped[0].results[1]
    work = tmp_path / "agent.jsonl"
    work.write_text(json.dumps({"session": "s", "system": "You are an agent.", "task": "Read a.py.",
                                "results": ["Tool result (READ a.py): def f(x): return x"]}) + "\n")
    out = tmp_path / "agent"
    rc = main(["--bundle", str(spec_bench_files["bundle"]), "--suite", "agent", str(work), "--max-new-tokens", "12",
               "--drafter", "auto,suffix", "--repeats", "1", "--threads", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    res = json.loads((out / "agent.json").read_text())
    assert res["suite"] == "agent" and list(res["per_category"]) == ["turn 1", "turn 2"]
    assert [r["system"] for r in res["overall"]] == ["target-only", "served auto", "served suffix"]
    assert all(r["identical_to_own_target_only"] for r in res["overall"])
    assert all(r["tokens"] > 0 and r["ttft_ms"] > 0 for r in res["overall"])
    assert "# Agent tool loops through specdec-serve" in (out / "agent.md").read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "s"}\n')
    with pytest.raises(GenerationInputError, match="not an agent session"):
        load_sessions(str(bad))
