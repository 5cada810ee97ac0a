"""The benchmark: our configurations interleaved with target-only decoding, plus the peers.

Every speedup is a ratio measured in one run: for each prompt and repeat, target-only decoding
and every speculative configuration run back to back (round robin), so drift on a shared machine
hits all of them alike. Greedy outputs are compared token for token with target-only.
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdec_rt.bench.common import NO_SPIN, UNPADDED, machine_description


@dataclass
class BenchConfig:
    bundle: str
    prompts: list[str]
    max_new_tokens: int = 128
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    drafters: list[str] = field(default_factory=lambda: ["model", "prompt_lookup"])
    temperature: float = 0.0
    seed: int = 0
    peers: list[str] = field(default_factory=list)
    repeats: int = 2
    threads: int | None = None
    tree: bool = True
    tree_budgets: list[int] = field(default_factory=lambda: [7, 10, 15])
    auto: bool = True
    peer_cache: str = "out/peer-models"
    progress: bool = True
    compare_graphs: bool = False
    graphs_only: bool = False  # cost model and graph comparison, no generation runs (scale checks)
    overlap: bool = False  # also run the model drafter's chains overlapped (drafting hidden behind verify)
    clock: str = "wall"  # "cpu": this process's CPU time (single-threaded runs on a shared machine)
    gguf_target: str | None = None  # llama.cpp peer: GGUF files (default: the bundle's GGUF sources)
    gguf_draft: str | None = None
    peer_omp_wait_policy: str | None = None  # llama.cpp: None runs it with OpenMP's default


@dataclass
class RunSpec:
    name: str
    drafter: str | None
    k: int | str
    speculation: str = "chain"
    min_rows: int | None = None  # override the target's one-row padding (None: as probed)
    overlap: bool = False  # on the overlapped generator (its own non-spinning target pool)


def load_prompts(path: str | None) -> list[str]:
    """Prompts from a .jsonl file ({"prompt": ...} per line) or a text file (blank-line separated)."""
    if path is None:
        from specdec_rt.cli.demo import reference_prompts

        return [p["prompt"] for p in reference_prompts()]
    text = Path(path).read_text()
    if path.endswith(".jsonl"):
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [block for block in text.split("\n\n") if block.strip()]


def ideal_speedup(alpha: float, k: int, c: float, t_ratio: float) -> float:
    """Leviathan et al.: expected speedup of chain speculation with i.i.d. acceptance alpha."""
    if k == 0:
        return 1.0
    tokens = (k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + t_ratio)


def predicted_speedups(c: float, t_curve: list[float], alphas=(0.6, 0.7, 0.8)) -> list[dict]:
    """Best chain K and its Leviathan speedup for assumed acceptance rates, from the measured
    cost model (c, T(S)): what a pair with this cost profile would reach if the draft agreed
    that often (random-weight scale checkpoints have no meaningful acceptance of their own)."""
    t1 = t_curve[0]
    out = []
    for alpha in alphas:
        best = max(range(1, len(t_curve)), key=lambda k: ideal_speedup(alpha, k, c, t_curve[k] / t1))
        out.append({"alpha": alpha, "best_k": best,
                    "speedup": ideal_speedup(alpha, best, c, t_curve[best] / t1)})
    return out


def _specs(cfg: BenchConfig, has_draft: bool, min_rows: int = 1, has_head: bool = False) -> list[RunSpec]:
    specs = [RunSpec("target-only", None, 0)]
    if min_rows > 1:
        # where exactness pads one-row calls (int4 on x86), target-only decoding on the faster
        # one-row kernel is the honest speed baseline; the padded run stays the exactness reference
        specs.append(RunSpec(UNPADDED, None, 0, min_rows=1))
    if cfg.overlap:
        # the overlapped generator's target alone: its pool does not spin, which costs a little on
        # a quiet machine and helps on a loaded one; speedups are over the faster baseline
        specs.append(RunSpec(NO_SPIN, None, 0, overlap=True))
    for drafter in cfg.drafters:
        if (drafter == "model" and not has_draft) or (drafter == "eagle" and not has_head):
            continue
        for k in cfg.ks:
            specs.append(RunSpec(f"{drafter} K={k}", drafter, k))
        if cfg.auto:
            specs.append(RunSpec(f"{drafter} K=auto", drafter, "auto"))
        if cfg.overlap and drafter == "model":  # prompt lookup drafts in microseconds: nothing to hide
            for k in cfg.ks + (["auto"] if cfg.auto else []):
                specs.append(RunSpec(f"{drafter} K={k} overlap", drafter, k, overlap=True))
        if cfg.tree and drafter in ("model", "eagle"):
            if cfg.auto:  # the shape policy (model): its own budget, depth and width per step
                specs.append(RunSpec(f"{drafter} tree auto", drafter, "auto", "tree"))
            for budget in cfg.tree_budgets:  # tree of N nodes vs chain K = N: equal verify width
                if budget not in cfg.ks:
                    specs.append(RunSpec(f"{drafter} K={budget}", drafter, budget))
                specs.append(RunSpec(f"{drafter} tree N={budget}", drafter, budget, "tree"))
    return specs


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_bench(cfg: BenchConfig) -> dict:
    import specdec_rt
    from specdec_rt.bench import llama_cpp_peer
    from specdec_rt.runtime.policies.cost_model import measure_engine

    from specdec_rt.errors import GenerationInputError

    if cfg.clock not in ("wall", "cpu"):
        raise GenerationInputError(f"clock must be 'wall' or 'cpu', not {cfg.clock!r}")
    if cfg.clock == "cpu" and cfg.threads != 1:
        raise GenerationInputError("--clock cpu measures this process's CPU time: it needs --threads 1")
    if cfg.clock == "cpu" and cfg.overlap:
        raise GenerationInputError("--clock cpu cannot time overlapped runs (two threads): use the wall clock")
    clock = time.process_time if cfg.clock == "cpu" else time.perf_counter
    # overlapped runs need the target on its own (non-spinning) pool: that generator is made
    # first, and then the others use per-session pools too (ONNX Runtime fixes the choice of a
    # process-wide pool when its first session is created)
    gen_overlap = specdec_rt.load(cfg.bundle, threads=cfg.threads, overlap=True, prefix_cache=False) if cfg.overlap else None
    gen = specdec_rt.load(cfg.bundle, threads=cfg.threads, shared_thread_pool=not cfg.overlap,
                          prefix_cache=False)  # every configuration prefills each prompt afresh
    gen.policies.clock = clock  # the cost model "auto" decides from, measured with the same clock
    prompts = [gen.tokenizer.encode(p) for p in cfg.prompts]
    limit = gen.max_length - cfg.max_new_tokens - 1
    prompts = [p[-limit:] for p in prompts]
    if any(llama_cpp_peer.is_llama_cpp(p) for p in cfg.peers):
        # binaries and GGUF files checked now, not after our runs: a missing one is a one-line error
        llama_cpp_peer.plan(cfg, gen.bundle.manifest, gen.max_length)
    probed_rows = gen.target.min_rows
    if not gen.exact_trees:  # float32 target attention: trees are refused (not token-identical)
        cfg.tree = False
    specs = [] if cfg.graphs_only else _specs(cfg, gen.draft_engine is not None, probed_rows,
                                              gen.head is not None)

    def run(spec: RunSpec, ids: list[int], **kw) -> tuple[list[int], object]:
        g = gen_overlap if spec.overlap else gen
        with g.target.rows_padded_to(spec.min_rows):
            out = g.generate_ids(ids, drafter=spec.drafter, num_draft_tokens=spec.k,
                                 speculation=spec.speculation, overlap=spec.overlap, **kw)
        return out, g.last_stats

    # cost model: T(S) for S = 1..16 and the draft step, on a warm cache
    t_curve = measure_engine(gen.target, list(range(1, 17)), past=128, reps=7, clock=clock)
    draft_step = measure_engine(gen.draft_engine, [1], past=128, reps=15, clock=clock)[0] if gen.draft_engine else 0.0
    t1 = t_curve[0]
    # the overlapped generator's target session (no spinning) has its own curve
    t_curve_ov = (measure_engine(gen_overlap.target, list(range(1, 17)), past=128, reps=7, clock=clock)
                  if gen_overlap is not None else None)

    bar = None
    total = len(prompts) * cfg.repeats * len(specs)
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="bench", unit="run")
    # sampling stated in full: the bundle's generation_config defaults must not change a benchmark
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=0, top_p=1.0,
                  ignore_eos=True)
    for spec in specs:  # warm-up: one short run of each configuration
        run(spec, prompts[0], **{**kwargs, "max_new_tokens": 8}, seed=cfg.seed)
    acc: dict[str, dict] = {s.name: {"seconds": 0.0, "tokens": 0, "outputs": {}, "stats": []} for s in specs}
    for rep in range(cfg.repeats):
        for pi, ids in enumerate(prompts):
            for spec in specs:
                t0 = clock()
                out, stats = run(spec, ids, seed=cfg.seed + pi, **kwargs)
                dt = clock() - t0
                a = acc[spec.name]
                a["seconds"] += dt
                a["tokens"] += len(out)
                a["outputs"].setdefault(pi, out)
                a["stats"].append(stats)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    peak_rss = _rss_mb()

    base = acc.get("target-only")  # the exactness reference; None with graphs_only
    # speedups are over the fastest target-only decoding (see UNPADDED)
    speed_base = min((acc[n] for n in ("target-only", UNPADDED, NO_SPIN) if n in acc), key=lambda a: a["seconds"],
                     default=None)
    base_tps = speed_base["tokens"] / speed_base["seconds"] if speed_base else None
    c = draft_step / t1 if t1 else 0.0
    rows = []
    for spec in specs:
        a = acc[spec.name]
        stats = a["stats"]
        proposed = sum(s.proposed for s in stats)
        accepted = sum(s.accepted for s in stats)
        calls = sum(s.target_calls for s in stats)
        decoded = sum(s.new_tokens - 1 for s in stats)
        alpha = accepted / proposed if proposed else 0.0
        tau = decoded / calls if calls else 1.0
        draft_calls = sum(s.draft_calls for s in stats) / max(1, calls)
        mean_s = 1 + sum(sum(s.draft_lengths) for s in stats) / max(1, calls)
        t_ratio = float(np.interp(mean_s, np.arange(1, 17), t_curve)) / t1
        if spec.overlap and t_curve_ov is not None:  # its verify calls, in the baseline's T(1) units
            base_t1 = t_curve_ov[0] if speed_base is acc.get(NO_SPIN) else t1
            t_ratio = float(np.interp(mean_s, np.arange(1, 17), t_curve_ov)) / base_t1
        step_c = c if spec.drafter == "model" else (
            sum(s.time_draft for s in stats) / max(1, calls) / t1)
        tps = a["tokens"] / a["seconds"]
        measured = speed_base["seconds"] / a["seconds"]
        # ideal: the measured tokens per call at zero orchestration cost
        ideal = tau / (draft_calls * step_c + t_ratio) if spec.drafter == "model" else tau / (step_c + t_ratio)
        hit_rate = sum(s.lookahead_hits for s in stats) / max(1, calls) if spec.overlap else None
        if spec.overlap:  # overlapped: only steps whose look-ahead missed wait for the draft
            ideal = tau / ((1 - hit_rate) * (mean_s - 1) * step_c + t_ratio)
        if spec.drafter is None:
            ideal = 1.0
        pos_prop = np.zeros(16)
        pos_acc = np.zeros(16)
        for s in stats:
            n = min(16, len(s.per_position_proposed))
            pos_prop[:n] += s.per_position_proposed[:n]
            pos_acc[:n] += s.per_position_accepted[:n]
        decode_time = max(1e-9, sum(s.time_total - s.time_prefill for s in stats))
        # strict loop overhead: decode time outside ONNX Runtime (both models) over decode time
        overhead = sum(s.time_total - s.time_prefill - s.time_in_models for s in stats) / decode_time
        identical = None
        if cfg.temperature == 0:
            identical = all(a["outputs"][i] == base["outputs"][i] for i in base["outputs"])
        row = {
            "name": spec.name, "drafter": spec.drafter, "k": spec.k, "speculation": spec.speculation,
            "overlap": spec.overlap, "lookahead_hit_rate": hit_rate,
            "tokens_per_second": tps, "speedup": measured, "alpha": alpha,
            "tokens_per_target_call": tau, "c": c if spec.drafter == "model" else step_c,
            "t_ratio": t_ratio, "ideal_speedup": ideal,
            "efficiency": measured / ideal if ideal else None,
            "loop_overhead_share": overhead,
            "time_draft_share": sum(s.time_draft for s in stats) / a["seconds"],
            "time_verify_share": sum(s.time_verify + s.time_prefill for s in stats) / a["seconds"],
            "per_position_acceptance": [float(x / y) if y else None for x, y in zip(pos_acc, pos_prop) if y],
            "identical_to_target_only": identical,
        }
        if spec.speculation == "chain" and isinstance(spec.k, int) and spec.drafter == "model" and not spec.overlap:
            row["ideal_speedup_leviathan"] = ideal_speedup(alpha, spec.k, c, float(t_curve[spec.k]) / t1)
        rows.append(row)

    results = {
        "command": None,
        "machine": machine_description(),
        "bundle": str(cfg.bundle),
        "models": {r: {k: m.get(k) for k in ("family", "num_parameters", "num_layers", "hidden_size", "quantization")}
                   for r, m in gen.bundle.manifest["models"].items()},
        "settings": {"max_new_tokens": cfg.max_new_tokens, "prompts": len(prompts), "repeats": cfg.repeats,
                     "temperature": cfg.temperature, "threads": cfg.threads, "clock": cfg.clock,
                     "thread_pools": "per-session" if cfg.overlap else "process-wide (shared)"},
        "target_time_curve": {"S": list(range(1, 17)), "seconds": t_curve,
                              "ratio": [t / t1 for t in t_curve]},
        "target_time_curve_overlap": t_curve_ov,
        "draft_step_seconds": draft_step,
        "c": c,
        "predicted_speedup": predicted_speedups(c, t_curve) if gen.draft_engine else [],
        "target_min_rows": getattr(gen.target, "min_rows", 1),
        "peak_rss_mb": peak_rss,
        "target_only_tokens_per_second": base_tps,
        "rows": rows,
        "peers": [],
    }
    if cfg.compare_graphs:
        from specdec_rt.bench.graphs import compare_graphs
        from specdec_rt.bench.peer_runs import genai_models

        results["graphs"] = compare_graphs(gen, genai_models(cfg, gen), threads=cfg.threads)
    if cfg.peers:
        from specdec_rt.bench.peer_runs import run_peers

        extras: dict = {}
        results["peers"] = run_peers(cfg, gen, prompts, base, acc, extras)
        results.update(extras)  # "llama_cpp": its runs, texts and T(S) curve
    return results
