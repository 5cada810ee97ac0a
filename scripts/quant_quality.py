"""How close quantized target graphs are to the float model, on real chat text.

Teacher-forced over continuations of Spec-Bench chat prompts (the first question of the first
N categories, greedy continuations of the first bundle, prompts cut to 600 tokens): top-1
agreement of each bundle's target logits with the PyTorch model's, and the mean KL divergence
KL(float || quantized) per position. Needs the export extras (torch, transformers).

    python scripts/quant_quality.py CHECKPOINT BUNDLE [BUNDLE ...] [--questions question.jsonl]
        [--prompts 8] [--new-tokens 64] [--json out.json]

CHECKPOINT is the float checkpoint folder the bundles were exported from (for a GGUF input: its
dequantised folder under ~/.cache/specdec-rt/gguf).
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import specdec_rt
    from specdec_rt.runtime.core.masks import causal_mask

    picked, seen = [], set()
    for line in open(args.questions):
        q = json.loads(line)
        if q["category"] not in seen:
            seen.add(q["category"])
            picked.append(q)
    picked = picked[:args.prompts]
    first = specdec_rt.load(args.bundles[0], threads=args.threads, probe_rows=False)
    seqs = []
    for q in picked:
        ids = first.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=True)[:600]
        seqs.append((ids, first.generate_ids(ids, max_new_tokens=args.new_tokens, drafter=None)))
    del first

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].numpy() for ids, out in seqs]
    del model

    results = {}
    for path in args.bundles:
        engine = specdec_rt.load(path, threads=args.threads, probe_rows=False).target
        agree, kls, n = 0, [], 0
        for (ids, out), ref in zip(seqs, refs):
            full = np.array(ids + out)
            pos = np.arange(len(full))
            engine.reset()
            logits = engine.forward(full, pos, causal_mask(0, pos))[len(ids) - 1:-1]
            engine.reset()
            agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
            n += len(out)
            lp, lq = _log_softmax(ref), _log_softmax(logits)
            kls.append(float((np.exp(lp) * (lp - lq)).sum(-1).mean()))
        results[path] = {"top1_agreement": agree / n, "mean_kl": float(np.mean(kls)), "tokens": n}
        print(f"{path}: top-1 agreement {agree / n:.4f}, mean KL {np.mean(kls):.4f} ({n} tokens)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
