"""Spec-Bench: speedup per category on chat prompts, ours and the peers, in one process and run.

Spec-Bench (Xia et al. 2024) is the common yardstick of speculative decoding: 13 categories
(multi-turn chat, translation, summarization, QA, math reasoning, RAG), each reported as speedup
over target-only greedy decoding and mean accepted tokens per target call, with outputs equal to
the target's. Here every question's first turn is rendered with the bundle's chat template (as a
user of ``gen.chat`` sends it) and decoded greedily for ``max_new_tokens`` tokens (EOS ignored,
so every system decodes the same number of tokens and speedups are ratios of times).

Per prompt and repeat, every configuration runs back to back (ours, then onnxruntime-genai's, then
llama.cpp's), so drift on a shared machine lands on all of them alike. Speedups are over the
fastest target-only decoding of our own (as ``specdec-bench`` takes them); peers' rows also carry
their speed relative to their own target-only decoding and whether their outputs equal it.
"""
from __future__ import annotations

import json
import resource
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from specdec_rt.bench.common import OURS_BASE, UNPADDED, Outcome, Question, System, machine_description
from specdec_rt.errors import GenerationInputError


# the grounded suite (--suite grounded): single-turn requests whose answers copy from the prompt
GROUNDED_QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "workloads" / "grounded.jsonl"
EVERY_QUESTION = 10 ** 6  # per_category: the whole file


def grounded_title(max_new_tokens: int) -> str:
    return (f"Grounded requests (code edits, refactors, tests for given code, quoting a document): up to "
            f"{max_new_tokens} new tokens, stopping at EOS, greedy")


@dataclass
class SpecBenchConfig:
    bundle: str
    questions: str
    categories: list[str] | None = None  # None: every category in the file, in file order
    per_category: int = 2  # the first N questions of each category
    max_new_tokens: int = 128
    ks: list[int] = field(default_factory=lambda: [4])
    drafters: list[str] = field(default_factory=lambda: ["model", "prompt_lookup"])
    auto: bool = True
    tree: bool = True
    peers: list[str] = field(default_factory=list)  # "onnxruntime-genai", "llama.cpp"
    peer_ks: list[int] = field(default_factory=lambda: [4])
    repeats: int = 1
    threads: int | None = None
    peer_cache: str = "out/peer-models"
    gguf_target: str | None = None
    gguf_draft: str | None = None
    progress: bool = True
    # other bundles of the same checkpoint (e.g. its int4 export beside a w8a8 one) whose
    # target-only decoding, on its one-row kernel, joins the baselines: speedups are then over
    # the fastest target-only of any of our bundles, measured in the same run
    baseline_bundles: list[str] = field(default_factory=list)
    stop_at_eos: bool = False  # True: answers end at EOS as users run them (ours and the peers')
    peer_omp_wait_policy: str | None = None  # llama.cpp: None runs it with OpenMP's default
    title: str | None = None  # the report's heading (default: Spec-Bench's)


def load_questions(path: str, categories: list[str] | None, per_category: int) -> list[Question]:
    """The first ``per_category`` questions of each category (first turns), file order."""
    if not path:
        raise GenerationInputError("--suite spec-bench needs the path of Spec-Bench's question.jsonl")
    p = Path(path)
    if not p.is_file():
        raise GenerationInputError(f"Spec-Bench questions not found: {path} (question.jsonl of Spec-Bench)")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            rows.append(Question(int(d["question_id"]), str(d["category"]), str(d["turns"][0])))
        except (ValueError, KeyError, IndexError, TypeError):
            raise GenerationInputError(f"{path}:{n}: not a Spec-Bench question "
                                       "(needs question_id, category, turns)") from None
    known = list(dict.fromkeys(q.category for q in rows))
    wanted = categories or known
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise GenerationInputError(f"unknown Spec-Bench categories {unknown}; the file has {known}")
    if per_category < 1:
        raise GenerationInputError("--questions-per-category must be at least 1")
    picked = []
    for cat in wanted:
        picked += [q for q in rows if q.category == cat][:per_category]
    return picked


