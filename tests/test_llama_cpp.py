"""The llama.cpp peer: parsing its tools' real output, finding them, and specdec-bench's wiring.

The fixtures in tests/data/llama_cpp/ are real stdout/stderr of the tools built by
scripts/build_llama_cpp.sh (Qwen2.5-Coder 1.5B / 0.5B Q4_K_M, a Spec-Bench prompt, 16 tokens; a
loaded 2-core machine, hence the slow speeds). The CLI tests put small fake tools on the search
path; the one test that runs real binaries is skipped where they (or its GGUF) are absent.
"""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from specdec_rt.bench import llama_cpp as L
from specdec_rt.bench import llama_cpp_peer as LP
from specdec_rt.errors import GenerationInputError

DATA = Path(__file__).parent / "data" / "llama_cpp"
PROMPT = (DATA / "prompt.txt").read_text()
PLAIN_TEXT = b"Title: Hawaii: A Journey Through Time and Culture\n\nAs a digital nomad"


def fixture(name: str) -> tuple[bytes, str]:
    return (DATA / f"{name}.stdout").read_bytes(), (DATA / f"{name}.stderr").read_text()


# --------------------------------------------------------------------------------------------
# parsing real output
# --------------------------------------------------------------------------------------------

def test_completion_output_and_timings():
    out, err = fixture("completion")
    assert L.parse_generated(out, PROMPT, echoes_prompt=False) == PLAIN_TEXT
    t = L.parse_timings(err)
    # prompt eval time = 1660.50 ms / 51 tokens; eval time = 1934.12 ms / 15 runs (7.76 t/s)
    assert t["prompt_tokens"] == 51 and t["prompt_seconds"] == pytest.approx(1.6605)
    assert t["decode_tokens"] == 15 and t["decode_seconds"] == pytest.approx(1.93412)
    assert t["decode_tokens_per_second"] == pytest.approx(7.755, abs=1e-3)
    assert t["generated"] == 16  # the first token comes from the prompt's logits
    assert "drafted" not in t


@pytest.mark.parametrize("name, decoded, seconds, drafted, accepted", [
    ("speculative-simple", 19, 20.860, 27, 11),
    ("speculative", 17, 60.244, 24, 10),
    ("lookup", 16, 11.728, 0, 0),
])
def test_speculative_tools_timings(name, decoded, seconds, drafted, accepted):
    _, err = fixture(name)
    t = L.parse_timings(err)
    assert (t["decode_tokens"], t["generated"]) == (decoded, decoded)
    assert t["decode_seconds"] == pytest.approx(seconds)
    assert (t["drafted"], t["accepted"], t["draft_max"]) == (drafted, accepted, 4)
    # the prompt from "encoded 51 tokens in T seconds", not the target's "prompt eval time" (which
    # counts every multi-token verify call), and the rate recomputed (llama-lookup's counts the
    # generated tokens as prompt)
    assert t["prompt_tokens"] == 51
    assert t["prompt_tokens_per_second"] == pytest.approx(51 / t["prompt_seconds"])


def test_speculative_outputs_and_identity():
    texts = {n: L.parse_generated(fixture(n)[0], PROMPT, echoes_prompt=True)
             for n in ("speculative-simple", "speculative", "lookup")}
    assert texts["speculative-simple"] == PLAIN_TEXT + b", I have"  # ran past the budget
    # llama-speculative and llama-lookup evaluate the prompt in another batch split than
    # llama-completion: same weights, different text after a few tokens
    assert texts["lookup"].startswith(b"Title: Hawaii: A Journey Through Time and Culture\n\nAs a traveler")
    assert LP.same_as_plain("draft", texts["speculative-simple"], PLAIN_TEXT)
    assert not LP.same_as_plain("draft", texts["speculative"], PLAIN_TEXT)
    assert not LP.same_as_plain("lookup", texts["lookup"], PLAIN_TEXT)
    assert LP.same_as_plain("plain", PLAIN_TEXT, PLAIN_TEXT)
    assert not LP.same_as_plain("plain", PLAIN_TEXT + b"!", PLAIN_TEXT)


