"""Session fixtures: tiny checkpoints and their exported bundles (built once per test run)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# measured cost models are not shared through ~/.cache between tests (or with a developer's runs):
# each generator measures its own, as before the cache; tests/test_cost_cache.py turns it on
os.environ["SPECDEC_COST_CACHE"] = "0"

from helpers import (llama_config, make_checkpoint, make_perturbed_copy,  # noqa: E402
                     make_tiny_vocab_checkpoint)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict:
    """A 2-layer target and a noisy copy of it as draft (partial agreement), exported."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("tiny_pair")
    target = make_checkpoint(llama_config(), base / "target", seed=0)
    draft = make_perturbed_copy(target, base / "draft", noise=0.03)
    bundle = base / "bundle"
    export_pair(target, draft, bundle, ExportOptions(progress=False))
    same = base / "bundle_same"
    export_pair(target, target, same, ExportOptions(progress=False))
    return {"target": target, "draft": draft, "bundle": bundle, "bundle_same": same}


@pytest.fixture(scope="session")
def tiny_vocab_pair(tmp_path_factory) -> dict:
    """16-token vocabulary target and draft: distributions small enough to test exactly."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("tiny_vocab")
    cfg_t = llama_config(vocab_size=16, hidden=32, layers=2, heads=2, kv_heads=1, inter=64, max_pos=64)
    cfg_d = llama_config(vocab_size=16, hidden=16, layers=1, heads=2, kv_heads=1, inter=32, max_pos=64)
    target = make_tiny_vocab_checkpoint(cfg_t, base / "target", seed=3, scale=0.5)
    draft = make_tiny_vocab_checkpoint(cfg_d, base / "draft", seed=4, scale=0.5)
    bundle = base / "bundle"
    export_pair(target, draft, bundle, ExportOptions(progress=False))
    return {"target": target, "draft": draft, "bundle": bundle}


@pytest.fixture(scope="session")
def tiny_gen(tiny_pair):
    import specdec_rt

    return specdec_rt.load(tiny_pair["bundle"], threads=1)


@pytest.fixture(scope="session", params=["views", "io_binding"])
def any_gen(request, tiny_pair):
    """The tiny pair through both host feeding strategies (IO binding is the GPU path)."""
    import specdec_rt

    return specdec_rt.load(tiny_pair["bundle"], threads=1, io_binding=request.param == "io_binding")