class OurSystem(System):
    def __init__(self, gen, name: str, drafter: str | None, k, speculation: str = "chain",
                 min_rows: int | None = None, family: str = "ours", ignore_eos: bool = True) -> None:
        self.gen, self.name, self.drafter, self.k, self.speculation = gen, name, drafter, k, speculation
        self.family, self.is_base, self.min_rows, self.ignore_eos = family, drafter is None, min_rows, ignore_eos

    def run(self, question, ids, text, n) -> Outcome:
        g = self.gen
        with g.target.rows_padded_to(self.min_rows):
            t0 = time.perf_counter()
            out = g.generate_ids(ids, max_new_tokens=n, temperature=0.0, ignore_eos=self.ignore_eos,
                                 drafter=self.drafter, num_draft_tokens=self.k, speculation=self.speculation)
            dt = time.perf_counter() - t0
        s = g.last_stats
        return Outcome(out, dt, ttft=s.time_prefill, target_calls=s.target_calls, proposed=s.proposed,
                       accepted=s.accepted, drafter=s.drafter)


def baseline_systems(cfg: SpecBenchConfig, questions: list[Question], prompts: list[list[int]]) -> list[System]:
    """Target-only decoding of each ``cfg.baseline_bundles`` bundle on its one-row kernel (the
    fastest way to run it; its exactness padding only matters for speculation), as a family of
    its own: its outputs are compared with its own, other weights give other tokens."""
    import specdec_rt

    systems: list[System] = []
    for path in cfg.baseline_bundles:
        other = specdec_rt.load(path, threads=cfg.threads, shared_thread_pool=True, prefix_cache=False)
        mine = [other.apply_chat_template([{"role": "user", "content": q.text}], tokenize=True) for q in questions]
        if other.bundle.chat_template is None or mine != prompts:
            raise GenerationInputError(f"--baseline-bundle {path}: its tokenizer or chat template turns the "
                                       "prompts into other tokens than the bundle's (it must be an export "
                                       "of the same checkpoint)")
        label = Path(path).name
        systems.append(OurSystem(other, f"target-only [{label}]", None, 0, min_rows=1, family=f"ours [{label}]",
                                 ignore_eos=not cfg.stop_at_eos))
    return systems


class GenaiSystem(System):
    def __init__(self, session, name: str, is_base: bool) -> None:
        self.session, self.name, self.family, self.is_base = session, name, "onnxruntime-genai", is_base

    def run(self, question, ids, text, n) -> Outcome:
        t0 = time.perf_counter()
        tokens, extra = self.session.generate(ids, n)
        return Outcome(tokens, time.perf_counter() - t0, ttft=extra.get("ttft"), proposed=extra.get("proposed"),
                       accepted=extra.get("accepted"))


def our_systems(cfg: SpecBenchConfig, gen) -> list[System]:
    eos = {"ignore_eos": not cfg.stop_at_eos}
    systems: list[System] = [OurSystem(gen, OURS_BASE, None, 0, **eos)]
    if gen.target.min_rows > 1:  # exactness pads one-row calls here: the faster baseline too
        systems.append(OurSystem(gen, UNPADDED, None, 0, min_rows=1, **eos))
    for drafter in cfg.drafters:
        if drafter == "model" and gen.draft_engine is None:
            continue
        for k in cfg.ks:
            systems.append(OurSystem(gen, f"{drafter} K={k}", drafter, k, **eos))
        if cfg.auto:
            systems.append(OurSystem(gen, f"{drafter} K=auto", drafter, "auto", **eos))
    if cfg.tree and cfg.auto and gen.draft_engine is not None and gen.exact_trees and "model" in cfg.drafters:
        systems.append(OurSystem(gen, "model tree auto", "model", "auto", "tree", **eos))
    return systems


