"""Training EAGLE-3 feature heads (:mod:`specdec_rt.export.eagle`) for a Hugging Face causal LM.

The recipe follows EAGLE-3 (Li et al. 2025, arXiv 2503.01840): the target's fused features and
next-token distributions are computed once per batch; the head is trained with *training-time
test* (TTT): step 0 rows read ``fc(features)``, step ``j`` rows read the head's own step ``j - 1``
output of the previous position, exactly as drafting does at inference. The loss is the
cross-entropy against the target's distribution restricted (and renormalised) to the draft
vocabulary, weighted ``step_weight ** j`` per step.

Row convention (as in ``eagle.py``): the row at position ``i`` takes ``fc(features of i)`` (or a
drafted hidden) and the embedding of token ``i + 1``, predicts token ``i + 2``, rotary position
``i``. At step ``j`` the row at ``i`` attends to the step-0 rows ``<= i - j`` and to the step-``k``
rows at ``i - j + k`` for ``k = 1..j`` (itself included): the keys the runtime's cache holds
after catching up on positions ``0..i - j`` and drafting ``j`` tokens.

Usage::

    python -m specdec_rt.export.eagle_train --target CKPT --data FILE_OR_DIR... --out HEAD_DIR \\
        [--steps N --seq-len L --batch B --lr LR --ttt-steps 3 --draft-vocab N \\
         --feature-layers a,b,c --threads N --feature-cache DIR --resume --seed S]

Data: text files (each tokenized with the target's tokenizer and followed by EOS), ``.jsonl``
files of ``{"text"}`` records (same) or chat ``{"messages"}`` records (the target's chat template),
or directories of those (walked in sorted order). The output folder is a head in the published
layout (``eagle.save_head``) plus ``training_log.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec_rt.errors import ExportError
from specdec_rt.export.eagle import EagleConfig, EagleHead, default_feature_layers, feature_hooks, save_head

LOG_NAME = "training_log.json"
CHECKPOINT_NAME = "checkpoint.pt"
CACHE_INDEX = "index.json"
FULL_VOCAB_MAX = 8192          # vocabularies up to this size are kept whole
DEFAULT_DRAFT_VOCAB = 32000    # EAGLE-3's published heads


# --------------------------------------------------------------------------------------------
# configuration

@dataclass
class TrainConfig:
    """Everything that shapes a run (recorded in training_log.json and the checkpoint)."""

    steps: int = 2000
    seq_len: int = 512             # tokens per window (rows per window: seq_len - 1)
    batch: int = 4
    lr: float = 3e-4
    warmup: int = 50
    schedule: str = "cosine"       # cosine | linear (decay to min_lr_ratio * lr)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 3
    step_weight: float = 0.8
    draft_vocab: int | None = None  # None: the full vocabulary up to 8192 tokens, else 32000
    vocab_source: str = "auto"     # argmax | corpus | auto (argmax with a feature cache)
    feature_layers: tuple[int, ...] | None = None
    intermediate_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    init_fc: str = "random"        # random (PyTorch default) | identity (top feature layer passed through)
    seed: int = 0
    bf16: bool = False             # bf16 autocast for the matmuls (fp32 master weights)
    device: str = "cpu"            # torch device of the target and the head ("cuda", "cuda:1", ...)
    checkpoint_every: int = 200
    stop_after: int | None = None  # leave after this step (with a checkpoint) to resume later
    cache_windows: int | None = None  # windows kept in a feature cache (None: all)
    cache_shard: int = 64          # windows per cache shard
    save_dtype: str = "float32"
    init_from: str | None = None   # start from this head folder's weights (same shapes and vocabulary)

    def key(self) -> dict:
        """The fields a resumed run must share with the interrupted one."""
        skip = {"stop_after", "checkpoint_every", "device"}  # a run may resume elsewhere
        return {k: v for k, v in asdict(self).items() if k not in skip}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 0-based ``step``: linear warm-up, then cosine or linear decay."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    shape = 0.5 * (1 + math.cos(math.pi * p)) if cfg.schedule == "cosine" else 1.0 - p
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


# --------------------------------------------------------------------------------------------
# target and data

def load_target(path: str | Path):
    """The target checkpoint in fp32, eval mode, frozen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def model_device(model) -> torch.device:
    """Where the target's weights are (the training device)."""
    return next(model.parameters()).device


