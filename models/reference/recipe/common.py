"""Shared helpers for the specdec-rt reference model recipe (corpus listing, data cache, configs)."""
import os
import random
import sysconfig

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REF = os.path.dirname(HERE)                      # models/reference (model card, results, .cache)
# the checkpoints and the prompts ship inside the package (specdec-run --demo finds them there)
PAIR = os.path.join(os.path.dirname(os.path.dirname(REF)), "specdec_rt", "data", "reference")
CACHE = os.path.join(REF, ".cache")              # git-ignored
TOKENIZER_DIR = os.path.join(CACHE, "tokenizer")
EOT = "<|endoftext|>"
EOT_ID = 0
VOCAB_SIZE = 4096
SEQ_LEN = 256

HELDOUT = ["textwrap.py", "bisect.py", "heapq.py", "shlex.py",
           "fnmatch.py", "colorsys.py", "graphlib.py", "getopt.py"]
SKIP_TOP = {"test", "idlelib", "site-packages"}   # top-level stdlib dirs skipped
SKIP_ANY = {"test", "tests", "__pycache__"}      # any path component (nested test packages)

TARGET_SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                    num_key_value_heads=2, intermediate_size=1152)
DRAFT_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=256)


def seed_all(seed):
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def stdlib_root():
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def list_files():
    """Return (train, heldout) lists of (relpath, abspath), sorted by relpath."""
    root = stdlib_root()
    venv = os.environ.get("VIRTUAL_ENV")
    venv = os.path.realpath(venv) if venv else None
    train, held = [], []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        rel_d = os.path.relpath(d, root)
        parts = [] if rel_d == "." else rel_d.split(os.sep)
        if parts and parts[0] in SKIP_TOP:
            dirs[:] = []
            continue
        if any(p in SKIP_ANY for p in parts):
            dirs[:] = []
            continue
        if venv and (os.path.realpath(d) + os.sep).startswith(venv + os.sep):
            dirs[:] = []
            continue
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.normpath(os.path.join(rel_d, f))
            item = (rel, os.path.join(d, f))
            (held if rel in HELDOUT else train).append(item)
    train.sort()
    held.sort()
    assert sorted(r for r, _ in held) == sorted(HELDOUT), held
    return train, held


def read_text(path):
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None  # not counted in the corpus


def iter_texts(items):
    for rel, path in items:
        t = read_text(path)
        if t is not None:
            yield rel, t


def load_tokenizer(path=None):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path or os.path.join(TOKENIZER_DIR, "tokenizer.json"))


def token_streams():
    """Token id streams (uint16) for train and held-out; each file followed by <|endoftext|>.
    Cached in .cache/ (keyed on the tokenizer file)."""
    import hashlib
    tok_path = os.path.join(TOKENIZER_DIR, "tokenizer.json")
    h = hashlib.sha256(open(tok_path, "rb").read()).hexdigest()[:12]
    cache = os.path.join(CACHE, f"tokens-{h}.npz")
    if os.path.exists(cache):
        z = np.load(cache)
        return z["train"], z["heldout"]
    tok = load_tokenizer(tok_path)
    train, held = list_files()
    out = {}
    for name, items in (("train", train), ("heldout", held)):
        texts = [t for _, t in iter_texts(items)]
        encs = tok.encode_batch(texts, add_special_tokens=False)
        ids = []
        for e in encs:
            ids.extend(e.ids)
            ids.append(EOT_ID)
        out[name] = np.asarray(ids, dtype=np.uint16)
    np.savez(cache, **out)
    return out["train"], out["heldout"]


def llama_config(shape):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=1024, rope_theta=10000.0,
                       tie_word_embeddings=False, bos_token_id=EOT_ID, eos_token_id=EOT_ID,
                       pad_token_id=EOT_ID, hidden_act="silu", rms_norm_eps=1e-5,
                       attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                       initializer_range=0.02, **shape)