def genai_systems(cfg: SpecBenchConfig, gen, longest: int) -> tuple[list[System], list]:
    """onnxruntime-genai's target-only and draft-model speculation, built by its own builder from
    the bundle's source checkpoints in our precision (cached in ``peer_cache``)."""
    from specdec_rt.bench import peers as P
    from specdec_rt.bench.peer_runs import genai_models

    avail = P.available_peers()
    if avail.get("ortgenai"):
        raise P.PeerUnavailable(avail["ortgenai"])
    built = genai_models(cfg, gen)
    sessions = [P.OrtGenaiSession(built["target"], longest, threads=cfg.threads)]
    systems: list[System] = [GenaiSystem(sessions[0], "onnxruntime-genai target-only", True)]
    if "draft" in built and not avail.get("ortgenai-spec"):
        for k in cfg.peer_ks:
            s = P.OrtGenaiSession(built["target"], longest, draft_genai_dir=built["draft"], num_draft_tokens=k,
                                  threads=cfg.threads)
            sessions.append(s)
            systems.append(GenaiSystem(s, f"onnxruntime-genai spec K={k}", False))
    return systems, sessions


def run_spec_bench(cfg: SpecBenchConfig) -> dict:
    import specdec_rt

    questions = load_questions(cfg.questions, cfg.categories, cfg.per_category)
    gen = specdec_rt.load(cfg.bundle, threads=cfg.threads, shared_thread_pool=True,
                          prefix_cache=False)  # every configuration prefills each prompt afresh
    if gen.bundle.chat_template is None:
        raise GenerationInputError("this bundle has no chat template: Spec-Bench prompts are chat turns "
                                   "(export an instruct checkpoint)")
    texts = [gen.apply_chat_template([{"role": "user", "content": q.text}]) for q in questions]
    prompts = [gen.apply_chat_template([{"role": "user", "content": q.text}], tokenize=True) for q in questions]
    limit = gen.max_length - cfg.max_new_tokens - 1
    too_long = [q.question_id for q, p in zip(questions, prompts) if len(p) > limit]
    if too_long:
        raise GenerationInputError(f"Spec-Bench questions {too_long} do not fit the context "
                                   f"({gen.max_length} positions with {cfg.max_new_tokens} new tokens): "
                                   "load with a larger max_context or lower --max-new-tokens")
    systems = our_systems(cfg, gen)
    systems += baseline_systems(cfg, questions, prompts)
    skipped, closers = [], []
    longest = max(len(p) for p in prompts) + cfg.max_new_tokens
    for peer in cfg.peers:
        from specdec_rt.bench import peers as P

        try:
            if peer in ("onnxruntime-genai", "ortgenai"):
                more, sessions = genai_systems(cfg, gen, longest)
                closers += sessions
            elif peer in ("llama.cpp", "llama-cpp", "llamacpp"):
                from specdec_rt.bench.llama_cpp_peer import spec_bench_systems

                more = spec_bench_systems(cfg, gen)
            else:
                raise P.PeerUnavailable(f"unknown peer {peer!r} (onnxruntime-genai, llama.cpp)")
            systems += more
        except P.PeerUnavailable as exc:
            skipped.append({"system": peer, "ran": False, "reason": str(exc)})

    for s in systems:  # warm-up: a short run of each (loads, probes, first-call allocations)
        s.run(questions[0], prompts[0], texts[0], 8)
    runs: dict[str, dict[int, list[Outcome]]] = {s.name: defaultdict(list) for s in systems}
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.repeats * len(questions) * len(systems), desc="spec-bench", unit="run")
    try:
        for _ in range(cfg.repeats):
            for qi, (q, ids, text) in enumerate(zip(questions, prompts, texts)):
                for s in systems:
                    runs[s.name][qi].append(s.run(q, ids, text, cfg.max_new_tokens))
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        for c in closers:
            c.__exit__(None, None, None)
    results = summarize(cfg, questions, prompts, systems, runs, gen, skipped,
                        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    results["title"] = cfg.title
    results["settings"]["ignore_eos"] = not cfg.stop_at_eos
    results["settings"]["llama_cpp_omp_wait_policy"] = cfg.peer_omp_wait_policy or "OpenMP's default (unset)"
    return results


def _agg(outcomes: list[Outcome]) -> dict:
    tokens = sum(len(o.tokens) for o in outcomes)
    seconds = sum(o.seconds for o in outcomes)
    calls = [o.target_calls for o in outcomes if o.target_calls is not None]
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    proposed = sum(o.proposed or 0 for o in outcomes)
    accepted = sum(o.accepted or 0 for o in outcomes)
    decoded = sum(max(0, len(o.tokens) - 1) for o in outcomes if o.target_calls is not None)
    # decoding alone (after the first token): Spec-Bench's long prompts make prefill a large share
    decode_seconds = sum(o.seconds - o.ttft for o in outcomes) if len(ttft) == len(outcomes) else None
    decode_tokens = sum(max(0, len(o.tokens) - 1) for o in outcomes)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds if seconds else None,
            "decode_seconds": decode_seconds,
            "decode_tokens_per_second": decode_tokens / decode_seconds if decode_seconds else None,
            "tokens_per_target_call": decoded / sum(calls) if calls and sum(calls) else None,
            "acceptance": accepted / proposed if proposed else None,
            "ttft_ms": 1e3 * sum(ttft) / len(ttft) if ttft else None,
            "drafters_ran": sorted({o.drafter for o in outcomes if o.drafter}) or None}