def target_rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def head_config(model, cfg: TrainConfig, draft_vocab: int) -> EagleConfig:
    """The head's shapes: the target's attention/MLP shapes unless ``cfg`` overrides them."""
    c = model.config
    hidden = c.hidden_size
    heads = cfg.num_heads or c.num_attention_heads
    layers = tuple(cfg.feature_layers) if cfg.feature_layers else default_feature_layers(c.num_hidden_layers)
    bad = [i for i in layers if not 0 <= i < c.num_hidden_layers]
    if bad:
        raise ExportError(f"feature layers {bad} outside the target's {c.num_hidden_layers} layers")
    return EagleConfig(
        hidden_size=hidden,
        intermediate_size=cfg.intermediate_size or c.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=cfg.num_kv_heads or getattr(c, "num_key_value_heads", None) or heads,
        head_dim=cfg.head_dim or getattr(c, "head_dim", None) or hidden // c.num_attention_heads,
        vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab,
        target_hidden_size=hidden,
        feature_layers=layers,
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        rope_theta=target_rope_theta(c),
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096)),
    )


def data_files(paths: list[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        elif p.is_file():
            out.append(p)
        else:
            raise ExportError(f"training data '{p}' does not exist")
    if not out:
        raise ExportError("no training data files")
    return out


def tokenize_data(paths: list[str | Path], tokenizer) -> tuple[np.ndarray, dict]:
    """One token stream over every document: text files and ``{"text"}`` records followed by EOS,
    chat ``{"messages"}`` records through the tokenizer's chat template. Returns (int32 ids,
    counts)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ExportError("the target's tokenizer has no EOS token to separate documents")
    ids: list[int] = []
    stats = {"files": 0, "documents": 0, "chat_records": 0, "skipped_files": 0}

    def text(t: str) -> None:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        stats["documents"] += 1

    for f in data_files(paths):
        try:
            body = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            stats["skipped_files"] += 1
            continue
        stats["files"] += 1
        if f.suffix != ".jsonl":
            text(body)
            continue
        for n, line in enumerate(body.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ExportError(f"{f}:{n}: not JSON: {exc}") from None
            if "messages" in rec:
                if not getattr(tokenizer, "chat_template", None):
                    raise ExportError(f"{f}:{n}: a chat record, but the target's tokenizer has no chat template")
                chat = tokenizer.apply_chat_template(rec["messages"], tokenize=True)
                if isinstance(chat, dict) or hasattr(chat, "keys"):
                    chat = chat["input_ids"]
                ids.extend(int(t) for t in chat)
                stats["chat_records"] += 1
                stats["documents"] += 1
            elif "text" in rec:
                text(rec["text"])
            else:
                raise ExportError(f"{f}:{n}: a record needs \"text\" or \"messages\"")
    stats["tokens"] = len(ids)
    return np.asarray(ids, dtype=np.int32), stats


def special_token_ids(tokenizer) -> list[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return sorted(ids)


def build_draft_vocab(counts: np.ndarray, size: int, keep: list[int] = ()) -> np.ndarray:
    """Target ids of the draft vocabulary, ascending: the ``size`` most frequent by ``counts``
    (ties to the lower id), the ``keep`` ids (special tokens) always included."""
    vocab = len(counts)
    if size >= vocab:
        return np.arange(vocab, dtype=np.int64)
    keep = sorted({int(k) for k in keep if 0 <= int(k) < vocab})
    if len(keep) > size:
        raise ExportError(f"a draft vocabulary of {size} cannot hold the {len(keep)} special tokens")
    order = np.lexsort((np.arange(vocab), -counts.astype(np.int64)))
    chosen = list(keep)
    kept = set(keep)
    for t in order:
        if len(chosen) == size:
            break
        if int(t) not in kept:
            chosen.append(int(t))
    return np.sort(np.asarray(chosen, dtype=np.int64))


def vocab_maps(draft_ids: np.ndarray, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's ``d2t`` (target id - draft id, per draft id) and ``t2d`` (target ids kept)."""
    ids = torch.as_tensor(draft_ids, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


# --------------------------------------------------------------------------------------------
# what the target gives per window

def target_forward(model, input_ids: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [B, L, len(layers) * H], final normed hidden [B, L, H]) of one target forward,
    float32; the same features as ``eagle.target_features`` without the full-vocabulary logits
    (the LM head is applied per need: :func:`draft_logits`, :func:`target_argmax`)."""
    store, handles = feature_hooks(model, layers)
    try:
        with torch.no_grad():
            final = model.model(input_ids=input_ids).last_hidden_state.float()
    finally:
        for h in handles:
            h.remove()
    return torch.cat([store[i].float() for i in layers], dim=-1), final


def _softcap(model, logits: torch.Tensor) -> torch.Tensor:
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def draft_logits(model, final: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """The target's logits at the draft-vocabulary ids (float32), from its final hidden."""
    lm = model.get_output_embeddings()
    bias = lm.bias[draft_ids] if getattr(lm, "bias", None) is not None else None
    return _softcap(model, F.linear(final.float(), lm.weight[draft_ids].float(), bias))


def target_argmax(model, final: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The target's greedy token per row (over its whole vocabulary), in row chunks."""
    lm = model.get_output_embeddings()
    flat = final.reshape(-1, final.shape[-1])
    out = torch.cat([lm(flat[i:i + chunk].to(lm.weight.dtype)).argmax(-1) for i in range(0, len(flat), chunk)])
    return out.reshape(final.shape[:-1])


@dataclass
class Batch:
    """One training batch, already in row form (rows 0..S-1 of each window)."""

    features: torch.Tensor    # [B, S, F]   target features of positions 0..S-1
    input_ids: torch.Tensor   # [B, S]      token i + 1 of row i
    labels: torch.Tensor      # [B, S, N]   target logits at position i + 1 over the draft vocabulary
    argmax: torch.Tensor      # [B, S]      the target's greedy token at position i + 1


def batch_to(batch: Batch, device: torch.device) -> Batch:
    """The batch's tensors on ``device`` (the head's)."""
    return Batch(*(t.to(device, non_blocking=True) for t in (batch.features, batch.input_ids, batch.labels, batch.argmax)))


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast for the matmuls on ``device``'s kind (cpu / cuda)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def resolve_device(name: str) -> torch.device:
    """``name`` as a torch device; one line when this torch cannot use it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ExportError(f"--device {name!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device "
                          "(install a CUDA build of torch on a machine with an NVIDIA GPU, or train on cpu)")
    if device.type not in ("cpu", "cuda"):
        raise ExportError(f"--device {name}: only cpu and cuda are supported")
    return device


def rows_of(window: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, argmax: torch.Tensor) -> Batch:
    """Window tokens x_0..x_{L-1} with per-position signals -> the L - 1 head rows."""
    return Batch(features[:, :-1], window[:, 1:], labels[:, 1:], argmax[:, 1:])


# --------------------------------------------------------------------------------------------
# training-time test

def ttt_mask(s: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive mask [1, 1, S, (step + 1) * S] of the step-``step`` rows over the keys of steps
    0..step (concatenated): row ``i`` sees step-0 keys ``<= i - step`` and the step-``k`` key at
    ``i - step + k`` (k = 1..step)."""
    i = torch.arange(s, device=device)[:, None]
    c = torch.arange(s, device=device)[None, :]
    allowed = torch.cat([c <= i - step] + [c == i - step + k for k in range(1, step + 1)], dim=1)
    return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))[None, None]


def unrolled_forward(head: EagleHead, features: torch.Tensor, input_ids: torch.Tensor,
                     ttt_steps: int) -> list[torch.Tensor]:
    """The head's outputs (``hidden_out``, [B, S, H]) for steps 0..ttt_steps-1 over rows 0..S-1;
    rows ``i < j`` of step ``j`` have no predecessor (their input is zero) and are not valid."""
    b, s, _ = features.shape
    layer = head.midlayer
    emb = head.embed_tokens(input_ids)
    positions = torch.arange(s, device=features.device).expand(b, s)
    hidden = head.fc(features)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    for j in range(ttt_steps):
        if j:
            prev = outs[-1]
            hidden = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        q, k, v = layer.qkv(emb, hidden, positions)
        keys.append(k)
        values.append(v)
        mask = ttt_mask(s, j, q.device).to(q.dtype)
        outs.append(layer.finish(hidden, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask))
    return outs


def ttt_loss(head: EagleHead, batch: Batch, cfg: TrainConfig) -> tuple[torch.Tensor, list[float], list[float]]:
    """(weighted loss, per-step soft cross-entropy, per-step top-1 agreement with the target's
    greedy token) over the valid rows of each step."""
    outs = unrolled_forward(head, batch.features, batch.input_ids, cfg.ttt_steps)
    draft_ids = head.draft_ids()
    total = torch.zeros((), device=batch.features.device)
    ces, accs = [], []
    for j, out in enumerate(outs):
        logits = head.logits(out[:, j:]).float()
        p = torch.softmax(batch.labels[:, j:].float(), dim=-1)
        ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + cfg.step_weight ** j * ce
        with torch.no_grad():
            accs.append((draft_ids[logits.argmax(-1)] == batch.argmax[:, j:]).float().mean().item())
        ces.append(ce.item())
    return total, ces, accs


# --------------------------------------------------------------------------------------------
# batch sources

class StreamSource:
    """Random windows of the token stream (or random rows of fixed ``windows`` [N, >= seq_len],
    e.g. sequences the target generated, at a random offset), target features computed per batch."""

    def __init__(self, model, stream: np.ndarray, cfg: TrainConfig, layers: tuple[int, ...], draft_ids: torch.Tensor,
                 windows: np.ndarray | None = None):
        if windows is not None and (windows.ndim != 2 or windows.shape[1] < cfg.seq_len or not len(windows)):
            raise ExportError(f"training windows must be [N, >= {cfg.seq_len}] token ids, got {list(windows.shape)}")
        if windows is None and len(stream) < cfg.seq_len + 1:
            raise ExportError(f"the data has {len(stream)} tokens, fewer than one window of {cfg.seq_len}")
        self.model, self.stream, self.cfg, self.layers, self.draft_ids = model, stream, cfg, layers, draft_ids
        self.windows = windows

    def next(self, rng: np.random.Generator) -> Batch:
        cfg = self.cfg
        if self.windows is not None:
            rows = rng.integers(0, len(self.windows), size=cfg.batch)
            offs = rng.integers(0, self.windows.shape[1] - cfg.seq_len + 1, size=cfg.batch)
            picked = [self.windows[r, o:o + cfg.seq_len] for r, o in zip(rows, offs)]
        else:
            starts = rng.integers(0, len(self.stream) - cfg.seq_len + 1, size=cfg.batch)
            picked = [self.stream[s:s + cfg.seq_len] for s in starts]
        device = model_device(self.model)
        window = torch.from_numpy(np.stack(picked).astype(np.int64)).to(device)
        with autocast(device, cfg.bf16):
            feats, final = target_forward(self.model, window, self.layers)
            with torch.no_grad():
                labels = draft_logits(self.model, final, self.draft_ids)
                argmax = target_argmax(self.model, final)
        return rows_of(window, feats.float(), labels.float(), argmax)


class FeatureCache:
    """Target features of fixed windows on disk: per shard float16 memmaps of the features
    [n, L, F] and the final normed hidden [n, L, H], int32 tokens and greedy tokens [n, L]; an
    ``index.json`` names the target, layers, window length and data they belong to. Built once
    (shard by shard, so an interrupted build continues), then read by any number of runs."""

    def __init__(self, folder: str | Path, key: dict):
        self.folder = Path(folder)
        self.key = key
        self.index: dict = {"key": key, "shards": [], "complete": False}
        path = self.folder / CACHE_INDEX
        if path.is_file():
            index = json.loads(path.read_text())
            if index.get("key") != key:
                raise ExportError(f"the feature cache '{self.folder}' was built for another target, data, "
                                  "window length or layer choice; give another --feature-cache folder")
            self.index = index

    def _write_index(self) -> None:
        tmp = self.folder / (CACHE_INDEX + ".tmp")
        tmp.write_text(json.dumps(self.index, indent=1) + "\n")
        os.replace(tmp, self.folder / CACHE_INDEX)

    def arrays(self, shard: dict, mode: str = "r") -> dict[str, np.ndarray]:
        n, L, F_, H = shard["n"], self.key["seq_len"], self.key["feature_width"], self.key["hidden"]
        spec = {"features": (np.float16, (n, L, F_)), "final": (np.float16, (n, L, H)),
                "tokens": (np.int32, (n, L)), "argmax": (np.int32, (n, L))}
        return {name: np.memmap(self.folder / f"{shard['name']}.{name}", dtype=dt, mode=mode, shape=shape)
                for name, (dt, shape) in spec.items()}

    def build(self, model, windows: np.ndarray, layers: tuple[int, ...], shard_size: int, bf16: bool,
              progress: bool = True) -> None:
        if self.index["complete"]:
            return
        from tqdm import tqdm

        self.folder.mkdir(parents=True, exist_ok=True)
        done = sum(s["n"] for s in self.index["shards"])
        fp16_max = float(np.finfo(np.float16).max)
        device = model_device(model)
        bar = tqdm(total=len(windows), initial=done, desc="feature cache", unit="win", disable=not progress)
        while done < len(windows):
            chunk = windows[done:done + shard_size]
            shard = {"name": f"shard-{len(self.index['shards']):05d}", "n": len(chunk)}
            arrays = self.arrays(shard, "w+")
            for i in range(0, len(chunk), 4):
                x = torch.from_numpy(chunk[i:i + 4].astype(np.int64)).to(device)
                with autocast(device, bf16):
                    feats, final = target_forward(model, x, layers)
                    with torch.no_grad():
                        argmax = target_argmax(model, final)
                arrays["features"][i:i + len(x)] = feats.clamp(-fp16_max, fp16_max).cpu().numpy()
                arrays["final"][i:i + len(x)] = final.clamp(-fp16_max, fp16_max).cpu().numpy()
                arrays["tokens"][i:i + len(x)] = chunk[i:i + 4]
                arrays["argmax"][i:i + len(x)] = argmax.cpu().numpy()
                bar.update(len(x))
            for a in arrays.values():
                a.flush()
            self.index["shards"].append(shard)
            done += len(chunk)
            self._write_index()
        bar.close()
        self.index["complete"] = True
        self._write_index()

    def argmax_counts(self, vocab: int) -> np.ndarray:
        counts = np.zeros(vocab, dtype=np.int64)
        for shard in self.index["shards"]:
            counts += np.bincount(self.arrays(shard)["argmax"].reshape(-1), minlength=vocab)[:vocab]
        return counts

    def source(self, model, cfg: TrainConfig, draft_ids: torch.Tensor) -> "CacheSource":
        return CacheSource(self, model, cfg, draft_ids)


class CacheSource:
    """Random cached windows; the target's draft-vocabulary logits come from the cached final
    hidden through its LM head rows (no target forward)."""

    def __init__(self, cache: FeatureCache, model, cfg: TrainConfig, draft_ids: torch.Tensor):
        self.shards = [cache.arrays(s) for s in cache.index["shards"]]
        self.offsets = np.cumsum([0] + [s["n"] for s in cache.index["shards"]])
        self.model, self.cfg, self.draft_ids = model, cfg, draft_ids

    def next(self, rng: np.random.Generator) -> Batch:
        picks = rng.integers(0, int(self.offsets[-1]), size=self.cfg.batch)
        parts: dict[str, list[np.ndarray]] = {"features": [], "final": [], "tokens": [], "argmax": []}
        for w in picks:
            s = int(np.searchsorted(self.offsets, w, side="right") - 1)
            for name in parts:
                parts[name].append(np.asarray(self.shards[s][name][w - self.offsets[s]]))
        device = model_device(self.model)
        t = {name: torch.from_numpy(np.stack(v)).to(device) for name, v in parts.items()}
        with torch.no_grad():
            labels = draft_logits(self.model, t["final"].float(), self.draft_ids)
        return rows_of(t["tokens"].long(), t["features"].float(), labels, t["argmax"].long())


def cache_windows(stream: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """Non-overlapping windows of the stream (an evenly spread subset when ``cache_windows``)."""
    n = len(stream) // cfg.seq_len
    if n == 0:
        raise ExportError(f"the data has {len(stream)} tokens, fewer than one window of {cfg.seq_len}")
    windows = stream[: n * cfg.seq_len].reshape(n, cfg.seq_len)
    if cfg.cache_windows and cfg.cache_windows < n:
        windows = windows[np.linspace(0, n - 1, cfg.cache_windows).round().astype(np.int64)]
    return windows


# --------------------------------------------------------------------------------------------
# the head

def init_head(model, hcfg: EagleConfig, draft_ids: np.ndarray, init_fc: str) -> EagleHead:
    """A fresh head: the target's embedding (frozen), LM head rows of the draft vocabulary and
    final-norm weights copied from the target, ``fc`` passing the top feature layer through
    (``init_fc="identity"``) or PyTorch's default init, d2t/t2d for ``draft_ids``."""
    embed = model.get_input_embeddings().weight.detach().float()
    head = EagleHead(hcfg, embed)
    d2t, t2d = vocab_maps(draft_ids, hcfg.vocab_size)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        lm = model.get_output_embeddings().weight
        head.lm_head.weight.copy_(lm[torch.as_tensor(draft_ids, device=lm.device)].float().to(head.lm_head.weight.device))
        norm = getattr(model.model, "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight.float())
        if init_fc == "identity":
            h = hcfg.hidden_size
            head.fc.weight.mul_(0.1)
            head.fc.weight[:, -hcfg.target_hidden_size:] += torch.eye(h, hcfg.target_hidden_size)
        elif init_fc != "random":
            raise ExportError(f"init_fc must be identity or random, not {init_fc!r}")
    return head


def start_from(head: EagleHead, folder: str | Path, target_layers: int) -> None:
    """Copy a saved head's weights (a second training stage) into ``head``; shapes, feature layers
    and draft vocabulary must be the same."""
    from specdec_rt.export.eagle import load_head

    old = load_head(folder, head.embed_tokens.weight.detach(), target_layers)
    # how the layer adds its residual belongs to the weights: a speculators head keeps its own
    head.cfg.norm_before_residual = old.cfg.norm_before_residual
    if old.cfg != head.cfg or not torch.equal(old.d2t, head.d2t):
        raise ExportError(f"the head in '{folder}' has other shapes, feature layers or draft vocabulary than this run")
    head.load_state_dict(old.state_dict())


def trainable(head: EagleHead) -> list[torch.nn.Parameter]:
    return [p for p in head.parameters() if p.requires_grad]


def make_optimizer(head: EagleHead, cfg: TrainConfig) -> torch.optim.AdamW:
    params = trainable(head)
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


# --------------------------------------------------------------------------------------------
# the run

def _save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _stream_hash(stream: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(stream).tobytes()).hexdigest()[:16]


def _target_hash(target: str | Path) -> str:
    cfg = Path(target) / "config.json"
    return hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.is_file() else str(target)


def train_head(target: str | Path, stream: np.ndarray, out: str | Path, cfg: TrainConfig, *,
               model=None, data_stats: dict | None = None, special_ids: list[int] = (),
               feature_cache: str | Path | None = None, resume: bool = False,
               checkpoint_dir: str | Path | None = None, progress: bool = True,
               keep_checkpoint: bool = False, extra_log: dict | None = None,
               windows: np.ndarray | None = None) -> dict:
    """Train a head for ``target`` on the token ``stream`` and write it to ``out`` (published
    layout + training_log.json). Returns the log. With ``stop_after`` it returns after that step,
    leaving a checkpoint (``resume=True`` continues it). ``windows`` ([N, >= seq_len] ids): train
    on these fixed sequences instead of random stream windows (the stream still counts the
    draft vocabulary)."""
    from tqdm import tqdm

    t_start = time.time()
    device = resolve_device(cfg.device)
    model = (model if model is not None else load_target(target)).to(device)
    mc = model.config
    out = Path(out)
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir else out / "checkpoint"
    ckpt_path = ckpt_dir / CHECKPOINT_NAME
    layers = tuple(cfg.feature_layers) if cfg.feature_layers else default_feature_layers(mc.num_hidden_layers)
    cfg.feature_layers = layers
    vocab = mc.vocab_size
    n_draft = cfg.draft_vocab or (vocab if vocab <= FULL_VOCAB_MAX else DEFAULT_DRAFT_VOCAB)
    n_draft = min(n_draft, vocab)
    if cfg.ttt_steps < 1:
        raise ExportError("ttt_steps must be at least 1")

    cache = None
    if feature_cache:
        key = {"target": _target_hash(target), "layers": list(layers), "seq_len": cfg.seq_len,
               "data": _stream_hash(stream), "windows": cfg.cache_windows, "bf16": cfg.bf16,
               "feature_width": len(layers) * mc.hidden_size, "hidden": mc.hidden_size}
        cache = FeatureCache(feature_cache, key)
        fixed = None if windows is None else np.ascontiguousarray(windows[:, :cfg.seq_len]).astype(np.int32)
        cache.build(model, cache_windows(stream, cfg) if fixed is None else fixed, layers, cfg.cache_shard, cfg.bf16,
                    progress)
    source_kind = cfg.vocab_source if cfg.vocab_source != "auto" else ("argmax" if cache else "corpus")
    if n_draft >= vocab:
        draft_ids, source_kind = np.arange(vocab, dtype=np.int64), "full"
    elif source_kind == "argmax":
        if cache is None:
            raise ExportError("vocab_source 'argmax' needs a feature cache (the target's greedy tokens)")
        draft_ids = build_draft_vocab(cache.argmax_counts(vocab), n_draft, special_ids)
    else:
        draft_ids = build_draft_vocab(np.bincount(stream, minlength=vocab)[:vocab], n_draft, special_ids)
    counts = np.bincount(stream, minlength=vocab)[:vocab]
    coverage = float(counts[draft_ids].sum() / max(1, counts.sum()))

    torch.manual_seed(cfg.seed)
    hcfg = head_config(model, cfg, len(draft_ids))
    head = init_head(model, hcfg, draft_ids, cfg.init_fc)
    if cfg.init_from:
        start_from(head, cfg.init_from, mc.num_hidden_layers)
    head.to(device)
    opt = make_optimizer(head, cfg)
    rng = np.random.default_rng(cfg.seed)
    draft_t = torch.as_tensor(draft_ids, device=device)
    source = cache.source(model, cfg, draft_t) if cache else StreamSource(model, stream, cfg, layers, draft_t, windows)

    log: dict = {"target": str(target), "seed": cfg.seed, "args": {**cfg.key(), "feature_layers": list(layers)},
                 "data": {**(data_stats or {}), "stream_tokens": int(len(stream)), "stream_sha256_16": _stream_hash(stream)},
                 "draft_vocab": {"size": int(len(draft_ids)), "source": source_kind,
                                 "corpus_token_coverage": round(coverage, 5)},
                 "head_config": hcfg.to_json(), "feature_cache": str(feature_cache) if feature_cache else None,
                 "steps": [], "resumed_at": [], **(extra_log or {})}
    step, elapsed_before = 0, 0.0
    if resume and ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if state["key"] != log["args"]:
            diff = sorted(k for k in log["args"] if state["key"].get(k) != log["args"][k])
            raise ExportError(f"the checkpoint in '{ckpt_dir}' was made with other settings ({', '.join(diff)})")
        if not np.array_equal(state["draft_ids"], draft_ids):
            raise ExportError(f"the checkpoint in '{ckpt_dir}' has another draft vocabulary")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        step, elapsed_before = state["step"], state["elapsed"]
        log["steps"] = state["log_steps"]
        log["resumed_at"] = state["resumed_at"] + [step]

    def checkpoint() -> None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _save_checkpoint(ckpt_path, {"key": log["args"], "draft_ids": draft_ids, "head": head.state_dict(),
                                     "optimizer": opt.state_dict(), "rng": rng.bit_generator.state,
                                     "torch_rng": torch.get_rng_state(), "step": step,
                                     "elapsed": elapsed_before + time.time() - t_run, "log_steps": log["steps"],
                                     "resumed_at": log["resumed_at"]})

    head.train()
    t_run = time.time()
    stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    bar = tqdm(total=cfg.steps, initial=step, desc="eagle head", unit="step", disable=not progress)
    params = trainable(head)
    while step < stop:
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batch_to(source.next(rng), device)
        with autocast(device, cfg.bf16):
            loss, ces, accs = ttt_loss(head, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        log["steps"].append({"step": step, "lr": lr, "loss": round(loss.item(), 5), "ce": [round(c, 5) for c in ces],
                             "acc": [round(a, 4) for a in accs], "grad_norm": round(float(gnorm), 4),
                             "t": round(elapsed_before + time.time() - t_run, 2)})
        bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs))
        bar.update(1)
        if step < stop and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            checkpoint()
    bar.close()
    log["train_s"] = round(elapsed_before + time.time() - t_run, 1)
    if step < cfg.steps:
        checkpoint()
        return log
    tail = log["steps"][-min(20, len(log["steps"])):]
    log["final"] = {"loss_last20": round(float(np.mean([s["loss"] for s in tail])), 4),
                    "acc_last20": [round(float(np.mean([s["acc"][j] for s in tail])), 4) for j in range(cfg.ttt_steps)]}
    log["wall_s"] = round(time.time() - t_start, 2)
    head.eval()
    save_head(head, out, dtype=getattr(torch, cfg.save_dtype))
    (out / LOG_NAME).write_text(json.dumps(log, indent=1) + "\n")
    if not keep_checkpoint and ckpt_path.is_file():
        ckpt_path.unlink()
        if ckpt_dir.is_dir() and not any(ckpt_dir.iterdir()):
            ckpt_dir.rmdir()
    return log


# --------------------------------------------------------------------------------------------
# command line

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="specdec-train-head", description="Train an EAGLE-3 feature head for a "
                                 "Hugging Face causal LM (training-time test, soft labels from the target).")
    ap.add_argument("--target", required=True, help="the target checkpoint folder (Hugging Face)")
    ap.add_argument("--data", required=True, nargs="+", help="text files, .jsonl ({text} or chat {messages}) or folders")
    ap.add_argument("--out", required=True, help="the head folder to write")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training window")
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--schedule", choices=("cosine", "linear"), default=d.schedule)
    ap.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--grad-clip", type=float, default=d.grad_clip)
    ap.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    ap.add_argument("--step-weight", type=float, default=d.step_weight, help="loss weight of TTT step j: w**j")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help=f"draft vocabulary size (default: the whole vocabulary up to {FULL_VOCAB_MAX}, else "
                         f"{DEFAULT_DRAFT_VOCAB})")
    ap.add_argument("--vocab-source", choices=("auto", "argmax", "corpus"), default=d.vocab_source,
                    help="count the target's greedy tokens (needs --feature-cache) or the corpus tokens")
    ap.add_argument("--feature-layers", default=None, help="0-based target layers a,b,c (default: low/mid/high)")
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--init-fc", choices=("identity", "random"), default=d.init_fc)
    ap.add_argument("--init-from", default=None, help="start from this head folder (a second stage)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (CPUs with bf16 support, GPUs)")
    ap.add_argument("--device", default="cpu",
                    help="torch device for the target and the head: cpu (default) or cuda[:N] (a CUDA build of "
                         "torch; minutes instead of days for a 1.5B target)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--feature-cache", default=None, help="folder for cached target features (built once, reused)")
    ap.add_argument("--cache-windows", type=int, default=None, help="windows kept in the feature cache")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint if there is one")
    ap.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    ap.add_argument("--checkpoint-dir", default=None, help="default: OUT/checkpoint")
    ap.add_argument("--keep-checkpoint", action="store_true")
    ap.add_argument("--stop-after", type=int, default=None, help="leave after this step (checkpointed)")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=d.save_dtype,
                    help="dtype of the saved weights")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(a).items() if k in names})
    cfg.num_heads, cfg.num_kv_heads, cfg.save_dtype = a.heads, a.kv_heads, a.dtype
    if a.feature_layers:
        try:
            cfg.feature_layers = tuple(int(x) for x in a.feature_layers.split(","))
        except ValueError:
            raise ExportError(f"--feature-layers wants comma-separated integers, not {a.feature_layers!r}") from None
    return cfg


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        cfg = config_from_args(a)
        resolve_device(cfg.device)  # a device this torch cannot use: one line before anything loads
        if a.threads:
            torch.set_num_threads(a.threads)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.target)
        stream, stats = tokenize_data(a.data, tokenizer)
        stats["inputs"] = [str(p) for p in a.data]
        log = train_head(a.target, stream, a.out, cfg, data_stats=stats, special_ids=special_token_ids(tokenizer),
                         feature_cache=a.feature_cache, resume=a.resume, checkpoint_dir=a.checkpoint_dir,
                         progress=not a.no_progress, keep_checkpoint=a.keep_checkpoint)
    except ExportError as exc:
        print(f"specdec-train-head: error: {exc}", file=sys.stderr)
        return 2
    if "final" in log:
        f = log["final"]
        print(f"head written to {a.out}: loss {f['loss_last20']}, top-1 per step {f['acc_last20']}, "
              f"{log['wall_s']} s")
    else:
        print(f"stopped after step {log['steps'][-1]['step'] if log['steps'] else 0}; --resume continues")
    return 0


if __name__ == "__main__":
    sys.exit(main())
