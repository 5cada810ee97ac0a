"""Random-weight checkpoints with the published configs of real models, for the scale benchmark.

No hub access is needed: each config below is copied from the model's published config.json, the
weights are drawn at random (transformers' own init, ``initializer_range``) and saved with
``save_pretrained`` in bfloat16, as the hub ships these models, with a word-level tokenizer of the
real tokenizer's size. A checkpoint already in the cache folder is reused.

    python scripts/scale_checkpoints.py --cache /work/cache/ckpt qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

QWEN_COMMON = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", attention_dropout=0.0,
    bos_token_id=151643, eos_token_id=151643, initializer_range=0.02, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True, use_cache=True, use_sliding_window=False,
    vocab_size=151936, torch_dtype="bfloat16",
)

CONFIGS = {
    # Qwen/Qwen2.5-0.5B config.json
    "qwen2.5-0.5b": dict(QWEN_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         max_window_layers=24, sliding_window=32768),
    # Qwen/Qwen2.5-1.5B config.json
    "qwen2.5-1.5b": dict(QWEN_COMMON, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                         max_window_layers=21, sliding_window=131072),
    # Qwen/Qwen2.5-3B config.json
    "qwen2.5-3b": dict(QWEN_COMMON, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                       max_window_layers=70, sliding_window=32768),
}
TOKENIZER_SIZE = dict.fromkeys(CONFIGS, 151665)  # Qwen2.5's tokenizer: 151643 + 22 added


def build(name: str, cache: Path) -> Path:
    out = cache / name
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        print(f"{name}: reusing {out}")
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers import make_wordlevel_tokenizer

    t0 = time.perf_counter()
    cfg_dict = dict(CONFIGS[name])
    cfg = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(str(tmp))
    make_wordlevel_tokenizer(TOKENIZER_SIZE[name], tmp)
    tmp.rename(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n / 1e9:.3f}B parameters written to {out} in {time.perf_counter() - t0:.0f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default="/work/cache/ckpt", help="folder of the checkpoints (outside the repo)")
    ap.add_argument("names", nargs="*", default=list(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    args = ap.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        if name not in CONFIGS:
            raise SystemExit(f"unknown checkpoint '{name}'; known: {', '.join(CONFIGS)}")
        build(name, cache)
    print(json.dumps({name: str(cache / name) for name in args.names}))


if __name__ == "__main__":
    main()
