"""The cost model "auto" decides from is measured once per bundle and machine and read back from
disk by later generators (no cold start), keyed so that another bundle or setup measures anew."""
from __future__ import annotations

import json

import pytest


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_COST_CACHE", "1")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    return tmp_path / "costs"


def test_second_generator_reads_the_measured_cost_model(tiny_pair, cache, monkeypatch):
    import specdec_rt
    from specdec_rt.runtime.loop import policy_store

    prompt = [5, 6, 7, 8]
    first = specdec_rt.load(tiny_pair["bundle"], threads=1)
    first.generate_ids(prompt, max_new_tokens=6, num_draft_tokens="auto")
    files = list(cache.glob("*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    from specdec_rt.runtime.policies.cost_model import MAX_VERIFY_ROWS
    assert len(saved["target_times"]) == MAX_VERIFY_ROWS and saved["draft_step"] > 0  # S = 1..33

    def no_measuring(*a, **kw):
        raise AssertionError("measured again although the cost model was on disk")

    monkeypatch.setattr(policy_store, "measure_cost_model", no_measuring)
    second = specdec_rt.load(tiny_pair["bundle"], threads=1)
    out = second.generate_ids(prompt, max_new_tokens=6, num_draft_tokens="auto")
    assert out == first.generate_ids(prompt, max_new_tokens=6, drafter=None)
    assert second.policies.cost_model.target_times == saved["target_times"]  # what the policy used

    # another setup (here the context the cache is sized for) is another key: measured, a second file
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_COST_CACHE", "1")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache.parent))
    specdec_rt.load(tiny_pair["bundle"], threads=1, max_context=64).generate_ids(prompt, max_new_tokens=6,
                                                                               num_draft_tokens="auto")
    assert len(list(cache.glob("*.json"))) == 2


def test_a_corrupt_file_is_measured_over(tiny_pair, cache):
    import specdec_rt

    gen = specdec_rt.load(tiny_pair["bundle"], threads=1)
    gen.generate_ids([5, 6, 7], max_new_tokens=4, num_draft_tokens="auto")
    (path,) = cache.glob("*.json")
    path.write_text("{ not json")
    again = specdec_rt.load(tiny_pair["bundle"], threads=1)
    assert again.generate_ids([5, 6, 7], max_new_tokens=4, num_draft_tokens="auto")
    from specdec_rt.runtime.engines.cost_cache import VERSION
    assert json.loads(path.read_text())["version"] == VERSION  # rewritten


def test_off_switch(tiny_pair, tmp_path, monkeypatch):
    import specdec_rt

    monkeypatch.setenv("SPECDEC_COST_CACHE", "0")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    specdec_rt.load(tiny_pair["bundle"], threads=1).generate_ids([5, 6], max_new_tokens=4, num_draft_tokens="auto")
    assert not (tmp_path / "costs").exists()


def test_prefix_probe_verdict_is_read_back_per_machine_setup(tiny_pair, cache, monkeypatch):
    """The prefix cache's probe (seconds on a 1.5B target) runs once per bundle and setup."""
    import specdec_rt
    from specdec_rt.runtime.engines import prefix_cache

    first = specdec_rt.load(tiny_pair["bundle"], threads=1)
    probes = list((cache.parent / "probes").glob("*.json"))
    assert first.prefix_cache and len(probes) == 1
    assert json.loads(probes[0].read_text())["verdict"] is True

    def no_probing(*a, **kw):
        raise AssertionError("probed again although the verdict was on disk")

    monkeypatch.setattr(prefix_cache, "probe_prefix_reuse", no_probing)
    second = specdec_rt.load(tiny_pair["bundle"], threads=1)
    assert second.prefix_cache and second.target.prefix_rows == second.target.min_rows
    probes[0].write_text(json.dumps({"version": 1, "verdict": False}))  # as measured on a machine where bits differ
    assert not specdec_rt.load(tiny_pair["bundle"], threads=1).prefix_cache
    with pytest.raises(AssertionError, match="probed again"):  # another setup: another key, probed
        specdec_rt.load(tiny_pair["bundle"], threads=1, max_context=128)
