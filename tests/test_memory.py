"""Run-time memory: K/V sized from the requested context, chunked prompts, peak RSS in stats."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import llama_config, make_checkpoint


@pytest.fixture(scope="module")
def long_context_bundle(tmp_path_factory):
    """A tiny model whose bundle allows 8192 positions (more than the run-time default)."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("long_ctx")
    ckpt = make_checkpoint(llama_config(max_pos=8192), base / "target", seed=2)
    export_pair(ckpt, None, base / "bundle", ExportOptions(progress=False, max_context=8192))
    return base / "bundle"


def test_kv_cache_sized_from_requested_context(long_context_bundle):
    import specdec_rt
    from specdec_rt.runtime.api.generator import GenerationInputError

    default = specdec_rt.load(long_context_bundle, threads=1)
    assert default.bundle.max_context == 8192
    assert default.max_length == 4096  # the model's maximum is never the default
    # positions allocated per sequence (the stride of a batched layout follows the longest one)
    assert default.target.cache.max_len == 4096 + 1  # one spare slot for padded calls
    small = specdec_rt.load(long_context_bundle, threads=1, max_context=64)
    assert small.target.cache.max_len == 65
    assert specdec_rt.load(long_context_bundle, threads=1, max_length=64).max_length == 64  # old name
    with pytest.raises(GenerationInputError, match="exceeds the bundle's context of 8192"):
        specdec_rt.load(long_context_bundle, threads=1, max_context=9000)
    with pytest.raises(ValueError, match="raise max_context"):
        small.generate_ids(list(range(1, 80)), max_new_tokens=4)


def test_long_prompt_runs_in_chunks_with_the_same_result(long_context_bundle):
    import specdec_rt

    gen = specdec_rt.load(long_context_bundle, threads=1, max_context=1024)
    eng = gen.target
    prompt = (np.arange(600) * 7 % 300 + 1).tolist()
    eng.reset()
    whole = eng.extend(prompt, chunk=len(prompt)).copy()
    kv_whole = eng.cache.read(0, 0, len(prompt))
    eng.reset()
    chunked = eng.extend(prompt, chunk=100).copy()
    kv_chunked = eng.cache.read(0, 0, len(prompt))
    assert eng.length == len(prompt)
    np.testing.assert_allclose(chunked, whole, atol=1e-5)
    np.testing.assert_allclose(kv_chunked[0], kv_whole[0], atol=1e-5)
    # a prompt longer than one chunk generates exactly as target-only and speculative agree
    base = gen.generate_ids(prompt, max_new_tokens=12, drafter=None, ignore_eos=True)
    assert gen.generate_ids(prompt, max_new_tokens=12, drafter="prompt_lookup", ignore_eos=True) == base


def test_stats_report_peak_rss(tiny_gen):
    res = tiny_gen.generate("def f(x):", max_new_tokens=8)
    assert res.stats.peak_rss_bytes > 10 * 2**20  # at least the interpreter and ONNX Runtime
    assert res.to_dict()["stats"]["peak_rss_bytes"] == res.stats.peak_rss_bytes


def test_run_cli_max_context_flag(tiny_pair, capsys):
    from specdec_rt.cli.run_cli import main

    assert main(["--bundle", str(tiny_pair["bundle"]), "--prompt", "x = 1", "--max-new-tokens", "4",
                 "--max-context", "16"]) == 0
    assert "peak RSS" in capsys.readouterr().err
    assert main(["--bundle", str(tiny_pair["bundle"]), "--prompt", "x = 1 " * 20, "--max-context", "16"]) == 1
    assert "raise max_context" in capsys.readouterr().err
