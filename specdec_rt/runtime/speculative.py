"""The decoding loop: prefill, then draft -> verify -> accept -> commit until done.

Invariant: the target cache holds every committed token except the last one, which is the first
input of the next verify call. Greedy output is token-for-token target-only greedy; sampled
output follows the target's processed distribution exactly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from specdec_rt.runtime.drafters import Drafter
from specdec_rt.runtime.engine import OrtEngine, causal_mask
from specdec_rt.runtime.sampling import (SamplingParams, accept_chain_greedy, accept_chain_sampled,
                                         probabilities, sample)
from specdec_rt.runtime.stats import GenerationStats

# Speculation policy hook: (stats so far) -> number of draft tokens for the next step.
DraftLengthPolicy = Callable[[GenerationStats], int]


@dataclass
class LoopConfig:
    max_new_tokens: int
    params: SamplingParams
    num_draft_tokens: int = 4
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    policy: DraftLengthPolicy | None = None


def clip_new_tokens(new: list[int], budget: int, eos: set[int]) -> list[int]:
    """Committed tokens of one step, cut at the max_new_tokens budget and after the first EOS."""
    new = new[:budget]
    for i, tok in enumerate(new):
        if tok in eos:
            return new[: i + 1]
    return new


def _pick(row: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(row))
    return sample(probabilities(row[None, :], params)[0], rng)


def prefill(target: OrtEngine, drafter, prompt: list[int], params: SamplingParams,
            rng: np.random.Generator, stats: GenerationStats, t_start: float) -> list[int]:
    """Prompt through the target, first token picked; returns the committed tokens.

    Leaves the loop invariant in place: the target cache holds every token but the last.
    """
    target.reset()
    tokens = list(prompt) + [_pick(target.extend(prompt), params, rng)]
    if drafter is not None:
        drafter.start(prompt)
    stats.time_prefill = stats.time_total = time.perf_counter() - t_start
    stats.new_tokens = 1
    return tokens


class StepClock:
    """Decode-time accounting shared by the chain and tree loops."""

    def __init__(self, target: OrtEngine, drafter, t_start: float) -> None:
        self.engines = [e for e in (target, getattr(drafter, "engine", None)) if e is not None]
        self.t_start = t_start
        self.model_t0 = self._model_time()

    def _model_time(self) -> float:
        return sum(e.model_time for e in self.engines)

    def commit(self, stats: GenerationStats, tokens: list[int], new: list[int], drafter) -> None:
        """Append one step's tokens, let the drafter catch up, refresh the stats."""
        tokens.extend(new)
        if drafter is not None:
            drafter.sync(tokens)
        stats.new_tokens += len(new)
        stats.time_total = time.perf_counter() - self.t_start
        stats.time_in_models = self._model_time() - self.model_t0


def run_chain(target: OrtEngine, drafter: Drafter | None, prompt: list[int], cfg: LoopConfig,
              rng: np.random.Generator, stats: GenerationStats) -> Iterator[list[int]]:
    """Yield lists of newly committed token ids, one list per target call."""
    t_start = time.perf_counter()
    window = target.info.sliding_window
    eos = set() if cfg.ignore_eos else set(cfg.eos_token_ids)
    params = cfg.params
    tokens = prefill(target, drafter, prompt, params, rng, stats, t_start)
    clock = StepClock(target, drafter, t_start)
    yield [tokens[-1]]
    if tokens[-1] in eos or cfg.max_new_tokens <= 1:
        return

    while (generated := stats.new_tokens) < cfg.max_new_tokens:
        p = target.length  # == len(tokens) - 1
        room = target.max_len - p - 1  # positions left for draft tokens in this verify call
        if room < 0:
            return
        k = cfg.policy(stats) if cfg.policy is not None else cfg.num_draft_tokens
        k = max(0, min(k, cfg.max_new_tokens - generated - 1, room))
        drafts: list[int] = []
        q = None
        if drafter is not None and k > 0:
            t0 = time.perf_counter()
            drafts, q = drafter.propose(tokens, k, params, rng)
            stats.time_draft += time.perf_counter() - t0
        t0 = time.perf_counter()
        if not drafts:  # plain decode step (target-only, or nothing worth drafting)
            n_acc, nxt = 0, _pick(target.step(tokens[-1]), params, rng)
        else:
            ids = np.asarray([tokens[-1]] + drafts, dtype=np.int64)
            positions = np.arange(p, p + len(ids), dtype=np.int64)
            logits = target.forward(ids, positions, causal_mask(p, positions, window))
            if params.greedy:
                n_acc, nxt = accept_chain_greedy(np.argmax(logits, axis=-1), drafts)
            else:
                n_acc, nxt = accept_chain_sampled(probabilities(logits, params), q, drafts, rng)
            target.commit(n_acc + 1)
        stats.time_verify += time.perf_counter() - t0
        stats.target_calls += 1
        if drafts:
            stats.record(len(drafts), n_acc)
        stats.draft_lengths.append(len(drafts))
        new = clip_new_tokens(drafts[:n_acc] + [nxt], cfg.max_new_tokens - generated, eos)
        clock.commit(stats, tokens, new, drafter)
        yield new
        if new[-1] in eos:
            return
        if target.length + 1 >= target.max_len:
            return
