"""Peer systems (transformers, onnxruntime-genai) agree token for token on greedy outputs."""
from __future__ import annotations

import json

import pytest

from helpers import llama_config, make_checkpoint, make_perturbed_copy

from specdec_rt.bench.peers import (PeerRun, available_peers, build_ortgenai_model, build_ortgenai_models,
                                    make_ortgenai_spec_dir, run_ortgenai, run_transformers)

PROMPTS = [[5, 17, 42, 99, 3], [200, 201, 202, 7, 7, 7, 9, 310]]
N = 32


def need(*systems):
    peers = available_peers()
    for s in systems:
        if peers.get(s) is not None:
            pytest.skip(f"{s}: {peers[s]}")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("peers")
    target = make_checkpoint(llama_config(), base / "target", seed=0)
    small = make_checkpoint(llama_config(hidden=32, layers=1, heads=2, kv_heads=1, inter=64), base / "small",
                            seed=1)
    close = make_perturbed_copy(target, base / "close", noise=0.03)
    return {"base": base, "target": target, "small": small, "close": close}


@pytest.fixture(scope="module")
def genai(ckpts) -> dict:
    need("ortgenai")
    base = ckpts["base"] / "genai"
    names = ("target", "small", "close")
    outs = build_ortgenai_models([(ckpts[n], base / n) for n in names])
    return dict(zip(names, outs))


@pytest.fixture(scope="module")
def reference(ckpts) -> list[PeerRun]:
    need("transformers")
    return run_transformers(ckpts["target"], PROMPTS, N, threads=1, warmup=False)


def assert_same(runs, reference, system):
    assert [r.system for r in runs] == [system] * len(PROMPTS)
    for r, ref in zip(runs, reference):
        assert len(r.token_ids) == N
        assert r.token_ids == ref.token_ids
        assert r.seconds > 0 and r.tokens_per_second > 0


def test_available_peers_here():
    peers = available_peers()
    assert set(peers) >= {"transformers", "transformers-assisted", "ortgenai", "ortgenai-spec"}
    assert all(v is None or isinstance(v, str) for v in peers.values())


def test_transformers_plain(reference):
    assert all(len(r.token_ids) == N and r.system == "transformers" for r in reference)
    assert reference[0].token_ids != reference[1].token_ids


@pytest.mark.parametrize("draft", ["small", "close"])
def test_transformers_assisted_matches_plain(ckpts, reference, draft):
    need("transformers-assisted")
    runs = run_transformers(ckpts["target"], PROMPTS, N, draft_dir=ckpts[draft], num_draft_tokens=4, threads=1,
                            warmup=False)
    assert_same(runs, reference, "transformers-assisted")
    assert all(r.extra["proposed"] > 0 for r in runs)


def test_ortgenai_target_matches_transformers(genai, reference):
    assert_same(run_ortgenai(genai["target"], PROMPTS, N, threads=1), reference, "ortgenai")


@pytest.mark.parametrize("draft,k", [("small", 4), ("close", 3), ("target", 5)])
def test_ortgenai_spec_matches_transformers(genai, reference, draft, k):
    need("ortgenai-spec")
    runs = run_ortgenai(genai["target"], PROMPTS, N, draft_genai_dir=genai[draft], num_draft_tokens=k, threads=1)
    assert_same(runs, reference, "ortgenai-spec")
    for r in runs:
        assert r.extra["proposed"] > 0 and r.extra["effective_k"] == k
    if draft == "target":  # identical draft: every proposal accepted
        assert all(r.extra["acceptance_rate"] == 1.0 and r.extra["accepted"] == r.extra["proposed"] for r in runs)


def test_ortgenai_spec_adaptive_matches_transformers(genai, reference):
    need("ortgenai-spec")
    runs = run_ortgenai(genai["target"], PROMPTS, N, draft_genai_dir=genai["close"], num_draft_tokens=8,
                        adaptive=True, min_adaptive_k=1, threads=1, warmup=False)
    assert_same(runs, reference, "ortgenai-spec-adaptive")


def test_spec_dir_config_and_build_cache(ckpts, genai, tmp_path):
    out = make_ortgenai_spec_dir(genai["target"], genai["small"], tmp_path / "spec", num_draft_tokens=6)
    cfg = json.loads((out / "genai_config.json").read_text())
    assert cfg["model"]["draft"]["filename"] == "draft/model.onnx"
    assert (out / cfg["model"]["draft"]["filename"]).is_file()
    assert cfg["speculative"]["max_draft_tokens"] == 6
    stamp = (genai["target"] / "genai_config.json").stat().st_mtime_ns
    assert build_ortgenai_model(ckpts["target"], genai["target"]) == genai["target"]  # cached: no rebuild
    assert (genai["target"] / "genai_config.json").stat().st_mtime_ns == stamp


def test_head_to_head_script_interleaves_and_reports(tiny_pair, tmp_path):
    """scripts/head_to_head.py end to end on the tiny pair: every system ran every prompt, every
    output equals target-only decoding, and the summary ratios are what the rows say."""
    need("ortgenai-spec")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "head_to_head.py"
    spec = importlib.util.spec_from_file_location("head_to_head", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "h2h"
    mod.main(["--bundle", str(tiny_pair["bundle"]), "--ours", "2,auto", "--genai", "2", "--num-prompts", "2",
              "--repeats", "2", "--max-new-tokens", "12", "--threads", "1", "--peer-cache", str(tmp_path / "peers"),
              "--out", str(out)])
    report = json.loads((out / "head_to_head.json").read_text())
    rows = {r["system"]: r for r in report["rows"]}
    assert set(rows) == {"ours target-only", "ours K=2", "ours K=auto", "genai target-only", "genai K=2"}
    assert all(r["identical_to_target_only"] and len(r["per_repeat"]) == 2 for r in rows.values())
    best = max(rows["ours K=2"]["tokens_per_second"], rows["ours K=auto"]["tokens_per_second"])
    assert report["summary"]["ours_best_over_genai_best"] == pytest.approx(best / rows["genai K=2"]["tokens_per_second"])
    assert (out / "head_to_head.md").read_text().count("| yes |") == 5
