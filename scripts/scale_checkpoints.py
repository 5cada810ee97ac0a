"""Build random-weight checkpoints from real published configs (no hub here) into a cache folder.

The configs are the published ones (hidden size, layers, heads, KV heads, vocabulary, rope,
tied embeddings); the weights are random (transformers' own init), saved with
``save_pretrained`` in bf16 as the hub ships them, with a word-level tokenizer of the same
vocabulary size. Acceptance means nothing with random weights; cost, memory and exactness do.

    python scripts/scale_checkpoints.py --cache ~/.cache/specdec-scale qwen2.5-0.5b qwen2.5-0.5b-draft2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

QWEN25 = dict(model_type="qwen2", vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
              bos_token_id=151643, eos_token_id=151643, hidden_act="silu")
CONFIGS = {
    "qwen2.5-0.5b": dict(QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_window_layers=21),
    # the 0.5B with 2 layers: the cheap draft the issue measured with
    "qwen2.5-0.5b-draft2": dict(QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=2,
                                num_attention_heads=14, num_key_value_heads=2, max_window_layers=2),
    "qwen2.5-1.5b": dict(QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_window_layers=21),
}


def build(name: str, cache: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = cache / name
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import make_wordlevel_tokenizer

    cfg = dict(CONFIGS[name])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().save_pretrained(str(out))
    make_wordlevel_tokenizer(config.vocab_size, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+", choices=sorted(CONFIGS))
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "specdec-scale"))
    args = ap.parse_args(argv)
    for name in args.names:
        print(build(name, Path(args.cache)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
