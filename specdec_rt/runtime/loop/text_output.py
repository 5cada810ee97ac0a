"""What a generation hands back: its result (text, ids, stats, finish reason) and the text
assembler that turns committed tokens into text (incremental detokenization, stop strings).
Shared by the single-sequence API, batch sessions and the server."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdec_rt.runtime.core.stats import GenerationStats
from specdec_rt.runtime.core.tokenizer import IncrementalDecoder, TextTokenizer


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = "length"  # "length" | "eos" | "stop" | "context" (batches: | "error" | "cancelled")
    prompt_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # batches: why this row failed (finish_reason "error")

    def to_dict(self) -> dict:
        d = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
             "stats": self.stats.to_dict()}
        if self.error is not None:
            d["error"] = self.error
        return d


class TextAssembler:
    """One sequence's text as its tokens are committed: incremental detokenization, with text
    that may be the start of a stop string withheld until it cannot be.

    ``push`` returns the text that can be emitted now; ``stopped`` turns true when a stop string
    completed (the text before it has been emitted, the rest is dropped); ``close`` returns what
    is still held at the end. ``finish``: "length", "eos" or "stop".
    """

    def __init__(self, tokenizer: TextTokenizer, stops: list[str], eos_ids: Sequence[int]) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = stops
        self.eos_ids = set(eos_ids)
        self.held = ""  # text withheld because it may be the start of a stop string
        self.finish = "length"
        self.stopped = False

    def _cut(self) -> int:
        return min((self.held.find(s) for s in self.stops if s in self.held), default=-1)

    def push(self, new: list[int]) -> str:
        piece = self.decoder.push(new)
        if new and new[-1] in self.eos_ids:
            self.finish = "eos"
        if not self.stops:
            return piece
        self.held += piece
        cut = self._cut()
        if cut >= 0:
            self.finish, self.stopped = "stop", True
            return self.held[:cut]
        keep = max(len(s) for s in self.stops) - 1  # a stop string may still be completing
        split = max(0, len(self.held) - keep)
        piece, self.held = self.held[:split], self.held[split:]
        return piece

    def close(self) -> str:
        tail = self.decoder.flush()
        if not self.stops:
            return tail
        self.held += tail
        cut = self._cut()
        if cut >= 0:
            self.held, self.finish = self.held[:cut], "stop"
        held, self.held = self.held, ""
        return held


def finish_reason(text: TextAssembler, prompt_len: int, generated: int, max_new_tokens: int, max_length: int) -> str:
    """Why a sequence ended: the assembler's "length" / "eos" / "stop", or "context" when it ran
    out of positions (``max_length``) before its token budget."""
    if text.finish == "length" and prompt_len + generated >= max_length and generated < max_new_tokens:
        return "context"
    return text.finish
