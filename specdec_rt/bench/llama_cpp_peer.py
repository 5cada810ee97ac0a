"""llama.cpp beside our runs in ``specdec-bench``: which GGUF files, the runs, the rows.

Same prompt texts, ``max_new_tokens``, greedy decoding and thread count as our runs; llama.cpp's
own configurations (target-only, draft model at each K, n-gram lookup at each K) interleaved
prompt by prompt like ours, so machine drift hits them alike. Speedups are over llama.cpp's own
target-only decoding, and identity is against its own plain decode of the same prompt (its
outputs cannot be compared with ours token for token: other weights, other kernels).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from specdec_rt.bench import llama_cpp as L
from specdec_rt.bench.common import Outcome, System
from specdec_rt.errors import GenerationInputError

PEER_NAMES = ("llama.cpp", "llama-cpp", "llamacpp")
SYSTEM = {"plain": "llama.cpp", "draft": "llama.cpp spec", "lookup": "llama.cpp lookup"}


def is_llama_cpp(peer: str) -> bool:
    return peer.lower() in PEER_NAMES


def _manifest_gguf(manifest: dict, role: str) -> str | None:
    """``models[role]["source"]["path"]`` when that source record says ``format: gguf``; read
    defensively (older bundles have no record, or a checkpoint-folder one)."""
    models = manifest.get("models") if isinstance(manifest, dict) else None
    entry = models.get(role) if isinstance(models, dict) else None
    source = entry.get("source") if isinstance(entry, dict) else None
    if isinstance(source, dict) and source.get("format") == "gguf" and source.get("path"):
        return str(source["path"])
    return None


def gguf_files(manifest: dict, target: str | None = None, draft: str | None = None) -> tuple[Path, Path | None]:
    """The target and draft GGUF files: the flags, else the bundle's GGUF source records.

    A bundle with a draft needs a draft GGUF too (llama.cpp's speculative runs are the point);
    a target-only bundle runs llama.cpp's target-only and lookup configurations.
    """
    has_draft = "draft" in (manifest.get("models") or {})
    resolved: dict[str, Path | None] = {}
    for role, flag in (("target", target), ("draft", draft)):
        path = flag or _manifest_gguf(manifest, role)
        if path is None:
            if role == "draft" and not has_draft:
                resolved[role] = None
                continue
            raise GenerationInputError(
                f"--peers llama.cpp needs the {role} as a GGUF file: pass --gguf-{role} PATH (the bundle's "
                f"manifest has no GGUF source for its {role}: it was not exported from a GGUF file)")
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"llama.cpp {role} GGUF not found: {p}")
        resolved[role] = p
    return resolved["target"], resolved["draft"]


@dataclass
class LlamaCppPlan:
    """Everything the llama.cpp runs need, resolved before our own (long) runs start."""

    tools: dict[str, Path]
    target: Path
    draft: Path | None
    threads: int
    ctx: int
    ks: list[int] = field(default_factory=list)
    sizes: tuple[int, ...] = L.DEFAULT_SIZES
    depth: int = 128  # ours measures T(S) after 128 past tokens too
    bench_repeats: int = 3  # llama-bench repetitions per S
    ignore_eos: bool = True  # False: answers stop at EOS, as users run them (the grounded suite)
    omp_wait_policy: str | None = None  # None: OpenMP's default (L.tool_environment)

    def configs(self) -> list[tuple[str, int]]:
        out = [("plain", 0)]
        if self.draft is not None:
            out += [("draft", k) for k in self.ks]
        return out + [("lookup", k) for k in self.ks]


def plan(cfg, manifest: dict, max_length: int, ks: list[int] | None = None) -> LlamaCppPlan:
    """Binaries and GGUF files, or the one-line error saying what is missing (before any run)."""
    tools = L.find_tools()
    target, draft = gguf_files(manifest, getattr(cfg, "gguf_target", None), getattr(cfg, "gguf_draft", None))
    ks = [k for k in (cfg.ks if ks is None else ks) if 1 <= k <= 16]
    # headroom: the speculative tools overshoot the token budget by up to K
    ctx = int(max_length) + max(ks, default=0) + 16
    return LlamaCppPlan(tools=tools, target=target, draft=draft, threads=int(cfg.threads or os.cpu_count() or 1),
                        ctx=ctx, ks=ks, ignore_eos=not getattr(cfg, "stop_at_eos", False),
                        omp_wait_policy=getattr(cfg, "peer_omp_wait_policy", None))


def _run(plan_: LlamaCppPlan, kind: str, k: int, prompt: str, n: int, seed: int) -> L.LlamaRun:
    return L.run_config(plan_.tools[kind], plan_.target, prompt, n, kind=kind, k=k, draft=plan_.draft,
                        threads=plan_.threads, seed=seed, ctx=plan_.ctx, ignore_eos=plan_.ignore_eos,
                        omp_wait_policy=plan_.omp_wait_policy)


def _first_difference(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def same_as_plain(kind: str, text: bytes, plain: bytes) -> bool:
    """A speculative tool may run past the token budget, so its text must *start with* the plain
    decode's; repeats of the plain decode must match exactly."""
    return text == plain if kind == "plain" else text.startswith(plain)


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _row(kind: str, k: int, runs: list[L.LlamaRun], plain: dict[int, bytes], indices: list[int]) -> dict:
    tm = [r.timings for r in runs]
    generated = sum(r.generated for r in runs)
    row = {"system": SYSTEM[kind], "k": k, "tool": runs[0].tool, "ran": True,
           # the bench's tok/s: generated tokens over prompt evaluation + decoding, as ours is timed
           "tokens_per_second": _rate(generated, sum(r.seconds for r in runs)),
           "decode_tokens_per_second": _rate(sum(t["decode_tokens"] for t in tm), sum(t["decode_seconds"] for t in tm)),
           "prompt_tokens_per_second": _rate(sum(t.get("prompt_tokens", 0) for t in tm),
                                             sum(t.get("prompt_seconds", 0.0) for t in tm)),
           "generated_tokens": generated,
           "identical_to_target_only": None}  # other weights and kernels than ours: not comparable
    if kind != "plain":
        drafted = sum(t.get("drafted", 0) for t in tm)
        row["drafted"], row["accepted"] = drafted, sum(t.get("accepted", 0) for t in tm)
        row["alpha"] = row["accepted"] / drafted if drafted else None
    same = [same_as_plain(kind, r.text, plain[i]) for r, i in zip(runs, indices)]
    row["identical_to_own_target_only"] = all(same)
    if not all(same):
        j = same.index(False)
        row["first_divergence"] = {"prompt": indices[j], "byte": _first_difference(runs[j].text, plain[indices[j]])}
    return row


def run(plan_: LlamaCppPlan, prompts: list[str], max_new_tokens: int, repeats: int = 1, seed: int = 0,
        progress: bool = True) -> tuple[list[dict], dict]:
    """Every configuration on every prompt (round robin, ``repeats`` times), then llama-bench's
    T(S). Returns the peer rows and the details (texts, llama.cpp's numbers per run, the curve)."""
    configs = plan_.configs()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=repeats * len(prompts) * len(configs) + 1, desc="llama.cpp", unit="run")
    runs: dict[tuple[str, int], list[L.LlamaRun]] = {c: [] for c in configs}
    indices: dict[tuple[str, int], list[int]] = {c: [] for c in configs}
    plain: dict[int, bytes] = {}
    for _ in range(repeats):
        for pi, prompt in enumerate(prompts):
            for kind, k in configs:
                r = _run(plan_, kind, k, prompt, max_new_tokens, seed + pi)
                if kind == "plain":
                    plain.setdefault(pi, r.text)
                runs[(kind, k)].append(r)
                indices[(kind, k)].append(pi)
                if bar is not None:
                    bar.update(1)
    curve = L.time_curve(plan_.tools["bench"], plan_.target, plan_.sizes, threads=plan_.threads,
                         depth=plan_.depth, repeats=plan_.bench_repeats, omp_wait_policy=plan_.omp_wait_policy)
    if bar is not None:
        bar.update(1)
        bar.close()
    rows = [_row(kind, k, runs[(kind, k)], plain, indices[(kind, k)]) for kind, k in configs]
    base, base_decode = rows[0]["tokens_per_second"], rows[0]["decode_tokens_per_second"]
    for row in rows:
        row["speedup_over_own_target_only"] = _ratio(row["tokens_per_second"], base)
        row["decode_speedup_over_own_target_only"] = _ratio(row["decode_tokens_per_second"], base_decode)
    details = {
        "tools": {role: str(p) for role, p in plan_.tools.items()},
        "llama_cpp_python_version": _version(plan_.tools["plain"]),
        "target_gguf": str(plan_.target), "draft_gguf": str(plan_.draft) if plan_.draft else None,
        "threads": plan_.threads, "ctx": plan_.ctx,
        "timing": "llama.cpp's own printout (wall clock, model load excluded), whatever --clock says",
        "omp_wait_policy": plan_.omp_wait_policy or "OpenMP's default (unset)",
        "commands": {f"{kind} K={k}": runs[(kind, k)][0].command for kind, k in configs},
        "runs": [dict(run.summary(), prompt=i) for c in configs for run, i in zip(runs[c], indices[c])],
        "time_curve": curve,
    }
    for r in details["runs"]:
        r.pop("command", None)
    return rows, details


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _version(tool: Path) -> str | None:
    """The llama-cpp-python release whose vendored tree scripts/build_llama_cpp.sh built."""
    f = tool.parent / "LLAMA_CPP_PYTHON_VERSION"
    return f.read_text().strip() if f.is_file() else None


