"""Head to head with onnxruntime-genai: our configurations and genai's interleaved prompt by prompt.

    python scripts/head_to_head.py --bundle out/reference-bundle-fused --ours 8,auto --genai 4,8 \
        --repeats 3 --out docs/bench-h2h

``specdec-bench --peers onnxruntime-genai`` runs the peer after all of ours, so on a shared
machine whose speed drifts by +-20% within minutes the ratio between the two carries that drift.
Here every (repeat, prompt) runs every system back to back, in an order rotated per prompt, on
the same prompt ids, threads and clock, greedy with exactly ``--max-new-tokens`` tokens (EOS
ignored), so drift hits both sides alike. Reports tokens/s per system, our best over genai's
best overall and per repeat (the spread), and whether every output equals target-only decoding.
Needs the bench extra (onnxruntime-genai); genai's models are built from the bundle's source
checkpoints into ``--peer-cache`` as ``specdec-bench`` does.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import specdec_rt  # noqa: E402
from specdec_rt.bench import peers as P  # noqa: E402
from specdec_rt.bench.peer_runs import genai_models  # noqa: E402
from specdec_rt.bench.report import write_outputs  # noqa: E402
from specdec_rt.bench.runner import BenchConfig, load_prompts, machine_description  # noqa: E402


def _k(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--ours", default="4,8,auto", help="our draft lengths (chains), comma separated")
    ap.add_argument("--genai", default="4,8", help="genai's fixed draft lengths; 'auto' = its adaptive mode")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--peer-cache", default="out/peer-models")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    ours_ks = [_k(x) for x in args.ours.split(",")]
    genai_ks = [_k(x) for x in args.genai.split(",")]

    gen = specdec_rt.load(args.bundle, threads=args.threads, shared_thread_pool=True, prefix_cache=False)
    n = args.max_new_tokens
    limit = gen.max_length - n - 1  # as specdec-bench: the prompt's tail where prompt + tokens exceed the context
    prompts = [gen.tokenizer.encode(p)[-limit:] for p in load_prompts(None)][: args.num_prompts]
    built = genai_models(BenchConfig(bundle=args.bundle, prompts=[], peer_cache=args.peer_cache), gen)
    kw = dict(max_new_tokens=n, temperature=0, top_k=0, top_p=1.0, ignore_eos=True)

    systems: dict[str, object] = {"ours target-only": lambda ids: gen.generate_ids(ids, drafter=None, **kw)}
    for k in ours_ks:
        systems[f"ours K={k}"] = (lambda k: lambda ids: gen.generate_ids(ids, num_draft_tokens=k, **kw))(k)
    sessions = []
    longest = max(len(p) for p in prompts) + n
    target_only = P.OrtGenaiSession(built["target"], longest, threads=args.threads)
    sessions.append(target_only)
    systems["genai target-only"] = lambda ids: target_only.generate(ids, n)[0]
    for k in genai_ks:
        if k == "auto":
            kmax = max(x for x in genai_ks if x != "auto") if len(genai_ks) > 1 else 8
            s = P.OrtGenaiSession(built["target"], longest, built["draft"], kmax, args.threads, adaptive=True)
        else:
            s = P.OrtGenaiSession(built["target"], longest, built["draft"], k, args.threads)
        sessions.append(s)
        systems[f"genai K={k}"] = (lambda s: lambda ids: s.generate(ids, n)[0])(s)

    names = list(systems)
    for name in names:  # warm-up
        systems[name](prompts[0][:8])
    seconds = {name: [0.0] * args.repeats for name in names}
    tokens = {name: [0] * args.repeats for name in names}
    outputs: dict[str, dict[int, list[int]]] = {name: {} for name in names}
    try:
        from tqdm import tqdm
        bar = tqdm(total=args.repeats * len(prompts) * len(names), desc="head-to-head", unit="run")
    except ImportError:  # pragma: no cover
        bar = None
    for rep in range(args.repeats):
        for pi, ids in enumerate(prompts):
            shift = (rep * len(prompts) + pi) % len(names)
            for name in names[shift:] + names[:shift]:  # rotated: no system always runs first
                t0 = time.perf_counter()
                out = systems[name](ids)
                seconds[name][rep] += time.perf_counter() - t0
                tokens[name][rep] += len(out)
                outputs[name][pi] = out
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    for s in sessions:
        s.__exit__(None, None, None)

    base = outputs["ours target-only"]
    rows = []
    for name in names:
        tps = sum(tokens[name]) / sum(seconds[name])
        per_rep = [t / s for t, s in zip(tokens[name], seconds[name])]
        rows.append({"system": name, "tokens_per_second": tps, "per_repeat": per_rep,
                     "identical_to_target_only": all(outputs[name][i] == base[i] for i in base)})
    by = {r["system"]: r for r in rows}
    ours = [r for r in rows if r["system"].startswith("ours K=")]
    theirs = [r for r in rows if r["system"].startswith("genai K=")]
    best_ours = max(ours, key=lambda r: r["tokens_per_second"])
    best_theirs = max(theirs, key=lambda r: r["tokens_per_second"])
    per_rep_ratio = [max(r["per_repeat"][i] for r in ours) / max(r["per_repeat"][i] for r in theirs)
                     for i in range(args.repeats)]
    summary = {
        "best_ours": best_ours["system"], "best_genai": best_theirs["system"],
        "ours_best_over_genai_best": best_ours["tokens_per_second"] / best_theirs["tokens_per_second"],
        "per_repeat_ratio": per_rep_ratio,
        "ours_best_over_our_target_only": best_ours["tokens_per_second"] / by["ours target-only"]["tokens_per_second"],
        "genai_target_only_over_ours": by["genai target-only"]["tokens_per_second"] / by["ours target-only"]["tokens_per_second"],
    }
    results = {"machine": machine_description(), "settings": dict(vars(args)), "rows": rows, "summary": summary}
    written = write_outputs(results, Path(args.out), "head_to_head", _markdown, lambda results, out: [])
    print(written["markdown"], end="")


def _markdown(results: dict) -> str:
    summary = results["summary"]
    lines = ["| system | tok/s | per repeat | identical to target-only |", "|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['system']} | {r['tokens_per_second']:.1f} | "
                     f"{', '.join(f'{x:.0f}' for x in r['per_repeat'])} | {'yes' if r['identical_to_target_only'] else 'NO'} |")
    lines.append("")
    lines.append(f"Our best ({summary['best_ours']}) / genai's best ({summary['best_genai']}): "
                 f"**{summary['ours_best_over_genai_best']:.2f}x** (per repeat: "
                 f"{', '.join(f'{x:.2f}' for x in summary['per_repeat_ratio'])}); ours over our target-only "
                 f"{summary['ours_best_over_our_target_only']:.2f}x; genai target-only / ours "
                 f"{summary['genai_target_only_over_ours']:.2f}.")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
