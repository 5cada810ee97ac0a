"""llama.cpp as a benchmark peer: run its own command-line tools on GGUF files and parse them.

Three decoding configurations per prompt, all greedy (``--temp 0 --top-k 1``), EOS ignored as in
our runs, the prompt text passed verbatim (``-f`` file, ``--no-escape``; ``-no-cnv`` so
llama-completion applies no chat template of its own):

``target-only``  llama-completion (llama-cli in older trees)
``draft K``      llama-speculative-simple (or llama-speculative): the draft GGUF proposes K tokens
``lookup K``     llama-lookup: n-gram lookup in the prompt and the text so far drafts up to K

Speed is llama.cpp's own accounting (its timing printout: prompt-eval and decode tokens per second,
model load excluded), acceptance its drafted/accepted counters. Identity is text against its own
target-only decode of the same prompt: the speculative tools stop only once they passed the token
budget (a step can overshoot by up to K), so they are asked for at least as many tokens and their
text must *start with* the target-only text. The verify cost curve T(S) comes from llama-bench
(prompt processing of S tokens after a ``depth`` token context).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from specdec_rt.bench.common import PeerUnavailable
from specdec_rt.errors import BackendUnavailableError

__all__ = ["ENV_VAR", "BUILD_SCRIPT", "TOOLS", "LlamaCppUnavailable", "LlamaCppError", "LlamaRun",
           "find_tool", "find_tools", "parse_timings", "parse_generated", "parse_bench_json",
           "run_config", "time_curve", "DEFAULT_SIZES"]

ENV_VAR = "LLAMA_CPP_BIN"
BUILD_SCRIPT = "scripts/build_llama_cpp.sh"
# where scripts/build_llama_cpp.sh installs by default: searched last, so a fresh build just works
DEFAULT_BIN = Path("~/.cache/specdec-rt/llama.cpp/bin")
# tool role -> binary names, preferred first (names moved between llama.cpp releases)
TOOLS: dict[str, tuple[str, ...]] = {
    "plain": ("llama-completion", "llama-cli"),
    "draft": ("llama-speculative-simple", "llama-speculative"),
    "lookup": ("llama-lookup",),
    "bench": ("llama-bench",),
}
DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16)


class LlamaCppUnavailable(PeerUnavailable, BackendUnavailableError):
    """llama.cpp's tools are not installed here (a peer that cannot run, and a one-line CLI error)."""


class LlamaCppError(RuntimeError):
    """A llama.cpp tool failed or printed something this parser does not recognise."""


# --------------------------------------------------------------------------------------------
# finding the binaries
# --------------------------------------------------------------------------------------------

def _search_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get(ENV_VAR)
    if env:
        dirs.append(Path(env).expanduser())
    return dirs


def find_tool(role: str) -> Path:
    """The first of ``TOOLS[role]`` found in ``$LLAMA_CPP_BIN``, on ``PATH``, or in the build
    script's default folder; :class:`LlamaCppUnavailable` names all three and the build script."""
    names = TOOLS[role]
    for name in names:
        for d in _search_dirs():
            if (d / name).is_file() and os.access(d / name, os.X_OK):
                return d / name
        found = shutil.which(name)
        if found:
            return Path(found)
        default = DEFAULT_BIN.expanduser() / name
        if default.is_file() and os.access(default, os.X_OK):
            return default
    env = os.environ.get(ENV_VAR)
    where = f"${ENV_VAR} ({env})" if env else f"${ENV_VAR} (unset)"
    raise LlamaCppUnavailable(
        f"llama.cpp's {' / '.join(names)} not found in {where}, on PATH, or in {DEFAULT_BIN}: build the "
        f"tools with `bash {BUILD_SCRIPT} [DEST]` and point ${ENV_VAR} at DEST/bin")


def find_tools(roles: Sequence[str] = tuple(TOOLS)) -> dict[str, Path]:
    """Every tool the peer needs, so a missing one fails before any run starts."""
    return {role: find_tool(role) for role in roles}


# --------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------

_NUM = r"([0-9]+(?:\.[0-9]*)?|inf|nan|-nan)"
_PROMPT_EVAL = re.compile(r"prompt eval time\s*=\s*" + _NUM + r"\s*ms\s*/\s*(\d+)\s*tokens")
_EVAL = re.compile(r"(?<!prompt )\beval time\s*=\s*" + _NUM + r"\s*ms\s*/\s*(\d+)\s*runs")
_SPEC_LINE = re.compile(r"\b(encoded|decoded)\s+(\d+)\s+tokens in\s+" + _NUM + r"\s*seconds")
# "n_drafted = 27" at the end of a log line (after llama.cpp's timestamp and level prefix)
_COUNTER = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.M)