def compare_with_ours(rows: list[dict], acc: dict, base_tps: float | None) -> None:
    """Our best / theirs, and ours at the same configuration / theirs (target-only: our fastest
    target-only; draft K: our model drafter at K; lookup K: our prompt lookup at K)."""
    ours = {name: a["tokens"] / a["seconds"] for name, a in acc.items() if a["seconds"]}
    best = max(ours.values(), default=None)
    for row in rows:
        tps = row.get("tokens_per_second")
        if not tps:
            continue
        row["ours_best_over_peer"] = _ratio(best, tps)
        same = {"llama.cpp": base_tps, "llama.cpp spec": ours.get(f"model K={row['k']}"),
                "llama.cpp lookup": ours.get(f"prompt_lookup K={row['k']}")}.get(row["system"])
        if same:
            row["ours_same_k_over_peer"] = same / tps


# --------------------------------------------------------------------------------------------
# --suite spec-bench
# --------------------------------------------------------------------------------------------

def spec_bench_systems(cfg, gen) -> list:
    """llama.cpp's target-only, draft-model speculation and lookup at each of ``cfg.peer_ks``, as
    Spec-Bench systems (family "llama.cpp": its target-only is their reference)."""
    p = plan(cfg, gen.bundle.manifest, gen.max_length, ks=list(cfg.peer_ks))
    plain: dict[tuple[str, int], tuple[bytes, list[int]]] = {}  # (prompt, n) -> its plain decode

    class LlamaCppSystem(System):
        def __init__(self, kind: str, k: int) -> None:
            self.kind, self.k, self.family, self.is_base = kind, k, "llama.cpp", kind == "plain"
            self.name = "llama.cpp target-only" if kind == "plain" else f"{SYSTEM[kind]} K={k}"

        def run(self, question, ids, text, n) -> Outcome:
            r = _run(p, self.kind, self.k, text, n, seed=0)
            ref = plain.get((text, n))
            if self.kind == "plain":
                tokens = gen.tokenizer.encode(r.text.decode("utf-8", errors="replace"), add_special_tokens=False)
                plain[(text, n)] = (r.text, tokens)
            elif ref is not None and same_as_plain(self.kind, r.text, ref[0]):
                tokens = list(ref[1])  # the suite compares token lists: the same text, the same list
            else:  # differs: our tokens of its text, cut to the budget (cannot equal the plain list)
                tokens = gen.tokenizer.encode(r.text.decode("utf-8", errors="replace"),
                                              add_special_tokens=False)[:n]
            # llama.cpp's own rate, carried by the suite's tokens / seconds
            seconds = len(tokens) * r.seconds / max(1, r.generated)
            return Outcome(tokens, seconds, ttft=r.timings.get("prompt_seconds"),
                           proposed=r.timings.get("drafted"), accepted=r.timings.get("accepted"))

    return [LlamaCppSystem(kind, k) for kind, k in p.configs()]
