"""Train the reference target (next-token LM) and draft (distilled from the target).

  python train.py target --steps N     -> specdec_rt/data/reference/target/
  python train.py draft  --steps N     -> specdec_rt/data/reference/draft/  (needs target/)
  python train.py bench                -> time per step for both, to size --steps
"""
import argparse
import json
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.nn.functional as F

from common import (DRAFT_SHAPE, EOT_ID, PAIR, SEQ_LEN, TARGET_SHAPE, TOKENIZER_DIR,
                    llama_config, seed_all, token_streams)

DEFAULTS = {
    "target": dict(steps=800, batch=16, lr=1.5e-3, warmup=20, seed=1234),
    "draft": dict(steps=400, batch=16, lr=3e-3, warmup=20, seed=4321),
}


def make_model(shape):
    from transformers import LlamaForCausalLM
    cfg = llama_config(shape)
    m = LlamaForCausalLM(cfg).float()
    return m


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def batches(stream, batch, seed):
    rng = np.random.default_rng(seed)
    hi = len(stream) - SEQ_LEN - 1
    while True:
        starts = rng.integers(0, hi, size=batch)
        x = np.stack([stream[s:s + SEQ_LEN + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x)


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))  # cosine to 10% of peak


@torch.no_grad()
def heldout_loss(model, stream, batch=8):
    """Mean next-token CE over non-overlapping SEQ_LEN windows of the held-out stream."""
    model.eval()
    n = (len(stream) - 1) // SEQ_LEN
    tot, cnt = 0.0, 0
    for i in range(0, n, batch):
        xs = [stream[j * SEQ_LEN:(j + 1) * SEQ_LEN + 1] for j in range(i, min(n, i + batch))]
        x = torch.from_numpy(np.stack(xs).astype(np.int64))
        logits = model(input_ids=x[:, :-1]).logits.float()
        tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                               reduction="sum").item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def make_opt(model, lr):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def patch_config(out):
    """Also write the legacy top-level rope_theta (transformers 5 only writes rope_parameters)."""
    p = os.path.join(out, "config.json")
    cfg = json.load(open(p))
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    with open(p, "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")


def save(model, out, meta):
    from transformers import GenerationConfig
    os.makedirs(out, exist_ok=True)
    model.config.use_cache = True
    model.half().save_pretrained(out, safe_serialization=True)
    model.float()
    patch_config(out)
    GenerationConfig(bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID,
                     do_sample=False, max_new_tokens=64).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, f), os.path.join(out, f))
    with open(os.path.join(out, "training_log.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
        fh.write("\n")


def train(kind, args):
    seed_all(args.seed)
    train_s, held_s = token_streams()
    print(f"train tokens {len(train_s):,}  held-out tokens {len(held_s):,}", flush=True)
    model = make_model(TARGET_SHAPE if kind == "target" else DRAFT_SHAPE)
    if args.init:  # continue from saved weights (second distillation stage of the draft)
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    model.train()
    teacher = None
    if kind == "draft":
        from transformers import LlamaForCausalLM
        teacher = LlamaForCausalLM.from_pretrained(args.teacher or os.path.join(PAIR, "target"),
                                                   dtype=torch.float32).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    print(f"{kind}: {n_params(model):,} params", flush=True)
    opt = make_opt(model, args.lr)
    it = batches(train_s, args.batch, args.seed)
    log, t0 = [], time.time()
    ema = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x = next(it)
        inp, tgt = x[:, :-1], x[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=inp).logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
        if teacher is not None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                t_logits = teacher(input_ids=inp).logits.float()
            T = args.temperature
            kl = F.kl_div(F.log_softmax(logits / T, -1).reshape(-1, logits.size(-1)),
                          F.log_softmax(t_logits / T, -1).reshape(-1, logits.size(-1)),
                          log_target=True, reduction="batchmean") * T * T
            agree = (logits.argmax(-1) == t_logits.argmax(-1)).float().mean().item()
            loss = (1 - args.ce_weight) * kl + args.ce_weight * ce
        else:
            loss = ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rec = {"step": step + 1, "loss": round(loss.item(), 4), "ce": round(ce.item(), 4),
               "t": round(time.time() - t0, 1)}
        if teacher is not None:
            rec["kl"] = round(kl.item(), 4)
            rec["agree"] = round(agree, 4)
        log.append(rec)
        ema = rec["loss"] if ema is None else 0.9 * ema + 0.1 * rec["loss"]
        if (step + 1) % 10 == 0 or step == 0:
            print(json.dumps(rec), f"ema={ema:.3f}", flush=True)
    train_time = time.time() - t0
    hl = heldout_loss(model, held_s)
    last = log[-20:]
    meta = {"kind": kind, "args": vars(args), "params": n_params(model),
            "train_time_s": round(train_time, 1),
            "final_train_loss_last20": round(sum(r["loss"] for r in last) / len(last), 4),
            "final_train_ce_last20": round(sum(r["ce"] for r in last) / len(last), 4),
            "heldout_ce": round(hl, 4), "log": log}
    if teacher is not None:
        meta["final_train_agree_last20"] = round(sum(r["agree"] for r in last) / len(last), 4)
    print(json.dumps({k: v for k, v in meta.items() if k != "log"}), flush=True)
    save(model, args.out or os.path.join(PAIR, kind), meta)


def bench(args):
    train_s, _ = token_streams()
    for kind, shape in (("target", TARGET_SHAPE), ("draft", DRAFT_SHAPE)):
        seed_all(0)
        m = make_model(shape)
        print(kind, n_params(m), "params;", "non-embedding", n_params(m) - m.model.embed_tokens.weight.numel())
        opt = make_opt(m, 1e-3)
        it = batches(train_s, args.batch, 0)
        teacher = make_model(TARGET_SHAPE).eval() if kind == "draft" else None
        ts = []
        for i in range(4):
            t = time.time()
            x = next(it)
            lg = m(input_ids=x[:, :-1]).logits.float()
            loss = F.cross_entropy(lg.reshape(-1, lg.size(-1)), x[:, 1:].reshape(-1))
            if teacher is not None:
                with torch.no_grad():
                    tl = teacher(input_ids=x[:, :-1]).logits
                loss = loss + F.kl_div(F.log_softmax(lg, -1), F.log_softmax(tl, -1), log_target=True, reduction="batchmean")
            opt.zero_grad(); loss.backward(); opt.step()
            ts.append(time.time() - t)
        print(kind, "s/step", [round(t, 2) for t in ts])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["target", "draft", "bench"])
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--temperature", type=float, default=1.0, help="draft: KD temperature")
    ap.add_argument("--ce_weight", type=float, default=0.0, help="draft: weight of data CE")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false",
                    help="disable CPU bf16 autocast (weights/optimizer stay fp32 either way)")
    ap.add_argument("--out", help="output folder (default specdec_rt/data/reference/<kind>)")
    ap.add_argument("--init", help="start from this checkpoint folder instead of random weights")
    ap.add_argument("--teacher", help="draft: teacher folder (default specdec_rt/data/reference/target)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = DEFAULTS.get(args.kind, {"batch": 16})
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.kind == "bench":
        bench(args)
    else:
        train(args.kind, args)


if __name__ == "__main__":
    main()
