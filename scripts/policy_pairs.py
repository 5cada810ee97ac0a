"""Policy check on several model pairs: num_draft_tokens="auto" against every fixed K, and the
tree mode's shape policy (speculation="tree", num_draft_tokens="auto") against the best chain.

Builds pairs around the shipped reference target with drafts of different strength and cost
(into a cache folder outside the repository), then decodes the held-out prompts with each fixed K,
with "auto" and with tree "auto", single-threaded, timing CPU time of this process (robust to
other jobs on a shared machine), interleaved prompt by prompt. Prints and writes JSON + a
markdown table (``policy_pairs.json`` / ``.md``).

    python scripts/policy_pairs.py --cache /work/cache/pairs --out docs/bench-policy
"""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np

from specdec_rt.bench.report import write_outputs


def build_pairs(cache: Path) -> dict[str, tuple[Path, Path, dict]]:
    """name -> (target folder, draft folder, export options) for each pair."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_rt.cli.demo import reference_dir

    ref = reference_dir()
    target = ref / "target"
    pairs = {"reference": (target, ref / "draft", {})}

    def copy_tok(dst: Path) -> None:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (target / name).exists():
                shutil.copy(target / name, dst / name)

    noisy = cache / "draft-noisy"
    if not (noisy / "config.json").exists():  # the shipped draft, weakened: lower acceptance, same cost
        torch.manual_seed(11)
        m = AutoModelForCausalLM.from_pretrained(str(ref / "draft"), dtype=torch.float32)
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() >= 2:
                    p.mul_(1 + 0.25 * torch.randn_like(p))
        m.save_pretrained(str(noisy))
        copy_tok(noisy)
    pairs["weak-draft"] = (target, noisy, {})

    skip = cache / "draft-layerskip"
    if not (skip / "config.json").exists():  # the target's first 2 of 6 layers: costly draft (c ~ 1/3)
        m = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
        m.model.layers = m.model.layers[:2]
        m.config.num_hidden_layers = 2
        m.save_pretrained(str(skip))
        copy_tok(skip)
    pairs["layer-skip draft"] = (target, skip, {})
    # the target itself in int8 as its own draft: high acceptance, expensive draft (c ~ 0.5+)
    pairs["int8 self-draft"] = (target, target, {"quantize": "int8", "quantize_roles": ("draft",)})
    return pairs


def export(cache: Path, name: str, target: Path, draft: Path, opts: dict) -> Path:
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    out = cache / ("bundle-" + name.replace(" ", "-"))
    if not (out / "manifest.json").exists():
        export_pair(target, draft, out, ExportOptions(progress=False, **opts))
    return out


def evaluate(bundle: Path, prompts: list[str], ks: list[int], max_new_tokens: int, repeats: int) -> dict:
    import specdec_rt

    gen = specdec_rt.load(bundle, threads=1, prefix_cache=False)
    gen.policies.clock = time.process_time  # the cost model in CPU time, like the runs
    ids = [gen.tokenizer.encode(p) for p in prompts]
    configs = ([("target-only", None, 0, "chain")] + [(f"K={k}", "model", k, "chain") for k in ks]
               + [("auto", "model", "auto", "chain"), ("tree auto", "model", "auto", "tree")])
    secs = {c[0]: 0.0 for c in configs}
    alpha = {}
    for _, drafter, k, spec in configs:  # warm-up (and the cost models of the policies)
        gen.generate_ids(ids[0], max_new_tokens=16, drafter=drafter, num_draft_tokens=k, speculation=spec,
                         ignore_eos=True, temperature=0)
    chosen: dict[str, list[int]] = {"auto": [], "tree auto": []}
    for _ in range(repeats):
        for p in ids:
            for name, drafter, k, spec in configs:
                t0 = time.process_time()
                out = gen.generate_ids(p, max_new_tokens=max_new_tokens, drafter=drafter, num_draft_tokens=k,
                                       speculation=spec, ignore_eos=True, temperature=0)
                secs[name] += time.process_time() - t0
                st = gen.last_stats
                alpha[name] = st.acceptance_rate
                if name in chosen:
                    chosen[name].extend(st.draft_lengths)
                if name == "target-only":
                    reference = out
                elif out != reference:
                    raise SystemExit(f"{bundle.name}: {name} differs from target-only greedy")
    base = secs["target-only"]
    speed = {n: base / s for n, s in secs.items()}
    fixed = {n: v for n, v in speed.items() if n.startswith("K=")}
    best = max(fixed, key=fixed.get)
    best_chain = max(fixed[best], speed["auto"], 1.0)  # target-only is the chain of K = 0
    cost = gen.policies.cost_model
    return {"speedup": speed, "best_fixed": best, "auto_over_best": speed["auto"] / fixed[best],
            "tree_over_best_chain": speed["tree auto"] / best_chain,
            "c": cost.draft_step / cost.target_times[0] if cost else None,
            "alpha_k4": alpha.get("K=4"),
            "auto_mean_k": float(np.mean(chosen["auto"])) if chosen["auto"] else None,
            "tree_mean_nodes": float(np.mean(chosen["tree auto"])) if chosen["tree auto"] else None}


def markdown(results: dict) -> str:
    rows = ["| pair | c | alpha (K=4) | best fixed K | auto | auto / best fixed K | mean K of auto "
            "| tree auto | tree auto / best chain | mean nodes of tree auto |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if name == "settings":
            continue
        sp, best = r["speedup"], r["best_fixed"]
        rows.append(f"| {name} | {r['c']:.3f} | {r['alpha_k4']:.2f} | {best} {sp[best]:.2f}x | {sp['auto']:.2f}x "
                    f"| {r['auto_over_best']:.2f} | {r['auto_mean_k']:.1f} | {sp['tree auto']:.2f}x "
                    f"| {r['tree_over_best_chain']:.2f} | {r['tree_mean_nodes']:.1f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="/tmp/specdec-pairs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pairs", default=None, help="comma-separated subset")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--k", default="1,2,3,4,6,8,10")
    args = ap.parse_args()
    from specdec_rt.cli.demo import reference_prompts

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    prompts = [p["prompt"] for p in reference_prompts()][: args.num_prompts]
    ks = [int(k) for k in args.k.split(",")]
    results = {}
    for name, (t, d, opts) in build_pairs(cache).items():
        if args.pairs and name not in args.pairs.split(","):
            continue
        bundle = export(cache, name, t, d, opts)
        results[name] = evaluate(bundle, prompts, ks, args.max_new_tokens, args.repeats)
        r = results[name]
        print(f"{name}: c={r['c']:.3f} alpha(K=4)={r['alpha_k4']:.2f} best {r['best_fixed']} "
              f"{r['speedup'][r['best_fixed']]:.2f}x, auto {r['speedup']['auto']:.2f}x "
              f"({r['auto_over_best']:.2f} of best, mean K {r['auto_mean_k']:.1f}), tree auto "
              f"{r['speedup']['tree auto']:.2f}x ({r['tree_over_best_chain']:.2f} of the best chain); "
              + " ".join(f"{n} {v:.2f}" for n, v in r["speedup"].items()), flush=True)
    print(markdown(results))
    if args.out:
        results["settings"] = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                               "repeats": args.repeats, "threads": 1, "clock": "process CPU time"}
        write_outputs(results, Path(args.out), "policy_pairs", markdown, lambda results, out: [])


if __name__ == "__main__":
    main()
