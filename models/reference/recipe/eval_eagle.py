"""Held-out greedy chain agreement of the EAGLE-3 head vs the draft model (plain PyTorch).

On the held-out stream (common.HELDOUT, tokenized with the target's tokenizer), cut into
non-overlapping SEQ_LEN windows, every position p of a window is a committed prefix x_0..x_p
followed by the target's greedy token c_1. The target continues greedily: c_2..c_{K+1}. Each
drafter proposes K tokens greedily from the same state:

- head: catch-up rows 0..p-1 with the target's features and the natural tokens x_1..x_p, row p
  with the target's features of p and c_1 (it predicts d_1), then draft rows p+1.. fed back
  (hidden = the previous row's output, token = the previous proposal), each attending to the
  catch-up rows and the earlier draft rows: the runtime's procedure, through EagleHead.step with
  its KV cache;
- draft model: its KV cache of x_0..x_p, then c_1, then its own proposals.

Reported per chain position k = 1..K: cumulative agreement P(d_1..d_k == c_2..c_{k+1}) (what a
chain of k drafted tokens gets accepted at), conditional agreement P(d_k ok | d_1..d_{k-1} ok),
and the mean accepted length of a K-chain. Writes the "eagle3_head" key of ../eval_results.json.

  python eval_eagle.py [--head DIR] [--draft DIR] [--chain 5] [--windows N]
"""
import argparse
import copy
import inspect
import json
import os
import time

import numpy as np
import torch

from common import EOT_ID, PAIR, REF, SEQ_LEN, iter_texts, list_files


def heldout_stream(tokenizer_json):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    _, held = list_files()
    ids = []
    for e in tok.encode_batch([t for _, t in iter_texts(held)], add_special_tokens=False):
        ids.extend(e.ids)
        ids.append(EOT_ID)
    return np.asarray(ids, dtype=np.int64)


