"""Train the EAGLE-3 head of the reference target (issue 22) -> specdec_rt/data/reference/eagle/.

Same corpus as the pair (the training split of common.list_files(), tokenized with the target's
tokenizer.json, each file followed by <|endoftext|>; the held-out files are never read), recipe
in specdec_rt/export/eagle_train.py (training-time test over 5 steps, soft labels from the
target, full 4096-token vocabulary). The target's features are computed on the fly (it is small).

The shipped head (models/reference/README.md, "EAGLE-3 head"), from recipe/:

  python train_eagle.py --out /tmp/eagle-stage1                        # stage 1: corpus windows
  python distill_onpolicy.py gen --mode greedy --n 1024 --seed 21 --threads 2   # target continuations
  python train_eagle.py --init-from /tmp/eagle-stage1 --onpolicy ../.cache/onpolicy-target-greedy-s21.npz \
      --steps 400 --lr 1e-3 --warmup 10 --seed 2202 --threads 1        # stage 2 -> $PAIR/eagle
  python train_eagle.py --steps 40 --out /tmp/trial                    # a short trial to size a run

(distill_onpolicy.py reads ../.cache/tokenizer/tokenizer.json: run train_tokenizer.py or copy the
target's byte-identical tokenizer.json there.)
"""
import argparse
import hashlib
import os
import time

import numpy as np
import torch

from common import CACHE, EOT_ID, PAIR, list_files, read_text

DEFAULTS = dict(steps=2000, seq_len=256, batch=8, lr=3e-3, warmup=30, ttt_steps=5, seed=2201)


def train_stream(tokenizer_json):
    """uint16 ids of the training split (each file + <|endoftext|>), cached under .cache/."""
    from tokenizers import Tokenizer

    h = hashlib.sha256(open(tokenizer_json, "rb").read()).hexdigest()[:12]
    path = os.path.join(CACHE, f"eagle-train-tokens-{h}.npz")
    if os.path.exists(path):
        z = np.load(path)
        return z["ids"], {k: int(z[k]) for k in ("files", "skipped")}
    tok = Tokenizer.from_file(tokenizer_json)
    train, _held = list_files()
    texts = [read_text(p) for _, p in train]
    good = [t for t in texts if t is not None]
    ids = []
    for e in tok.encode_batch(good, add_special_tokens=False):
        ids.extend(e.ids)
        ids.append(EOT_ID)
    ids = np.asarray(ids, dtype=np.uint16)
    os.makedirs(CACHE, exist_ok=True)
    np.savez(path, ids=ids, files=len(good), skipped=len(texts) - len(good))
    return ids, {"files": len(good), "skipped": len(texts) - len(good)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=os.path.join(PAIR, "target"))
    ap.add_argument("--out", default=os.path.join(PAIR, "eagle"))
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    ap.add_argument("--intermediate-size", type=int, default=1152)
    ap.add_argument("--init-fc", default="random", choices=("identity", "random"))
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast (CPUs without avx512_bf16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--init-from", default=None, help="a head folder to continue from (stage 2)")
    ap.add_argument("--onpolicy", nargs="+", default=None,
                    help="train on these distill_onpolicy.py gen files (sequences the target continued) "
                         "instead of random windows of the corpus")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec_rt.export.eagle_train import TrainConfig, load_target, train_head

    t0 = time.time()
    stream, stats = train_stream(os.path.join(args.target, "tokenizer.json"))
    stream = stream.astype(np.int32)
    windows = None
    if args.onpolicy:
        windows = np.concatenate([np.load(f)["seqs"] for f in args.onpolicy]).astype(np.int32)
        args.seq_len = min(args.seq_len, windows.shape[1])
        stats = {**stats, "onpolicy": [os.path.basename(f) for f in args.onpolicy], "onpolicy_sequences": len(windows),
                 "onpolicy_tokens": int(windows.size)}
    cfg = TrainConfig(steps=args.steps, seq_len=args.seq_len, batch=args.batch, lr=args.lr, warmup=args.warmup,
                      ttt_steps=args.ttt_steps, seed=args.seed, feature_layers=(1, 3, 5), num_heads=6,
                      num_kv_heads=2, head_dim=64, intermediate_size=args.intermediate_size, draft_vocab=4096,
                      init_fc=args.init_fc, bf16=not args.fp32, checkpoint_every=args.checkpoint_every,
                      stop_after=args.stop_after, save_dtype="float16", init_from=args.init_from)
    model = load_target(args.target)
    log = train_head(args.target, stream, args.out, cfg, model=model, special_ids=[EOT_ID], resume=args.resume,
                     checkpoint_dir=os.path.join(CACHE, "eagle-checkpoint", os.path.basename(os.path.abspath(args.out))),
                     data_stats={**stats, "corpus": "CPython stdlib training split (recipe/common.py), held-out excluded"},
                     extra_log={"recipe": "models/reference/recipe/train_eagle.py", "threads": args.threads},
                     windows=windows)
    if "final" in log:
        print(f"done in {time.time() - t0:.0f} s: {log['final']}", flush=True)


if __name__ == "__main__":
    main()