def test_generated_keeps_trailing_newlines_of_the_text():
    # the tools' own trailer is stripped exactly, whatever the generated text ends with
    assert L.parse_generated(b"code\n\n\n\n", "p", echoes_prompt=False) == b"code\n\n"
    assert L.parse_generated(b"\n\npans\n\n\n\n\n", "p", echoes_prompt=True) == b"ans\n"


def test_parse_errors_are_clear():
    with pytest.raises(L.LlamaCppError, match="decode timing"):
        L.parse_timings("llama_model_load: error loading model\n")
    with pytest.raises(L.LlamaCppError, match="echo the prompt"):
        L.parse_generated(b"\n\nsomething else\n\n\n\n", PROMPT, echoes_prompt=True)
    with pytest.raises(L.LlamaCppError, match="blank line"):
        L.parse_generated(b"cut off", PROMPT, echoes_prompt=False)
    with pytest.raises(L.LlamaCppError, match="JSON"):
        L.parse_bench_json("| model | size |")
    with pytest.raises(L.LlamaCppError, match="no prompt-processing"):
        L.parse_bench_json("[]")


def test_llama_bench_json():
    seconds = L.parse_bench_json((DATA / "llama-bench.json").read_text())
    assert sorted(seconds) == [1, 2, 4]
    assert seconds[2] == pytest.approx(0.070551096)
    assert L.parse_bench_json((DATA / "llama-bench.json").read_text(), "stddev_ns")[1] == pytest.approx(0.028358118)


# --------------------------------------------------------------------------------------------
# finding the tools, choosing the GGUF files
# --------------------------------------------------------------------------------------------