def _float(s: str) -> float:
    return float(s) if s not in ("nan", "-nan") else float("nan")


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def parse_timings(log: str) -> dict:
    """llama.cpp's own timing and speculation counters from a tool's log (stderr).

    The speculative tools (llama-speculative[-simple], llama-lookup) print ``encoded N tokens in T
    seconds`` (the prompt, through both models for a draft model) and ``decoded N tokens in T
    seconds`` (the generation loop, drafting and verification, wall clock): those are used when
    present, since their target's ``prompt eval time`` also counts every multi-token verify call.
    llama-completion has only its ``prompt eval time`` and ``eval time`` (one decode call per
    token after the first). Rates are recomputed from counts and times (llama-lookup's printed
    prompt speed counts the generated tokens too). ``drafted`` / ``accepted``: ``n_drafted`` /
    ``n_accept``; ``generated``: ``n_predict``.
    """
    out: dict = {}
    spec = {kind: (int(n), _float(s)) for kind, n, s in _SPEC_LINE.findall(log)}
    prompts = _PROMPT_EVAL.findall(log)
    evals = _EVAL.findall(log)
    if "encoded" in spec:
        out["prompt_tokens"], out["prompt_seconds"] = spec["encoded"]
    elif prompts:
        ms, n = prompts[-1]
        out["prompt_tokens"], out["prompt_seconds"] = int(n), _float(ms) / 1e3
    if "decoded" in spec:
        out["decode_tokens"], out["decode_seconds"] = spec["decoded"]
    elif evals:
        ms, n = evals[-1]
        out["decode_tokens"], out["decode_seconds"] = int(n), _float(ms) / 1e3
    else:
        raise LlamaCppError("no decode timing (`decoded N tokens in` / `eval time =`) in llama.cpp's log:\n"
                            + log[-2000:])
    counters = {k: int(v) for k, v in _COUNTER.findall(log)}
    if "n_drafted" in counters:
        out["drafted"] = counters["n_drafted"]
        out["accepted"] = counters.get("n_accept", 0)
    if "n_predict" in counters:
        out["generated"] = counters["n_predict"]
    elif "decoded" not in spec:  # llama-completion: the first token comes from the prompt's logits
        out["generated"] = out["decode_tokens"] + 1
    if "n_draft" in counters:
        out["draft_max"] = counters["n_draft"]
    out["decode_tokens_per_second"] = _rate(out["decode_tokens"], out["decode_seconds"])
    if "prompt_tokens" in out:
        out["prompt_tokens_per_second"] = _rate(out["prompt_tokens"], out["prompt_seconds"])
    return out


def parse_generated(stdout: bytes, prompt: str, echoes_prompt: bool) -> bytes:
    """The generated bytes from a tool's stdout.

    llama-completion (``--no-display-prompt``) prints the generated text then a blank line; the
    speculative tools print a blank line, the prompt (token by token: the same bytes here), the
    generated text and a blank line. Bytes, not text: a token can end inside a UTF-8 character.
    """
    text = stdout
    if echoes_prompt:
        head = b"\n\n" + prompt.encode()
        if not text.startswith(head):
            raise LlamaCppError("llama.cpp did not echo the prompt as expected; its output starts with "
                                f"{text[:200]!r}")
        text = text[len(head):]
    # what each tool prints after the generated text: exactly this, whatever the text ends with
    tail = b"\n\n\n\n" if echoes_prompt else b"\n\n"
    if not text.endswith(tail):
        raise LlamaCppError(f"llama.cpp's output does not end with its blank line(s): ...{text[-200:]!r}")
    return text[: -len(tail)]


def parse_bench_json(stdout: str, key: str = "avg_ns") -> dict[int, float]:
    """``llama-bench -o json``: seconds per prompt-processing test (``key``: its mean, or
    ``stddev_ns`` for the spread over repeats), by its size S."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise LlamaCppError(f"llama-bench did not print JSON ({e}): {stdout[:500]!r}") from None
    out = {}
    for t in tests:
        if int(t.get("n_gen", 0)) == 0 and int(t.get("n_prompt", 0)) > 0:
            out[int(t["n_prompt"])] = float(t.get(key, "nan")) / 1e9
    if not out:
        raise LlamaCppError("llama-bench printed no prompt-processing tests")
    return out


# --------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------

@dataclass
class LlamaRun:
    """One tool run on one prompt: llama.cpp's own numbers plus the generated text."""

    config: str  # "target-only", "draft K=4", "lookup K=4"
    tool: str  # the binary's name
    k: int  # draft length asked for (0: target-only)
    text: bytes  # generated text only
    timings: dict  # parse_timings
    wall_seconds: float  # the whole process, model load included (not a speed: context only)
    command: list[str] = field(default_factory=list)

    @property
    def generated(self) -> int:
        """Tokens generated (a speculative tool may pass the budget by up to K)."""
        return int(self.timings["generated"])

    @property
    def seconds(self) -> float:
        """Prompt evaluation plus decoding, llama.cpp's accounting (model load excluded): what our
        runs time too, so tokens / seconds compares with our tok/s."""
        return self.timings.get("prompt_seconds", 0.0) + self.timings["decode_seconds"]

    def summary(self) -> dict:
        """JSON-ready: the text decoded (invalid UTF-8 at a cut replaced), no bytes."""
        d = asdict(self)
        d["text"] = self.text.decode("utf-8", errors="replace")
        return d


