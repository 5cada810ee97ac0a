"""Greedy chain speculative-decoding acceptance of draft/ vs target/ on eval_prompts.jsonl (plain PyTorch).

For each prompt: the target greedy-generates N (=64) tokens. Then chain speculative decoding is
simulated: from the committed prefix the draft proposes k = min(K, N - committed) tokens greedily;
draft tokens are accepted while they equal the target's argmax; then the target's own token is
committed. alpha = accepted / proposed.  Also reports teacher-forced top-1 agreement and CE on the
held-out stream, and writes ../eval_results.json.
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F

from common import EOT_ID, PAIR, REF, SEQ_LEN, token_streams


@torch.no_grad()
def greedy(model, ids, n):
    out = list(ids)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([out])).logits[0, -1]
        out.append(int(logits.argmax()))
    return out[len(ids):]


def simulate(draft, prompt_ids, tgt_tokens, K):
    N = len(tgt_tokens)
    committed, proposed, accepted, rounds = 0, 0, 0, 0
    while committed < N:
        k = min(K, N - committed)
        prop = greedy(draft, prompt_ids + tgt_tokens[:committed], k)
        n_acc = 0
        while n_acc < k and prop[n_acc] == tgt_tokens[committed + n_acc]:
            n_acc += 1
        proposed += k
        accepted += n_acc
        rounds += 1
        committed = min(N, committed + n_acc + 1)   # + the target's own token
    return proposed, accepted, rounds


@torch.no_grad()
def stream_metrics(target, draft, stream, batch=8):
    n = (len(stream) - 1) // SEQ_LEN
    ce_t = ce_d = agree = cnt = 0.0
    for i in range(0, n, batch):
        x = torch.from_numpy(np.stack([stream[j * SEQ_LEN:(j + 1) * SEQ_LEN + 1]
                                       for j in range(i, min(n, i + batch))]).astype(np.int64))
        lt = target(input_ids=x[:, :-1]).logits
        ld = draft(input_ids=x[:, :-1]).logits
        y = x[:, 1:].reshape(-1)
        ce_t += F.cross_entropy(lt.reshape(-1, lt.size(-1)), y, reduction="sum").item()
        ce_d += F.cross_entropy(ld.reshape(-1, ld.size(-1)), y, reduction="sum").item()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        cnt += y.numel()
    return ce_t / cnt, ce_d / cnt, agree / cnt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=os.path.join(PAIR, "target"))
    ap.add_argument("--draft", default=os.path.join(PAIR, "draft"))
    ap.add_argument("--prompts", default=os.path.join(PAIR, "eval_prompts.jsonl"))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--K", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--no-bos", action="store_true", help="do not prepend <|endoftext|> to prompts")
    ap.add_argument("--out", default=os.path.join(REF, "eval_results.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(args.target)
    # weights are stored fp16; evaluate in fp32 (fp16 -> fp32 is exact)
    target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    prompts = [json.loads(l) for l in open(args.prompts)]
    res = {"new_tokens": args.new_tokens, "bos": not args.no_bos, "per_K": {}, "samples": []}
    tgt = []
    for p in prompts:
        ids = tok(p["prompt"], add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == p["prompt"]
        if not args.no_bos:
            ids = [EOT_ID] + ids
        gen = greedy(target, ids, args.new_tokens)
        tgt.append((ids, gen))
        res["samples"].append({"file": p["file"], "target_continuation": tok.decode(gen)})
    for K in args.K:
        P = A = R = 0
        per = []
        for (ids, gen), p in zip(tgt, prompts):
            pr, ac, r = simulate(draft, ids, gen, K)
            P, A, R = P + pr, A + ac, R + r
            per.append(round(ac / pr, 4))
        res["per_K"][str(K)] = {"alpha": round(A / P, 4), "proposed": P, "accepted": A,
                                "target_calls": R,
                                "tokens_per_target_call": round(len(tgt) * args.new_tokens / R, 3),
                                "alpha_per_prompt": per}
        print(f"K={K}: alpha={A / P:.4f} ({A}/{P}), tokens/target call="
              f"{len(tgt) * args.new_tokens / R:.3f}, per prompt {per}", flush=True)
    _, held = token_streams()
    ce_t, ce_d, ag = stream_metrics(target, draft, held)
    res["heldout"] = {"target_ce": round(ce_t, 4), "draft_ce": round(ce_d, 4),
                      "teacher_forced_top1_agreement": round(ag, 4), "tokens": int(len(held))}
    res["params"] = {"target": sum(p.numel() for p in target.parameters()),
                     "draft": sum(p.numel() for p in draft.parameters())}
    print(json.dumps(res["heldout"]), json.dumps(res["params"]))
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