@pytest.fixture
def no_tools(tmp_path, monkeypatch):
    """No llama.cpp anywhere: an empty $LLAMA_CPP_BIN, PATH and default folder."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(L.ENV_VAR, str(empty))
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(L, "DEFAULT_BIN", empty / "default")
    return empty


def test_missing_binaries_name_every_place_and_the_build_script(no_tools):
    with pytest.raises(L.LlamaCppUnavailable) as e:
        L.find_tools()
    msg = str(e.value)
    assert "llama-completion" in msg and "$LLAMA_CPP_BIN" in msg and str(no_tools) in msg
    assert "PATH" in msg and "scripts/build_llama_cpp.sh" in msg
    # a peer that cannot run, and a one-line error of the command-line tools
    from specdec_rt.bench.peers import PeerUnavailable
    from specdec_rt.errors import USER_ERRORS

    assert isinstance(e.value, PeerUnavailable) and isinstance(e.value, USER_ERRORS)


def _executable(path: Path, text: str = "#!/bin/sh\n") -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_tools_found_in_env_folder_first_then_path(no_tools, tmp_path, monkeypatch):
    env_dir, path_dir = tmp_path / "env", tmp_path / "path"
    env_dir.mkdir()
    path_dir.mkdir()
    _executable(env_dir / "llama-completion")
    _executable(path_dir / "llama-completion")
    _executable(path_dir / "llama-speculative")  # the fallback name, when -simple is absent
    monkeypatch.setenv(L.ENV_VAR, str(env_dir))
    monkeypatch.setenv("PATH", str(path_dir))
    assert L.find_tool("plain") == env_dir / "llama-completion"
    assert L.find_tool("draft") == path_dir / "llama-speculative"
    (env_dir / "llama-completion").chmod(0o644)  # not executable: skipped
    assert L.find_tool("plain") == path_dir / "llama-completion"


def test_gguf_files_from_flags_or_manifest(tmp_path):
    t, d = tmp_path / "t.gguf", tmp_path / "d.gguf"
    t.write_bytes(b"GGUF")
    d.write_bytes(b"GGUF")
    gguf = {"models": {"target": {"source": {"format": "gguf", "path": str(t)}},
                       "draft": {"source": {"format": "gguf", "path": str(d)}}}}
    assert LP.gguf_files(gguf) == (t, d)
    assert LP.gguf_files(gguf, target=str(d)) == (d, d)  # a flag wins
    hf = {"models": {"target": {"source": {"format": "hf", "path": "/x"}}, "draft": {"checkpoint": "/y"}}}
    with pytest.raises(GenerationInputError, match="--gguf-target"):
        LP.gguf_files(hf)
    with pytest.raises(GenerationInputError, match="--gguf-draft"):
        LP.gguf_files(hf, target=str(t))
    assert LP.gguf_files({"models": {"target": {}}}, target=str(t)) == (t, None)  # no draft model
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        LP.gguf_files(hf, target=str(tmp_path / "missing.gguf"), draft=str(d))
    for odd in ({}, {"models": None}, {"models": {"target": {"source": "t.gguf"}}}):
        with pytest.raises(GenerationInputError):
            LP.gguf_files(odd)


# --------------------------------------------------------------------------------------------
# specdec-bench wiring (fake tools that print the captured output)
# --------------------------------------------------------------------------------------------

FAKE_TOOL = r'''#!{python}
"""A stand-in llama.cpp tool: prints captured output around the real prompt, logs its argv."""
import json, os, sys
from pathlib import Path

data, name = Path({data!r}), Path(sys.argv[0]).name
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps([name] + args) + "\n")
with open({log!r} + ".omp", "a") as f:  # the OpenMP wait policy it ran under
    f.write(json.dumps(os.environ.get("OMP_WAIT_POLICY")) + "\n")
if name == "llama-bench":
    print((data / "llama-bench.json").read_text())
    sys.exit(0)
prompt = Path(args[args.index("-f") + 1]).read_text()[:-1]  # -f drops one trailing newline
kind = {{"llama-completion": "completion", "llama-speculative-simple": "speculative-simple",
        "llama-lookup": "lookup"}}[name]
text = {{"completion": "Title: a trip", "speculative-simple": "Title: a trip, and more",
        "lookup": "Title: a tour"}}[kind]
if kind == "completion":
    out = text + "\n\n"
else:
    out = "\n\n" + prompt + text + "\n\n\n\n"
sys.stdout.write(out)
sys.stderr.write((data / (kind + ".stderr")).read_text())
'''


@pytest.fixture
def fake_tools(no_tools, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "argv.jsonl"
    src = FAKE_TOOL.format(python=sys.executable, data=str(DATA), log=str(log))
    for name in ("llama-completion", "llama-speculative-simple", "llama-lookup", "llama-bench"):
        _executable(bin_dir / name, src)
    monkeypatch.setenv(L.ENV_VAR, str(bin_dir))
    return {"bin": bin_dir, "log": log}


def test_bench_without_binaries_is_one_clear_error(tiny_pair, tmp_path, no_tools, capsys):
    from specdec_rt.cli.bench_cli import main

    rc = main(["--bundle", str(tiny_pair["bundle"]), "--peers", "onnxruntime-genai,llama.cpp",
               "--max-new-tokens", "4", "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: llama.cpp's llama-completion") and "build_llama_cpp.sh" in err
    assert not (tmp_path / "out").exists()  # failed before any run


def test_bench_without_gguf_is_one_clear_error(tiny_pair, tmp_path, fake_tools, capsys):
    from specdec_rt.cli.bench_cli import main

    rc = main(["--bundle", str(tiny_pair["bundle"]), "--peers", "llama.cpp", "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 1
    assert "--gguf-target" in capsys.readouterr().err


def test_bench_reports_llama_cpp_beside_ours(tiny_pair, tmp_path, fake_tools):
    from specdec_rt.cli.bench_cli import main

    t, d = tmp_path / "t.gguf", tmp_path / "d.gguf"
    t.write_bytes(b"GGUF")
    d.write_bytes(b"GGUF")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):\n", "x = '\\n'"]))
    out = tmp_path / "bench"
    rc = main(["--bundle", str(tiny_pair["bundle"]), "--prompts", str(prompts), "--max-new-tokens", "8",
               "--k", "2", "--drafter", "model,prompt_lookup", "--no-tree", "--no-auto", "--repeats", "1",
               "--threads", "1", "--peers", "llama.cpp", "--gguf-target", str(t), "--gguf-draft", str(d),
               "--out", str(out), "--quiet"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    rows = {(p["system"], p["k"]): p for p in res["peers"]}
    assert set(rows) == {("llama.cpp", 0), ("llama.cpp spec", 2), ("llama.cpp lookup", 2)}
    assert rows[("llama.cpp spec", 2)]["identical_to_own_target_only"] is True  # ran past, same prefix
    assert rows[("llama.cpp lookup", 2)]["identical_to_own_target_only"] is False
    assert rows[("llama.cpp lookup", 2)]["first_divergence"] == {"prompt": 0, "byte": 10}
    spec = rows[("llama.cpp spec", 2)]
    assert (spec["drafted"], spec["accepted"]) == (2 * 27, 2 * 11) and spec["alpha"] == pytest.approx(11 / 27)
    assert spec["decode_tokens_per_second"] == pytest.approx(19 / 20.86)
    # ours / theirs at the same configuration, theirs over their own target-only
    assert spec["ours_same_k_over_peer"] > 0 and spec["ours_best_over_peer"] > 0
    assert rows[("llama.cpp", 0)]["speedup_over_own_target_only"] == pytest.approx(1.0)
    assert spec["speedup_over_own_target_only"] == pytest.approx(
        spec["tokens_per_second"] / rows[("llama.cpp", 0)]["tokens_per_second"])
    details = res["llama_cpp"]
    assert details["time_curve"]["S"] == [1, 2, 4] and details["time_curve"]["ratio"][0] == 1.0
    assert details["target_gguf"] == str(t) and len(details["runs"]) == 2 * 3
    md = (out / "results.md").read_text()
    assert "| llama.cpp spec | 2 |" in md and "output == its own plain decode" in md
    assert "| llama.cpp | " in md and (out / "peers.png").is_file()

    calls = [json.loads(line) for line in fake_tools["log"].read_text().splitlines()]
    by_tool = {c[0]: c[1:] for c in calls}
    plain = by_tool["llama-completion"]
    for flag in ("--no-escape", "-no-cnv", "--no-display-prompt", "--ignore-eos", "-sp"):
        assert flag in plain
    assert plain[plain.index("-n") + 1] == "8" and plain[plain.index("-t") + 1] == "1"
    assert plain[plain.index("--temp") + 1] == "0" and plain[plain.index("--top-k") + 1] == "1"
    spec_args = by_tool["llama-speculative-simple"]
    assert spec_args[spec_args.index("-md") + 1] == str(d) and spec_args[spec_args.index("-n") + 1] == "7"
    assert spec_args[spec_args.index("--spec-draft-n-max") + 1] == "2"
    bench = by_tool["llama-bench"]
    assert bench[bench.index("-d") + 1] == "128" and bench[bench.index("-n") + 1] == "0"


# --------------------------------------------------------------------------------------------
# the real tools
# --------------------------------------------------------------------------------------------

REAL_GGUF = Path(os.environ.get("SPECDEC_TEST_GGUF",
                                "/root/.cache/real-checkpoints/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))


def test_real_tools_agree_with_themselves():
    try:
        tools = L.find_tools()
    except L.LlamaCppUnavailable as e:
        pytest.skip(str(e))
    if not REAL_GGUF.is_file():
        pytest.skip(f"no GGUF to run llama.cpp on ({REAL_GGUF}; set SPECDEC_TEST_GGUF)")
    prompt = "<|im_start|>user\nCount from 1 to 20, comma separated.<|im_end|>\n<|im_start|>assistant\n"
    plain = L.run_config(tools["plain"], REAL_GGUF, prompt, 8, kind="plain", threads=1, ctx=256)
    spec = L.run_config(tools["draft"], REAL_GGUF, prompt, 8, kind="draft", k=3, draft=REAL_GGUF, threads=1,
                        ctx=256)
    assert plain.generated == 8 and spec.generated >= 8
    assert plain.timings["decode_tokens_per_second"] > 0 and spec.timings["drafted"] > 0
    assert spec.timings["accepted"] > 0  # the target drafting for itself
    curve = L.time_curve(tools["bench"], REAL_GGUF, (1, 2), threads=1, depth=16, repeats=1)
    assert curve["S"] == [1, 2] and curve["ratio"][0] == 1.0


def test_spec_bench_systems_share_the_plain_decode(fake_tools, tmp_path):
    """--suite spec-bench: llama.cpp's systems compare token lists, so a speculative run whose text
    starts with the plain text carries the plain run's list, and each keeps llama.cpp's own rate."""
    from types import SimpleNamespace

    from specdec_rt.bench.spec_bench import Question, SpecBenchConfig

    t = tmp_path / "t.gguf"
    t.write_bytes(b"GGUF")
    manifest = {"models": {"target": {"source": {"format": "gguf", "path": str(t)}},
                           "draft": {"source": {"format": "gguf", "path": str(t)}}}}
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=True: [ord(c) for c in text])
    gen = SimpleNamespace(bundle=SimpleNamespace(manifest=manifest), max_length=256, tokenizer=tokenizer)
    cfg = SpecBenchConfig(bundle="b", questions="q", peer_ks=[3], threads=1)
    systems = LP.spec_bench_systems(cfg, gen)
    assert [s.name for s in systems] == ["llama.cpp target-only", "llama.cpp spec K=3", "llama.cpp lookup K=3"]
    assert [s.is_base for s in systems] == [True, False, False] and {s.family for s in systems} == {"llama.cpp"}
    q = Question(1, "writing", "hi")
    plain, spec, lookup = (s.run(q, [1, 2], "<prompt>", 16) for s in systems)
    assert plain.tokens == [ord(c) for c in "Title: a trip"]
    assert spec.tokens == plain.tokens  # "Title: a trip, and more": ran past the budget, same text
    assert lookup.tokens != plain.tokens  # "Title: a tour"
    assert (spec.proposed, spec.accepted) == (27, 11)
    assert len(plain.tokens) / plain.seconds == pytest.approx(16 / (1.6605 + 1.93412))
    assert (lookup.proposed, lookup.accepted) == (0, 0) and plain.ttft == pytest.approx(1.6605)


def test_tools_run_with_openmps_default_wait_policy_unless_one_is_named(monkeypatch):
    """An OMP_WAIT_POLICY left in the environment (PASSIVE slows llama.cpp 1.4x on an idle
    machine) is not passed to the tools; --peer-omp-wait-policy sets one on purpose."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "OMP_WAIT_POLICY" not in L.tool_environment()
    assert L.tool_environment("active")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert L.tool_environment()["PATH"] == os.environ["PATH"]


