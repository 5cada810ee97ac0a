"""Graph contract 2: the head-major K/V cache (keys ``[seqs, Hkv, D, stride]``, values
``[seqs, Hkv, stride, D]``) that the target's attention reads in place, beside contract 1's
sequence-major cache that older bundles, drafts and GPU providers keep.

The exactness of speculation over it (chains, trees, batches, the prefix cache, int4 and w8a8)
is tested with every other bundle in tests/test_row_exactness.py and tests/test_exactness.py;
here: the cache's own moves, the bundle contract, and that both layouts compute one model.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import specdec_rt
from specdec_rt.errors import BundleError
from specdec_rt.export.errors import ExportError
from specdec_rt.export.pipeline import ExportOptions
from specdec_rt.runtime.kv_cache import KVCache

from helpers import llama_config, make_checkpoint


def _filled(layout: str, seqs: int = 3, stride: int = 40) -> tuple[KVCache, list[int], dict]:
    """A cache with distinct values at every committed position of every sequence."""
    cache = KVCache(2, 200, 2, 4, np.float32, seqs=seqs, layout=layout)
    cache.restride(stride, [0] * seqs)
    lengths = [7, 33, 19][:seqs]
    rng = np.random.default_rng(0)
    want = {}
    for q, n in enumerate(lengths):
        for layer in range(2):
            k, v = rng.standard_normal((2, n, 2, 4)).astype(np.float32)
            head = layout == "head"
            cache.write(layer, q, 0, k.transpose(1, 2, 0) if head else k, v.transpose(1, 0, 2) if head else v)
            want[q, layer] = (k, v)
    return cache, lengths, want


@pytest.mark.parametrize("layout", ["head", "sequence"])
def test_restride_keeps_every_committed_position(layout):
    """Growing and shrinking the stride (what batches and, head-major, every call's _fit do)
    moves each sequence's committed K/V with it, in both layouts."""
    cache, lengths, want = _filled(layout)
    for stride in (64, 96, 34, 40, 128):
        cache.restride(stride, lengths)
        assert cache.stride == stride
        for (q, layer), (k, v) in want.items():
            got_k, got_v = cache.read(layer, 0, lengths[q], q)
            np.testing.assert_array_equal(got_k, k)
            np.testing.assert_array_equal(got_v, v)


@pytest.mark.parametrize("layout", ["head", "sequence"])
def test_gather_into_compacts_tree_slots(layout):
    cache, lengths, want = _filled(layout)
    k, v = want[1, 0]
    cache.gather_into([3, 9, 20], 2, seq=1)  # an accepted tree path, compacted to slots 2..4
    got_k, got_v = cache.read(0, 0, 5, 1)
    np.testing.assert_array_equal(got_k, k[[0, 1, 3, 9, 20]])
    np.testing.assert_array_equal(got_v, v[[0, 1, 3, 9, 20]])


def test_head_major_views_are_what_the_graph_reads():
    cache = KVCache(1, 64, 2, 8, np.float32, seqs=2, layout="head")
    cache.restride(32, [0, 0])
    assert cache.keys[0].shape == (2, 2, 8, 32) and cache.values[0].shape == (2, 2, 32, 8)
    assert cache.keys[0][1:2].flags.c_contiguous  # one sequence's past: its block, no copy


@pytest.fixture(scope="module")
def two_layouts(tmp_path_factory) -> dict:
    from specdec_rt.export.pipeline import export_pair

    base = tmp_path_factory.mktemp("kv_layout")
    target = make_checkpoint(llama_config(), base / "target", seed=3)
    draft = make_checkpoint(llama_config(hidden=32, layers=1, heads=2, kv_heads=1), base / "draft", seed=4)
    out = {}
    for layout in ("head", "sequence"):
        out[layout] = base / layout
        export_pair(target, draft, out[layout], ExportOptions(progress=False, kv_layout=layout))
    return out


def test_the_manifest_says_which_contract(two_layouts):
    head = json.loads((two_layouts["head"] / "manifest.json").read_text())
    seq = json.loads((two_layouts["sequence"] / "manifest.json").read_text())
    assert head["contract_version"] == 2 and head["models"]["target"]["kv_layout"] == "head"
    assert head["models"]["draft"]["kv_layout"] == "sequence"  # drafts keep contract 1's layout
    # a bundle without head-major graphs stays contract 1: older runtimes read it
    assert seq["contract_version"] == 1 and seq["models"]["target"]["kv_layout"] == "sequence"


def test_both_layouts_compute_the_same_model(two_layouts):
    """The same checkpoint through either contract: the same logits up to float rounding, and
    each bundle's speculation is token-for-token its own target-only decoding."""
    gens = {k: specdec_rt.load(p, threads=1) for k, p in two_layouts.items()}
    assert gens["head"].target.head_major and not gens["sequence"].target.head_major
    prompt = [5, 17, 200, 33, 9, 41]
    logits = {}
    for k, gen in gens.items():
        gen.target.reset()
        logits[k] = gen.target.extend(prompt).copy()
        base = gen.generate_ids(prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True, drafter=None)
        for kw in (dict(num_draft_tokens=3), dict(speculation="tree"), dict(num_draft_tokens="auto")):
            assert gen.generate_ids(prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True, **kw) == base, (k, kw)
    np.testing.assert_allclose(logits["head"], logits["sequence"], atol=1e-4, rtol=0)


def test_a_manifest_claiming_head_major_under_contract_1_is_refused(two_layouts, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(two_layouts["head"], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["contract_version"] = 1
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="kv_layout 'head' is not one graph contract 1 defines"):
        specdec_rt.load(bundle)
    manifest["contract_version"] = 3
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="graph contract version 3 is not one this runtime reads"):
        specdec_rt.load(bundle)


@pytest.mark.parametrize("kwargs", [dict(kv_layout="head", portable=True), dict(kv_layout="head", target_attention="native"),
                                    dict(kv_layout="rows")])
def test_export_refuses_a_layout_its_attention_cannot_read(kwargs):
    with pytest.raises(ExportError, match="kv-layout"):
        ExportOptions(**kwargs).check()
