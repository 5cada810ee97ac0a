"""specdec-bench end to end on the tiny pair: files written, figures consistent, peers compared."""
from __future__ import annotations

import json

import pytest

from specdec_rt.cli.bench_cli import build_parser, main


def test_bench_writes_results_table_and_plots(tiny_pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "x = [1, 2, 3]\n"]))
    out = tmp_path / "bench"
    rc = main(["--bundle", str(tiny_pair["bundle"]), "--prompts", str(prompts), "--max-new-tokens", "12",
               "--k", "1,2", "--tree-budgets", "3", "--repeats", "1", "--peers", "transformers",
               "--out", str(out), "--quiet"])
    assert rc == 0
    for name in ("results.json", "results.md", "speedup_vs_k.png", "target_time.png", "acceptance.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "results.json").read_text())
    names = [r["name"] for r in res["rows"]]
    assert names[0] == "target-only"
    assert {"model K=1", "model K=2", "model K=auto", "model K=3", "model tree N=3", "model tree auto",
            "prompt_lookup K=1"} <= set(names)
    assert all(r["identical_to_target_only"] for r in res["rows"])  # greedy: every mode exact
    assert len(res["target_time_curve"]["seconds"]) == 16
    peers = {p["system"]: p for p in res["peers"]}
    assert peers["transformers generate"]["identical_to_target_only"]
    assert peers["transformers assisted"]["identical_to_target_only"]
    assert "| target-only |" in (out / "results.md").read_text()


def test_bench_graphs_only_reports_cost_model_and_predictions(tiny_pair, tmp_path):
    out = tmp_path / "bench"
    assert main(["--bundle", str(tiny_pair["bundle"]), "--graphs-only", "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["rows"] == [] and res["target_only_tokens_per_second"] is None
    preds = {p["alpha"]: p for p in res["predicted_speedup"]}
    assert set(preds) == {0.6, 0.7, 0.8}
    assert preds[0.8]["speedup"] >= preds[0.6]["speedup"] > 0  # more acceptance never predicts less
    assert "Predicted chain speedup" in (out / "results.md").read_text()


def test_batch_bench_writes_results_table_and_plot(tiny_pair, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "x = [1, 2, 3]\n", "import os"]))
    out = tmp_path / "bench"
    rc = main(["--bundle", str(tiny_pair["bundle"]), "--prompts", str(prompts), "--max-new-tokens", "10",
               "--batch", "1,2,4", "--k", "2", "--drafter", "model,prompt_lookup", "--repeats", "1",
               "--threads", "1", "--clock", "cpu", "--out", str(out), "--quiet"])
    assert rc == 0
    for name in ("batch_results.json", "batch_results.md", "batch_throughput.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "batch_results.json").read_text())
    names = {(r["batch"], r["name"]) for r in res["rows"]}
    for b in (1, 2, 4):
        assert {(b, "target-only"), (b, "model K=2"), (b, "model K=auto"), (b, "prompt_lookup K=2")} <= names
    assert all(r["identical_to_target_only"] for r in res["rows"])
    assert res["settings"]["requests"] == 8  # twice the largest batch
    assert max(r["mean_width"] for r in res["rows"] if r["batch"] == 4) > 2
    assert set(res["cost_surface"]) == {"1", "2", "4"}
    assert "best_spec_vs_target_only" in res["goals"]["total"]
    assert "| 4 | model K=2 |" in (out / "batch_results.md").read_text()


def test_graph_timing_interleaves_and_scales_repeats():
    """compare_graphs times both systems in alternating blocks (the same moments of load) and gives
    fast calls more repeats (bounded)."""
    import time

    from specdec_rt.bench.graphs import _reps_for, _time_interleaved

    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: (order.append("b"), time.sleep(0.0001))}
    best = _time_interleaved(fns, reps=10, block=5)
    assert set(best) == {"a", "b"} and best["a"] < best["b"]
    calls = order[2:]  # after _reps_for's one call each
    assert calls[:10] == ["a"] * 5 + ["b"] * 5 and calls.count("a") == calls.count("b") >= 10
    assert _reps_for({"x": lambda: None}, 30) == 500
    assert _reps_for({"x": lambda: time.sleep(0.05)}, 30) == 30


def test_bench_overlap_rows(tiny_pair, tmp_path):
    """--overlap adds overlapped chains (every K and auto), exact, with their look-ahead hit rate
    and an ideal that counts only the drafting of steps whose look-ahead missed."""
    out = tmp_path / "bench"
    rc = main(["--bundle", str(tiny_pair["bundle"]), "--max-new-tokens", "12", "--num-prompts", "2",
               "--k", "1,3", "--no-tree", "--drafter", "model", "--repeats", "1", "--overlap",
               "--out", str(out), "--quiet"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in res["rows"]}
    assert {"model K=1 overlap", "model K=3 overlap", "model K=auto overlap", "model K=1",
            "target-only (non-spinning pool)"} <= set(rows)
    assert all(r["identical_to_target_only"] for r in rows.values())
    assert rows["model K=1 overlap"]["overlap"] and 0 <= rows["model K=1 overlap"]["lookahead_hit_rate"] <= 1
    assert rows["model K=1"]["lookahead_hit_rate"] is None
    assert res["settings"]["thread_pools"] == "per-session"
    assert "look-ahead hits" in (out / "results.md").read_text()


def test_bench_rejects_bad_lists_with_a_usage_line(capsys):
    """A draft length or batch size that is not a positive integer is argparse's one-line error
    (exit 2), not a ValueError traceback; ``auto`` in --k is accepted (K=auto runs anyway)."""
    args = build_parser().parse_args(["--bundle", "b", "--out", "o", "--k", "4,auto,2", "--batch", "1,8"])
    assert args.k == [4, 2] and args.batch == [1, 8] and args.tree_budgets == [7, 10, 15]
    for flag, value in (("--k", "4,x"), ("--batch", "0"), ("--tree-budgets", "-3"), ("--peer-k", "2.5")):
        with pytest.raises(SystemExit) as exc:
            main(["--bundle", "b", "--out", "o", flag, value])
        assert exc.value.code == 2
        assert f"argument {flag}: expected positive integers" in capsys.readouterr().err