def summarize(cfg, questions, prompts, systems, runs, gen, skipped, peak_rss_mb) -> dict:
    categories = list(dict.fromkeys(q.category for q in questions))
    base_of: dict[str, str] = {}
    for s in systems:  # the first base of each family: ours is the padded exactness reference
        if s.is_base:
            base_of.setdefault(s.family, s.name)
    ours_bases = [s.name for s in systems if s.family.startswith("ours") and s.is_base]

    def rows_for(indices: list[int]) -> list[dict]:
        aggs = {s.name: _agg([o for i in indices for o in runs[s.name][i]]) for s in systems}
        fastest = min(ours_bases, key=lambda n: aggs[n]["seconds"])
        fastest_dec = min(ours_bases, key=lambda n: aggs[n]["decode_seconds"] or float("inf"))
        out = []
        for s in systems:
            a = dict(aggs[s.name])
            a["system"], a["family"] = s.name, s.family
            a["speedup"] = aggs[fastest]["seconds"] / a["seconds"] if a["seconds"] else None
            a["decode_speedup"] = (aggs[fastest_dec]["decode_seconds"] / a["decode_seconds"]
                                   if a["decode_seconds"] and aggs[fastest_dec]["decode_seconds"] else None)
            own = base_of.get(s.family)
            a["speedup_over_own_target_only"] = aggs[own]["seconds"] / a["seconds"] if own and a["seconds"] else None
            ref = runs[own] if own else None
            a["identical_to_own_target_only"] = (all(runs[s.name][i][0].tokens == ref[i][0].tokens for i in indices)
                                                 if ref is not None else None)
            a["identical_prompts"] = (sum(runs[s.name][i][0].tokens == ref[i][0].tokens for i in indices)
                                      if ref is not None else None)
            out.append(a)
        return out

    per_category = {c: rows_for([i for i, q in enumerate(questions) if q.category == c]) for c in categories}
    overall = rows_for(list(range(len(questions))))
    return {
        "suite": "spec-bench",
        "machine": machine_description(),
        "bundle": str(cfg.bundle),
        "models": {r: {k: m.get(k) for k in ("family", "num_parameters", "num_layers", "quantization", "quant_block_size")}
                   for r, m in gen.bundle.manifest["models"].items()},
        "settings": {"questions": cfg.questions, "categories": categories, "per_category": cfg.per_category,
                     "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats, "threads": cfg.threads,
                     "greedy": True, "ignore_eos": True, "target_min_rows": gen.target.min_rows},
        "prompt_tokens": {str(q.question_id): len(p) for q, p in zip(questions, prompts)},
        "peak_rss_mb": peak_rss_mb,
        "overall": overall,
        "per_category": per_category,
        "skipped": skipped,
    }


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(results: dict) -> str:
    s = results["settings"]
    title = results.get("title") or (f"Spec-Bench: {len(s['categories'])} categories x {s['per_category']} "
                                      f"questions, {s['max_new_tokens']} new tokens, greedy")
    lines = [f"# {title}", "",
             "Speedup: over our fastest target-only decoding, prompt processing included; 'own': over the same "
             "system's target-only; decode: after the first token (time to first token excluded). "
             "Identical: outputs equal to that system's own target-only decoding.", "",
             "## Overall", "",
             "| system | tok/s | speedup | own | decode tok/s | decode speedup | tokens/call | acceptance | TTFT ms | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["overall"]:
        ident = "-" if r["identical_prompts"] is None else f"{r['identical_prompts']}/{len(results['prompt_tokens'])}"
        ran = r.get("drafters_ran")
        shown = r["system"] + (f" (ran: {', '.join(ran)})" if ran and "auto" in r["system"] else "")
        lines.append(f"| {shown} | {_fmt(r['tokens_per_second'], '.1f')} | {_fmt(r['speedup'])}x | "
                     f"{_fmt(r['speedup_over_own_target_only'])}x | {_fmt(r['decode_tokens_per_second'], '.1f')} | "
                     f"{_fmt(r['decode_speedup'])}x | {_fmt(r['tokens_per_target_call'])} | "
                     f"{_fmt(r['acceptance'])} | {_fmt(r['ttft_ms'], '.0f')} | {ident} |")
    names = [r["system"] for r in results["overall"]]
    group = results.get("group_name", "category")
    lines += ["", f"## Speedup per {group} (over our fastest target-only)", "",
              f"| {group} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for cat, rows in results["per_category"].items():
        cells = []
        for r in rows:
            mark = "" if r["identical_to_own_target_only"] in (None, True) else " (differs)"
            cells.append(f"{_fmt(r['speedup'])}{mark}")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines += ["", f"## Decode speedup per {group} (time to first token excluded)", "",
              f"| {group} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for cat, rows in results["per_category"].items():
        lines.append(f"| {cat} | " + " | ".join(_fmt(r["decode_speedup"]) for r in rows) + " |")
    for sk in results.get("skipped", []):
        lines.append(f"\n{sk['system']}: not run ({sk['reason']})")
    lines.append(f"\npeak RSS of this process: {results['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cats = list(results["per_category"]) + ["overall"]
    names = [r["system"] for r in results["overall"]]
    data = {n: [next(r["speedup"] for r in results["per_category"][c] if r["system"] == n) for c in cats[:-1]]
            + [next(r["speedup"] for r in results["overall"] if r["system"] == n)] for n in names}
    fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.9), 4.5))
    width = 0.8 / max(1, len(names))
    x = np.arange(len(cats))
    for i, n in enumerate(names):
        ax.bar(x + i * width - 0.4 + width / 2, data[n], width, label=n)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over our target-only")
    ax.set_title(results.get("plot_title") or results.get("title") or "Spec-Bench per category")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results: dict, out: Path, stem: str = "spec_bench") -> dict:
    """``stem``.json, .md and .png (the per-group speedups) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    md = markdown(results)
    (out / f"{stem}.md").write_text(md + "\n")
    files = [f"{stem}.json", f"{stem}.md"]
    try:
        plot(results, out / f"{stem}.png")
        files.append(f"{stem}.png")
    except ImportError:
        pass
    return {"markdown": md, "files": files}
