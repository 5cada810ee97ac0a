"""Tokenizer wrapper over the ``tokenizers`` library, with incremental detokenization."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, path: str | Path) -> None:
        self.tok = Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens=False`` skips the post-processor (e.g. an automatic BOS): chat
        templates write their special tokens themselves."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Emit text as tokens are committed, never splitting a multi-byte character.

    Byte-level BPE tokens can end mid-character; such text ends in U+FFFD and is held back until
    the next token completes it. Decoding restarts a few tokens back so merges across the
    boundary (leading spaces, Metaspace) come out as a full decode would give them.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""
        piece = full[len(prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        return piece

    def flush(self) -> str:
        """At the end of generation: the text still held back (an incomplete character decodes
        to U+FFFD, as a full decode gives it), so the pieces add up to ``decode(ids)``."""
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text):] if len(full) > len(prefix_text) else ""