def _base_args(model: Path, prompt_file: Path, n: int, threads: int, seed: int, ctx: int,
               ignore_eos: bool = True) -> list[str]:
    # greedy and verbatim: no escapes processed, EOS ignored where ours ignores it, explicit threads
    args = ["-m", str(model), "-f", str(prompt_file), "--no-escape", "-n", str(n), "-c", str(ctx),
            "--temp", "0", "--top-k", "1", "-s", str(seed), "-t", str(threads)]
    return args + ["--ignore-eos"] if ignore_eos else args


def tool_environment(omp_wait_policy: str | None = None) -> dict[str, str]:
    """The environment llama.cpp's tools run in: OpenMP's default wait policy unless one is named
    (an ``OMP_WAIT_POLICY`` left in the caller's environment is dropped: PASSIVE waits cost the
    tools 1.4x in decoding on an idle 2-core machine, which is not how users run them)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    return env


def run_config(tool: Path, model, prompt: str, max_new_tokens: int, *, kind: str, k: int = 0, draft=None,
               threads: int = 2, seed: int = 0, ctx: int = 4096, timeout: float | None = 600,
               ignore_eos: bool = True, omp_wait_policy: str | None = None) -> LlamaRun:
    """Run one configuration (``kind`` "plain", "draft" or "lookup") on one prompt.

    The speculative tools stop once they *passed* their budget, so they get ``max_new_tokens - 1``
    and emit at least ``max_new_tokens`` (llama-speculative-simple: exactly that many).
    ``ignore_eos=False``: stop at the model's end of generation, as users run it;
    ``omp_wait_policy``: :func:`tool_environment`.
    """
    if kind not in ("plain", "draft", "lookup"):
        raise ValueError(f"unknown llama.cpp configuration {kind!r}")
    if kind == "draft" and draft is None:
        raise ValueError("the draft configuration needs a draft GGUF")
    n = max_new_tokens if kind == "plain" else max(1, max_new_tokens - 1)
    with tempfile.TemporaryDirectory(prefix="specdec-llama-") as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        # -f drops one trailing newline of the file: add one, so the prompt's own is kept
        prompt_file.write_bytes(prompt.encode() + b"\n")
        cmd = [str(tool)] + _base_args(Path(model), prompt_file, n, threads, seed, ctx, ignore_eos)
        if kind == "plain":
            # no chat template of its own, no prompt echo, special tokens printed as the other tools do
            cmd += ["-no-cnv", "--no-display-prompt", "-sp"]
        else:
            cmd += ["--spec-draft-n-max", str(k)]
            if kind == "draft":
                # this tree's speculative-simple needs the type named; p-min 0: always K tokens
                cmd += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-p-min", "0"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env=tool_environment(omp_wait_policy))
        wall = time.perf_counter() - t0
    log = proc.stderr.decode("utf-8", errors="replace")
    if proc.returncode != 0:
        raise LlamaCppError(f"{tool.name} failed (exit {proc.returncode}): {' '.join(cmd)}\n{log[-3000:]}")
    text = parse_generated(proc.stdout, prompt, echoes_prompt=kind != "plain")
    config = "target-only" if kind == "plain" else f"{kind} K={k}"
    return LlamaRun(config=config, tool=tool.name, k=k, text=text, timings=parse_timings(log),
                    wall_seconds=wall, command=cmd)


def time_curve(tool: Path, model, sizes: Sequence[int] = DEFAULT_SIZES, *, threads: int = 2, depth: int = 128,
               repeats: int = 3, timeout: float | None = 600, omp_wait_policy: str | None = None) -> dict:
    """T(S) with llama-bench: S tokens evaluated in one call after ``depth`` tokens of context
    (ours is measured after 128 past tokens too), ``repeats`` times each."""
    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] != 1:
        sizes = [1] + [s for s in sizes if s > 1]
    cmd = [str(tool), "-m", str(model), "-p", ",".join(map(str, sizes)), "-n", "0", "-t", str(threads),
           "-r", str(repeats), "-o", "json"]
    if depth:
        cmd += ["-d", str(depth)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env=tool_environment(omp_wait_policy))
    if proc.returncode != 0:
        raise LlamaCppError(f"llama-bench failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    seconds = parse_bench_json(proc.stdout)
    if 1 not in seconds:
        raise LlamaCppError(f"llama-bench reported no S=1 test: {sorted(seconds)}")
    sizes, t1 = sorted(seconds), seconds[1]
    spread = parse_bench_json(proc.stdout, "stddev_ns")
    return {"S": sizes, "seconds": [seconds[s] for s in sizes], "ratio": [seconds[s] / t1 for s in sizes],
            "stddev_seconds": [spread[s] for s in sizes],
            "depth": depth, "repeats": repeats, "threads": threads, "command": cmd}

