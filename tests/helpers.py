"""Tiny random-weight checkpoints built from configs, and a real BPE tokenizer for them."""
from __future__ import annotations

import json
import sysconfig
from functools import lru_cache
from pathlib import Path

TEXT_FILES = ("textwrap.py", "shlex.py", "heapq.py")


@lru_cache(maxsize=None)
def _corpus() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((stdlib / f).read_text(encoding="utf-8") for f in TEXT_FILES)


def make_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A byte-level BPE with exactly ``vocab_size`` tokens; id 0 is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_corpus()], trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))


def make_checkpoint(config, out_dir: Path, seed: int = 0) -> Path:
    """Save a random-weight model for ``config`` plus a matching tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger-than-default weights give peaky, input-dependent outputs
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.eval().save_pretrained(str(out_dir))
    make_tokenizer(config.vocab_size, out_dir)
    return out_dir