def _cache_kw(model):
    """transformers >= 5.2x names the KV cache argument/output ``cache`` (``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def lm_chain(model, window, first, ps, k):
    """Greedy continuation of ``model`` after prefixes window[:p+1] + first[p] for p in ps:
    [len(ps), k] tokens (the model's predictions after feeding first, then its own tokens)."""
    kw = _cache_kw(model)
    base = getattr(model(input_ids=window[None], use_cache=True), kw)
    n = window.shape[0]
    cache = copy.deepcopy(base)
    cache.batch_repeat_interleave(len(ps))
    past_ok = (torch.arange(n)[None] <= ps[:, None]).long()
    tok = first[ps]
    out = []
    for t in range(1, k + 1):
        mask = torch.cat([past_ok, torch.ones(len(ps), t, dtype=torch.long)], dim=1)
        o = model(input_ids=tok[:, None], attention_mask=mask, position_ids=(ps + t)[:, None],
                  use_cache=True, **{kw: cache})
        tok = o.logits[:, -1].argmax(-1)
        out.append(tok)
    return torch.stack(out, 1)


@torch.no_grad()
def head_chain(head, feats, window, first, ps, k):
    """The head's k greedy proposals after prefixes window[:p+1] + first[p] (see module doc)."""
    n = window.shape[0]
    fc = head.fc(feats[None])                                          # [1, n, H]
    _, _, (k0, v0) = head.step(window[None, 1:], fc[:, :n - 1], torch.arange(n - 1)[None])
    b = len(ps)
    past = (k0.expand(b, -1, -1, -1), v0.expand(b, -1, -1, -1))        # catch-up rows 0..n-2
    past_ok = torch.arange(n - 1)[None] < ps[:, None]                  # rows 0..p-1
    tok, hidden, pos = first[ps], fc[0, ps][:, None], ps
    out = []
    for t in range(k):
        allowed = torch.cat([past_ok, torch.ones(b, t + 1, dtype=torch.bool)], dim=1)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[:, None, None]
        logits, hidden, (k1, v1) = head.step(tok[:, None], hidden, pos[:, None], past=past, mask=mask)
        past = (torch.cat([past[0], k1], 2), torch.cat([past[1], v1], 2))
        tok = logits[:, -1].argmax(-1)
        out.append(tok)
        pos = pos + 1
    return torch.stack(out, 1)


def summarise(ok):
    """ok [N, K] bool -> cumulative, conditional agreement per position, mean accepted length."""
    cum = np.cumprod(ok, axis=1)
    cumulative = cum.mean(0)
    prev = np.concatenate([np.ones((len(ok), 1), dtype=bool), cum[:, :-1].astype(bool)], 1)
    conditional = [float(ok[prev[:, j], j].mean()) if prev[:, j].any() else 0.0 for j in range(ok.shape[1])]
    return {"cumulative": [round(float(x), 4) for x in cumulative],
            "conditional": [round(x, 4) for x in conditional],
            "mean_accepted": round(float(cum.sum(1).mean()), 4)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=os.path.join(PAIR, "target"))
    ap.add_argument("--head", default=os.path.join(PAIR, "eagle"))
    ap.add_argument("--draft", default=os.path.join(PAIR, "draft"))
    ap.add_argument("--chain", type=int, default=5)
    ap.add_argument("--windows", type=int, default=None, help="first N windows only (quick look)")
    ap.add_argument("--chunk", type=int, default=128, help="positions per batched chain")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(REF, "eval_results.json"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    from specdec_rt.export.eagle import load_head, target_features

    t0 = time.time()
    target = LlamaForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    head = load_head(args.head, target.get_input_embeddings().weight.detach(), target.config.num_hidden_layers)
    layers = head.cfg.feature_layers
    stream = heldout_stream(os.path.join(args.target, "tokenizer.json"))
    n_win = len(stream) // SEQ_LEN
    if args.windows:
        n_win = min(n_win, args.windows)
    ok_head, ok_draft = [], []
    for w in range(n_win):
        window = torch.from_numpy(stream[w * SEQ_LEN:(w + 1) * SEQ_LEN])
        with torch.no_grad():
            feats, logits = target_features(target, window[None], layers)
        first = logits[0].argmax(-1)                                   # c_1 of every prefix
        for s in range(0, SEQ_LEN, args.chunk):
            ps = torch.arange(s, min(SEQ_LEN, s + args.chunk))
            ref = lm_chain(target, window, first, ps, args.chain + 1)[:, :args.chain]   # c_2..c_{K+1}
            ok_head.append((head_chain(head, feats[0], window, first, ps, args.chain) == ref).numpy())
            ok_draft.append((lm_chain(draft, window, first, ps, args.chain) == ref).numpy())
        if w % 10 == 0:
            h, d = summarise(np.concatenate(ok_head)), summarise(np.concatenate(ok_draft))
            print(f"window {w + 1}/{n_win} ({time.time() - t0:.0f} s): head {h['cumulative']} "
                  f"draft {d['cumulative']}", flush=True)
    res = {"positions": int(sum(len(o) for o in ok_head)), "windows": n_win, "window_len": SEQ_LEN,
           "chain": args.chain, "head_dir": os.path.relpath(args.head, os.path.dirname(REF)),
           "head": summarise(np.concatenate(ok_head)), "draft_model": summarise(np.concatenate(ok_draft)),
           "seconds": round(time.time() - t0, 1),
           "method": "held-out stream, non-overlapping windows; from every position p the target's greedy "
                     "chain c_1..c_{K+1}; head (EagleHead.step, catch-up rows 0..p-1 with natural tokens, row p "
                     "with c_1, draft rows fed back) and draft model (KV cache of x_0..x_p, then c_1) propose "
                     "K greedily; cumulative = P(first k proposals all equal c_2..c_{k+1})"}
    print(json.dumps(res, indent=1))
    if not args.no_write:
        with open(args.out) as fh:
            allres = json.load(fh)
        allres["eagle3_head"] = res
        with open(args.out, "w") as fh:
            json.dump(allres, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()