def test_grounded_suite_runs_llama_cpp_stopping_at_eos(fake_tools, tmp_path, monkeypatch):
    """--suite grounded: llama.cpp's tools run without --ignore-eos (answers end at EOS as users
    run them), with OpenMP's default wait policy, and the results say so."""
    from types import SimpleNamespace

    from specdec_rt.bench.spec_bench import Question, SpecBenchConfig

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    t = tmp_path / "t.gguf"
    t.write_bytes(b"GGUF")
    manifest = {"models": {"target": {"source": {"format": "gguf", "path": str(t)}}}}
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=True: [ord(c) for c in text])
    gen = SimpleNamespace(bundle=SimpleNamespace(manifest=manifest), max_length=256, tokenizer=tokenizer)
    cfg = SpecBenchConfig(bundle="b", questions="q", peer_ks=[3], threads=1, stop_at_eos=True)
    for system in LP.spec_bench_systems(cfg, gen):
        system.run(Question(1, "edit", "hi"), [1, 2], "<prompt>", 16)
    calls = [json.loads(line) for line in fake_tools["log"].read_text().splitlines()]
    assert calls and all("--ignore-eos" not in c for c in calls)
    policies = [json.loads(line) for line in Path(str(fake_tools["log"]) + ".omp").read_text().splitlines()]
    assert policies == [None] * len(calls)  # the caller's PASSIVE was not passed on
    plan = LP.plan(SimpleNamespace(ks=[3], threads=1, peer_omp_wait_policy="passive"), manifest, 256)
    assert plan.omp_wait_policy == "passive" and plan.ignore_eos
