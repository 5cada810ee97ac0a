"""llama.cpp alone on Spec-Bench questions: its target-only, draft-model and lookup runs and its T(S).

The llama.cpp half of ``specdec-bench --peers llama.cpp`` without our runs (no bundle needed), for
a quick look at a GGUF pair on a shared machine. Prompts: the first turn of the chosen questions in
the Qwen2.5 chat template (the template's default system prompt), as ``--suite spec-bench`` renders
them for a Qwen2.5 bundle.

    python scripts/llama_cpp_run.py --target t.gguf --draft d.gguf \\
        --questions path/to/question.jsonl --ids 81,121,111 --k 4 --threads 2 --out llama.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec_rt.bench import llama_cpp as L
from specdec_rt.bench import llama_cpp_peer as LP

QWEN = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--questions", required=True, help="Spec-Bench question.jsonl")
    ap.add_argument("--ids", default="81,121,111", help="question ids, comma separated")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", default="4", help="draft lengths, comma separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--bench-repeats", type=int, default=3, help="llama-bench repeats per S")
    ap.add_argument("--out", required=True, help="JSON file")
    args = ap.parse_args()

    ids = [int(i) for i in args.ids.split(",")]
    rows = {d["question_id"]: d for d in map(json.loads, Path(args.questions).read_text().splitlines()) if d}
    prompts = [QWEN.format(q=rows[i]["turns"][0]) for i in ids]
    plan = LP.LlamaCppPlan(tools=L.find_tools(), target=Path(args.target),
                           draft=Path(args.draft) if args.draft else None, threads=args.threads,
                           ctx=2048 + 32, ks=[int(k) for k in args.k.split(",")], bench_repeats=args.bench_repeats)
    t0 = time.perf_counter()
    peer_rows, details = LP.run(plan, prompts, args.max_new_tokens, repeats=args.repeats)
    details["question_ids"] = ids
    Path(args.out).write_text(json.dumps({"rows": peer_rows, "llama_cpp": details,
                                          "wall_seconds": time.perf_counter() - t0}, indent=2))
    for r in peer_rows:
        print(f"{r['system']:<17} K={r['k']}: decode {r['decode_tokens_per_second']:.1f} tok/s "
              f"(x{r['decode_speedup_over_own_target_only']:.2f}), prompt {r['prompt_tokens_per_second']:.1f} "
              f"tok/s, acceptance {r.get('alpha') if r.get('alpha') is None else round(r['alpha'], 3)}, "
              f"== its plain decode: {r['identical_to_own_target_only']}")
    c = details["time_curve"]
    print("llama.cpp T(S)/T(1):", ", ".join(f"S={s}: {x:.2f}" for s, x in zip(c["S"], c["ratio"])))


if __name__ == "__main__":
    main()
