"""``specdec-bench --batch``: total throughput of B concurrent prompts, speculative vs target-only.

For each batch size B the same request list (the prompts, cycled to ``requests`` entries) runs
through :meth:`Generator.generate_batch` with ``batch_size=B`` (continuous batching: a finished
row's sequence goes to the next waiting request), once target-only and once per speculative
configuration, interleaved (round robin over B and configuration within each repeat), so drift
on a shared machine hits every figure alike. Throughput is total new tokens over time, prefills
included (each newcomer's prefill is its own call while the others wait); decode-only throughput
leaves out the prefills (measured by the same run with one new token per request) and the first
tokens they produce. Time is elapsed time, or with ``clock="cpu"`` (single-threaded runs) this
process's CPU time, which other users of a shared machine do not inflate. Greedy outputs are compared token for token with one-at-a-time
target-only decoding.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class BatchBenchConfig:
    bundle: str
    prompts: list[str]
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    ks: list[int] = field(default_factory=lambda: [1, 2, 4])
    auto: bool = True
    drafters: list[str] = field(default_factory=lambda: ["model"])
    max_new_tokens: int = 64
    requests: int | None = None  # default: twice the largest batch, at least one per prompt
    repeats: int = 1
    threads: int | None = None
    progress: bool = True
    # "wall": elapsed time (what a user sees); "cpu": this process's CPU time, for single-threaded
    # runs on a shared machine, where other users' load distorts elapsed time but not CPU time
    clock: str = "wall"


def _configs(cfg: BatchBenchConfig, has_draft: bool) -> list[tuple[str, str | None, int | str]]:
    out = [("target-only", None, 0)]
    for drafter in cfg.drafters:
        if drafter == "model" and not has_draft:
            continue
        out += [(f"{drafter} K={k}", drafter, k) for k in cfg.ks]
        if cfg.auto:
            out.append((f"{drafter} K=auto", drafter, "auto"))
    return out


def run_batch_bench(cfg: BatchBenchConfig) -> dict:
    import specdec_rt
    from specdec_rt.bench.common import machine_description

    from specdec_rt.errors import GenerationInputError

    if cfg.clock not in ("wall", "cpu"):
        raise GenerationInputError(f"clock must be 'wall' or 'cpu', not {cfg.clock!r}")
    if cfg.clock == "cpu" and cfg.threads != 1:
        raise GenerationInputError("CPU time stands for elapsed time only in single-threaded runs: pass --threads 1")
    clock = time.process_time if cfg.clock == "cpu" else time.perf_counter
    gen = specdec_rt.load(cfg.bundle, threads=cfg.threads, shared_thread_pool=True, max_batch=max(cfg.batches),
                          prefix_cache=False)
    gen.policies.clock = clock  # the cost surface K=auto decides from, measured with the same clock
    prompts = [gen.tokenizer.encode(p) for p in cfg.prompts]
    limit = gen.max_length - cfg.max_new_tokens - 1
    prompts = [p[-limit:] for p in prompts]
    n_req = cfg.requests or max(len(prompts), 2 * max(cfg.batches))
    requests = [prompts[i % len(prompts)] for i in range(n_req)]
    configs = _configs(cfg, gen.draft_engine is not None)
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, ignore_eos=True)

    # reference outputs (one at a time, target-only) and the T(B, S) surface ("auto" measures it)
    reference = {}
    for i, p in enumerate(prompts):
        reference[i] = gen.generate_ids(p, drafter=None, **kwargs)
    for name, drafter, k in configs:  # warm-up, and the cost surface up to the widest batch
        gen.generate_batch(requests[: max(cfg.batches)], **{**kwargs, "max_new_tokens": 4},
                           batch_size=max(cfg.batches), drafter=drafter, num_draft_tokens=k)

    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.repeats * len(cfg.batches) * len(configs), desc="batch bench", unit="run")
    acc: dict[tuple[int, str], dict] = {}
    for _ in range(cfg.repeats):
        for b in cfg.batches:
            for name, drafter, k in configs:
                t0 = clock()
                results = gen.generate_batch(requests, batch_size=b, drafter=drafter, num_draft_tokens=k, **kwargs)
                wall = clock() - t0
                st = gen.last_batch_stats
                # prefills run as their own calls, one after another: their time, on this clock
                t1 = clock()
                gen.generate_batch(requests, batch_size=b, drafter=drafter, num_draft_tokens=k,
                                   **{**kwargs, "max_new_tokens": 1})
                prefill = clock() - t1
                a = acc.setdefault((b, name), {"seconds": 0.0, "prefill": 0.0, "tokens": 0, "identical": True,
                                               "steps": 0, "row_steps": 0, "ks": [], "proposed": 0, "requests": 0,
                                               "accepted": 0, "drafter": drafter, "k": k})
                a["seconds"] += wall
                a["prefill"] += prefill
                a["tokens"] += st.new_tokens
                a["requests"] += len(results)  # first tokens, which come from the prefills
                a["steps"] += st.steps
                a["row_steps"] += st.row_steps
                a["ks"] += st.ks
                a["proposed"] += sum(r.stats.proposed for r in results)
                a["accepted"] += sum(r.stats.accepted for r in results)
                a["identical"] &= all(r.token_ids == reference[i % len(prompts)] for i, r in enumerate(results))
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()

    rows = []
    for (b, name), a in acc.items():
        tps = a["tokens"] / a["seconds"]
        decode = a["seconds"] - a["prefill"]
        rows.append({
            "batch": b, "name": name, "drafter": a["drafter"], "k": a["k"],
            "tokens_per_second": tps,
            "decode_tokens_per_second": (a["tokens"] - a["requests"]) / decode if decode > 0 else None,
            "mean_width": a["row_steps"] / a["steps"] if a["steps"] else 0.0,
            "mean_k": float(np.mean(a["ks"])) if a["ks"] else 0.0,
            "alpha": a["accepted"] / a["proposed"] if a["proposed"] else None,
            "identical_to_target_only": a["identical"],
        })
    by = {(r["batch"], r["name"]): r for r in rows}
    for r in rows:
        base = by[(r["batch"], "target-only")]
        r["decode_speedup_vs_target_only"] = (r["decode_tokens_per_second"] / base["decode_tokens_per_second"]
                                              if r["decode_tokens_per_second"] and base["decode_tokens_per_second"]
                                              else None)
        r["speedup_vs_target_only"] = r["tokens_per_second"] / base["tokens_per_second"]
        one = by.get((1, r["name"]))
        r["throughput_vs_b1"] = r["tokens_per_second"] / one["tokens_per_second"] if one else None
    rows.sort(key=lambda r: (r["batch"], [c[0] for c in configs].index(r["name"])))

    cost = gen.policies.cost_model
    surface = {}
    if cost is not None:
        surface = {"1": {"target": cost.target_times, "draft_step": cost.draft_step}}
        surface.update({str(b): {"target": t, "draft_step": d} for b, (t, d) in sorted(cost.widths.items())})
    results = {
        "command": None,
        "machine": machine_description(),
        "bundle": str(cfg.bundle),
        "settings": {"batches": cfg.batches, "max_new_tokens": cfg.max_new_tokens, "prompts": len(prompts),
                     "requests": n_req, "repeats": cfg.repeats, "threads": cfg.threads, "clock": cfg.clock},
        "target_min_rows": getattr(gen.target, "min_rows", 1),
        "batch_calls": getattr(gen.target, "batch_calls", False),
        "cost_surface": surface,
        "rows": rows,
    }
    results["goals"] = goals(results)
    return results


def goals(results: dict) -> dict:
    """The issue's goals at the widest batch: total throughput >= 3x the B = 1 speculative figure,
    and speculation >= 1.2x batched target-only; each for total throughput (prefills included,
    as the goals are stated) and for decoding alone."""
    rows = results["rows"]
    widest = max(r["batch"] for r in rows)
    spec = [r for r in rows if r["drafter"] is not None]
    if not spec or widest == 1:
        return {}
    out = {"batch": widest}
    for key, label in (("tokens_per_second", "total"), ("decode_tokens_per_second", "decode")):
        best_b1 = max((r for r in spec if r["batch"] == 1), key=lambda r: r[key] or 0.0, default=None)
        best_wide = max((r for r in spec if r["batch"] == widest), key=lambda r: r[key] or 0.0)
        auto_wide = next((r for r in spec if r["batch"] == widest and r["k"] == "auto"), None)
        base_wide = next(r for r in rows if r["batch"] == widest and r["drafter"] is None)
        if not best_wide[key] or not base_wide[key]:
            continue  # decode time not resolved (tiny models: prefill-dominated runs)
        g = {"best_spec": best_wide["name"]}
        if best_b1 is not None and best_b1[key]:
            g["vs_best_b1_spec"] = best_wide[key] / best_b1[key]
            g["throughput_goal_met"] = g["vs_best_b1_spec"] >= 3.0
        g["best_spec_vs_target_only"] = best_wide[key] / base_wide[key]
        g["speedup_goal_met"] = g["best_spec_vs_target_only"] >= 1.2
        if auto_wide is not None:
            g["auto_vs_target_only"] = (auto_wide[key] or 0.0) / base_wide[key]
            g["auto_mean_k"] = auto_wide["mean_k"]
        out[label] = g
    return out


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, onnxruntime {m['onnxruntime']}, Python {m['python']}.",
        f"Settings: {results['settings']}.",
        "",
        "| B | configuration | total tok/s | vs target-only at B | vs same at B=1 | decode tok/s | decode vs target-only | mean width | mean K | alpha | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda x, fmt="{:.2f}": "-" if x is None else fmt.format(x)  # noqa: E731
    for r in results["rows"]:
        lines.append(
            f"| {r['batch']} | {r['name']} | {r['tokens_per_second']:.1f} | {r['speedup_vs_target_only']:.2f}x | "
            f"{f(r['throughput_vs_b1'])}x | {f(r['decode_tokens_per_second'], '{:.1f}')} | "
            f"{f(r['decode_speedup_vs_target_only'])}x | {r['mean_width']:.2f} | "
            f"{r['mean_k']:.2f} | {f(r['alpha'])} | {'yes' if r['identical_to_target_only'] else 'NO'} |")
    goal = results.get("goals") or {}
    for label in ("total", "decode"):
        g = goal.get(label)
        if not g:
            continue
        lines += ["", f"Goals at B = {goal['batch']}, {label} throughput: best configuration ({g['best_spec']}) "
                      f"{f(g.get('vs_best_b1_spec'))}x the best B = 1 speculative figure (goal 3x: "
                      f"{'met' if g.get('throughput_goal_met') else 'not met'}); "
                      f"{g['best_spec_vs_target_only']:.2f}x batched target-only (goal 1.2x: "
                      f"{'met' if g['speedup_goal_met'] else 'not met'})"
                      + (f"; K=auto {g['auto_vs_target_only']:.2f}x at mean K {g['auto_mean_k']:.2f}"
                         if "auto_vs_target_only" in g else "") + "."]
    surface = results.get("cost_surface") or {}
    if surface:
        t11 = surface["1"]["target"][0]
        lines += ["", "Measured T(B, S) / T(1, 1) (what K=auto decides from) and draft step c(B) / T(1, 1):", "",
                  "| B | " + " | ".join(f"S={s}" for s in (1, 2, 3, 5, 9, 13)) + " | c(B) |",
                  "|---|" + "---|" * 7]
        for b, v in surface.items():
            t = v["target"]
            lines.append(f"| {b} | " + " | ".join(f"{t[s - 1] / t11:.2f}" if s <= len(t) else "-"
                                                 for s in (1, 2, 3, 5, 9, 13)) + f" | {v['draft_step'] / t11:.3f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, name in enumerate(names):
        pts = sorted((r["batch"], r["tokens_per_second"], r["speedup_vs_target_only"]) for r in rows if r["name"] == name)
        style = dict(color="k" if name == "target-only" else f"C{i}", label=name)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", **style)
        if name != "target-only":
            ax2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", **style)
    ax1.set_xlabel("batch size B (concurrent prompts)")
    ax1.set_ylabel("total tokens/s")
    ax1.set_xscale("log", base=2)
    ax1.legend(fontsize=7)
    ax1.set_title("Total throughput")
    ax2.axhline(1.0, color="k", lw=0.5)
    ax2.axhline(1.2, color="gray", lw=0.5, ls=":")
    ax2.set_xlabel("batch size B")
    ax2.set_ylabel("speculative / target-only at the same B")
    ax2.set_xscale("log", base=2)
    ax2.legend(fontsize=7)
    ax2.set_title("Speculation's gain at each batch size")
    fig.tight_layout()
    fig.savefig(out / "batch_throughput.png", dpi=110)
    plt.close(fig)
    return ["batch_throughput.png"]


def write(results: dict, out: Path) -> dict:
    from specdec_rt.bench.report import write_outputs

    return write_outputs(results, out, "batch_results", markdown, plot)
