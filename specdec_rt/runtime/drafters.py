"""Drafters: whatever proposes tokens for the target to verify, behind one interface."""
from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from specdec_rt.runtime.engine import OrtEngine
from specdec_rt.runtime.sampling import SamplingParams, probabilities, sample


class Drafter(Protocol):
    """Proposes up to ``k`` tokens after ``tokens``.

    Returns (draft tokens, q): q holds the draft's processed probabilities [len, V] when the
    draft sampled from a distribution, or None for deterministic proposals (greedy decoding, or
    prompt lookup).
    """

    name: str

    def start(self, prompt: list[int]) -> None: ...

    def propose(self, tokens: list[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]: ...

    def sync(self, tokens: list[int]) -> None: ...


class ModelDrafter:
    """A small causal LM on its own engine and cache; catches up on tokens it has not seen."""

    name = "model"

    def __init__(self, engine: OrtEngine, target_vocab: int) -> None:
        self.engine = engine
        self.target_vocab = target_vocab
        self._seen: list[int] = []  # tokens whose K/V are committed in the draft cache
        self.calls = 0
        self.time = 0.0
        # stop drafting once the product of the draft's top probabilities falls below this
        # (0 = always draft k tokens); set by the adaptive policy
        self.confidence_floor = 0.0

    def start(self, prompt: list[int]) -> None:
        self.engine.reset()
        self._seen = []

    def _step(self, new_tokens: list[int]) -> np.ndarray:
        eng = self.engine
        if len(new_tokens) == 1:
            row = eng.step(new_tokens[0])
            self._seen.append(new_tokens[0])
            self.calls += 1
            return row
        row = eng.extend(new_tokens)
        self._seen.extend(new_tokens)
        self.calls += 1
        return row

    def propose(self, tokens: list[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        t0 = time.perf_counter()
        room = self.engine.max_len - len(tokens)
        k = min(k, room)
        drafts: list[int] = []
        qs = []
        pending = tokens[len(self._seen):]
        floor = self.confidence_floor
        confidence = 1.0
        for _ in range(k):
            row = self._step(pending)
            if params.greedy:
                tok = int(np.argmax(row))
                if floor:
                    e = np.exp(row - row[tok])
                    confidence /= float(e.sum())
            else:
                q = probabilities(row[None, :], params)[0]
                tok = sample(q, rng)
                qs.append(q)
                confidence *= float(q.max())
            drafts.append(tok)
            pending = [tok]
            if floor and confidence < floor:
                break
        self.time += time.perf_counter() - t0
        if params.greedy or not drafts:
            return drafts, None
        q = np.stack(qs)
        if q.shape[1] < self.target_vocab:  # a draft with a smaller (unpadded) vocab
            q = np.pad(q, ((0, 0), (0, self.target_vocab - q.shape[1])))
        return drafts, q

    def sync(self, tokens: list[int]) -> None:
        """Roll the draft cache back to the longest prefix it shares with ``tokens``."""
        seen = self._seen
        n = min(len(seen), len(tokens))
        start = max(0, n - 64)
        keep = start
        while keep < n and seen[keep] == tokens[keep]:
            keep += 1
        if keep < len(seen):
            del seen[keep:]
            self.engine.rollback(keep)


class PromptLookupDrafter:
    """N-gram lookup over the prompt and the output so far; no second model.

    Finds the most recent earlier occurrence of the longest suffix n-gram (``max_ngram`` down to
    ``min_ngram``) and proposes the tokens that followed it.
    """

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.calls = 0
        self.time = 0.0

    def start(self, prompt: list[int]) -> None:
        pass

    def propose(self, tokens: list[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        t0 = time.perf_counter()
        arr = np.asarray(tokens, dtype=np.int64)
        n_tok = len(arr)
        result: list[int] = []
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            pattern = arr[n_tok - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tok - 1], n)
            hits = np.nonzero((windows == pattern).all(axis=1))[0]
            hits = hits[hits + n < n_tok]
            if len(hits):
                start = int(hits[-1]) + n
                result = arr[start:start + k].tolist()
                break
        self.time += time.perf_counter() - t0
        return result, None

    def sync(self, tokens: list[int]) -> None:
        pass
