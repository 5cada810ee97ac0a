"""Policy check on several model pairs: num_draft_tokens="auto" against every fixed K.

Builds pairs around the shipped reference target with drafts of different strength and cost
(into a cache folder outside the repository), then decodes the held-out prompts with each fixed K
and with "auto", single-threaded, timing CPU time of this process (robust to other jobs on a
shared machine), interleaved prompt by prompt. Prints and writes JSON + a markdown table.

    python scripts/policy_pairs.py --cache /work/cache/pairs --out docs/bench-policy
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np


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

    gen = specdec_rt.load(bundle, threads=1)
    gen.measure_clock = time.process_time  # the cost model in CPU time, like the runs
    ids = [gen.tokenizer.encode(p) for p in prompts]
    configs = [("target-only", None, 0)] + [(f"K={k}", "model", k) for k in ks] + [("auto", "model", "auto")]
    secs = {c[0]: 0.0 for c in configs}
    alpha = {}
    for c in configs:  # warm-up (and the cost model for "auto")
        gen.generate_ids(ids[0], max_new_tokens=16, drafter=c[1], num_draft_tokens=c[2], ignore_eos=True, temperature=0)
    chosen: list[int] = []
    for _ in range(repeats):
        for p in ids:
            for name, drafter, k in configs:
                t0 = time.process_time()
                gen.generate_ids(p, max_new_tokens=max_new_tokens, drafter=drafter, num_draft_tokens=k,
                                 ignore_eos=True, temperature=0)
                secs[name] += time.process_time() - t0
                st = gen.last_stats
                alpha[name] = st.acceptance_rate
                if k == "auto":
                    chosen.extend(st.draft_lengths)
    base = secs["target-only"]
    speed = {n: base / s for n, s in secs.items()}
    fixed = {n: v for n, v in speed.items() if n.startswith("K=")}
    best = max(fixed, key=fixed.get)
    cost = gen._cost_model
    return {"speedup": speed, "best_fixed": best, "auto_over_best": speed["auto"] / fixed[best],
            "c": cost.draft_step / cost.target_times[0] if cost else None,
            "alpha_k4": alpha.get("K=4"), "auto_mean_k": float(np.mean(chosen)) if chosen else None}


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
              f"({r['auto_over_best']:.2f} of best, mean K {r['auto_mean_k']:.1f}); "
              + " ".join(f"{n} {v:.2f}" for n, v in r["speedup"].items()), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "policy_pairs.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
