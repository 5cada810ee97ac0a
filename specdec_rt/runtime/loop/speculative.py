"""The decoding loop: prefill, then draft -> verify -> accept -> commit until done.

One loop serves one sequence and a batch of them alike: a batch is a list of rows (:class:`Row`),
each with its own tokens, limits, sampling parameters and random generator, and every step
drafts for all rows, verifies all of them in one target call and accepts per row. Decoding one
prompt is a batch of one row (:func:`run_chain`). Rows join and leave between steps (continuous
batching): a finished row's cache sequence goes to the next waiting prompt, whose prefill runs
as its own call before it joins the batched steps.

Invariant, per row: the target cache holds every committed token except the last one (the
next verify call's first input), and a row ends where plain decoding ends, when its tokens fill
the context (:func:`~specdec_rt.runtime.core.rows.draft_room`). Greedy output is target-only
greedy token for token; sampled output follows the target's processed distribution exactly. A
row's logits are the same bits in a batch as alone (``probe_batch_invariance``) and each row
draws from its own generator, so with a fixed K a row's output does not depend on other rows.

With ``overlap`` (:mod:`specdec_rt.runtime.loop.overlap`) the verify call runs on a worker thread
while the draft goes on past the block being verified (the *look-ahead*, kept in ``Row.ahead``);
the next step's block then starts with what the look-ahead already drafted, if the target kept
it. Without overlap the same code runs with an empty look-ahead.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

from specdec_rt.errors import ContextOverflowError, GenerationInputError
from specdec_rt.runtime.core.rows import (WAIT, DraftLengthPolicy, LoopConfig, Row, RowView, StepClock,
                                          draft_room)
from specdec_rt.runtime.core.sampling import (SamplingParams, accept_chain_greedy, accept_chain_sampled,
                                              probabilities, sample)
from specdec_rt.runtime.core.stats import BatchStats, GenerationStats
from specdec_rt.runtime.drafters.base import Drafter
from specdec_rt.runtime.engines.ort import OrtEngine
from specdec_rt.runtime.loop.overlap import VerifyThread, lookahead_length

T = TypeVar("T")
U = TypeVar("U")

__all__ = ["WAIT", "DraftLengthPolicy", "LoopConfig", "Row", "RowView", "StepClock", "run_batch", "run_chain",
           "prefill", "clip_new_tokens"]


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


def _eos(cfg: LoopConfig) -> set[int]:
    return set() if cfg.ignore_eos else set(cfg.eos_token_ids)


def prefill(target: OrtEngine, drafter, prompt: list[int], params: SamplingParams,
            rng: np.random.Generator, stats: GenerationStats, t_start: float, seq: int = 0,
            owner: str | None = None) -> list[int]:
    """Prompt through the target (and the drafter), first token picked; returns the committed
    tokens. Runs as the sequence's own calls, whatever else is in flight.

    Leaves the loop invariant in place: the target cache holds every token but the last. Where
    the sequence still holds the K/V of a prefix of ``prompt`` (an earlier turn of the same
    conversation) and the target's prompt K/V are bit for bit decoding's
    (``target.prefix_reuse``), that prefix is kept and only the rest is run: the same logits, so
    the same output, as a fresh prefill. ``owner``: who asks (OpenAI's ``user``), for engines
    that reuse within one owner only.
    """
    reuse = target.reusable_prefix(prompt, seq, owner)
    if reuse:
        target.rollback(reuse, seq)
    else:
        target.reset(seq)
    tokens = list(prompt) + [_pick(target.extend(prompt[reuse:], seq=seq), params, rng)]
    target.track(tokens, seq, owner)  # grows with the row's commits: what a later prompt may reuse
    stats.cached_prompt_tokens = reuse
    if drafter is not None:
        drafter.begin(prompt, seq)
    stats.time_prefill = stats.time_total = time.perf_counter() - t_start
    stats.new_tokens = 1
    return tokens


def start_row(target: OrtEngine, drafter, row: Row) -> list[int]:
    """Prefill a row on its own sequence (``row.seq``); returns its first token (the loop's first
    output), with ``row.finished`` set if that token already ends it. Chains and trees alike."""
    t_start = time.perf_counter()
    row.tokens = prefill(target, drafter, row.prompt, row.cfg.params, row.rng, row.stats, t_start, row.seq,
                         row.cfg.user)
    row.clock = StepClock(target, drafter, t_start)
    if row.tokens[-1] in _eos(row.cfg):
        row.finished = "eos"
    elif row.cfg.max_new_tokens <= 1:
        row.finished = "length"
    return [row.tokens[-1]]


def commit_row(target: OrtEngine, drafter, row: Row, candidates: list[int], proposed: int, accepted: int,
               depth: int | None = None) -> list[int]:
    """The commit every loop shares (chain, tree, batch, overlap), after the target's cache kept
    the accepted K/V: count the call and the drafts (per position up to ``depth``, the drafted
    depth of a tree; default ``proposed``), cut ``candidates`` (accepted drafts + the target's
    token) at the budget and the first EOS, append them to the row and tell the drafter
    (:meth:`StepClock.commit`), and mark why the row ends, if it does. Returns the new tokens."""
    stats = row.stats
    stats.target_calls += 1
    if proposed:
        stats.record(proposed if depth is None else depth, accepted)
    stats.draft_lengths.append(proposed)
    eos = _eos(row.cfg)
    new = clip_new_tokens(candidates, row.cfg.max_new_tokens - row.generated, eos)
    if len(new) <= accepted:  # cut at the budget or an EOS: the row ends, nothing lies ahead
        row.drop_ahead(len(row.ahead))
    row.clock.commit(stats, row.tokens, new, drafter, row.seq, row.ahead, proposed, accepted)
    if new[-1] in eos:
        row.finished = "eos"
    elif row.generated >= row.cfg.max_new_tokens:
        row.finished = "length"
    elif target.lengths[row.seq] + 1 >= target.max_len:
        row.finished = "context"
    return new


def keep_path(target: OrtEngine, drafter, row: Row, ids, path: list[int], nxt: int, proposed: int,
              depth: int | None = None) -> list[int]:
    """The commit after verification, chains and trees alike: ``ids`` were verified as a token
    tree rooted at the row's last committed token (a chain: node i + 1 the only child of node i)
    and ``path`` (root first) was accepted, with the target's token ``nxt`` after it. The target
    keeps the path's K/V (in place when the path is the call's first slots, as a chain's always
    is; else compacted into them) and the row commits the path's tokens and ``nxt``
    (:func:`commit_row`). Returns the row's new tokens."""
    if path[-1] == len(path) - 1:
        target.commit(len(path), row.seq)
    else:
        target.compact(path, row.seq)
    return commit_row(target, drafter, row, [int(ids[i]) for i in path[1:]] + [nxt], proposed, len(path) - 1,
                      depth)


def _extend(drafter: Drafter, rows: list[Row], counts: list[int]) -> None:
    """Draft ``counts[i]`` more tokens past ``rows[i]``'s committed and ahead tokens."""
    views = [r if not r.ahead else RowView(r.tokens + r.ahead, r.cfg, r.rng, r.seq) for r in rows]
    for r, (d, q) in zip(rows, drafter.propose(views, counts)):
        r.ahead.extend(d)
        if q is not None:
            r.ahead_q.append(q)


def _draft(drafter: Drafter, rows: list[Row], ks: list[int]) -> list[tuple[list[int], np.ndarray | None]]:
    """Each row's block of up to ``ks[i]`` tokens: what the last look-ahead drafted, then more."""
    need = [(r, k - len(r.ahead)) for r, k in zip(rows, ks) if k > len(r.ahead)]
    if need:
        _extend(drafter, [r for r, _ in need], [n for _, n in need])
    return [(r.ahead[:k], r.q_rows(min(k, len(r.ahead)))) for r, k in zip(rows, ks)]


def _look_ahead(drafter: Drafter, rows: list[Row], ks: list[int], max_len: int) -> None:
    """While the target verifies: draft every row on to its guess for the target's next token
    and a whole next block (:func:`lookahead_length`), within its budget and the context."""
    need = []
    for r, k in zip(rows, ks):
        room = min(lookahead_length(k), r.cfg.max_new_tokens - r.generated, max_len - len(r.tokens) - 1)
        if room > len(r.ahead):
            need.append((r, room - len(r.ahead)))
    if need:
        _extend(drafter, [r for r, _ in need], [n for _, n in need])


def _accept(r: Row, drafts: list[int], q: np.ndarray | None, x: np.ndarray,
            guess: int | None) -> tuple[int, int, bool]:
    """(drafts accepted, next token, look-ahead kept) for one row from its verify logits ``x``.

    ``guess``: the look-ahead's token after the block (overlap), tested as one more draft at
    the bonus position; if the target takes it, the look-ahead after it is still valid.
    """
    params, n = r.cfg.params, len(drafts)
    if not drafts and guess is None:  # plain decode step (target-only, or nothing worth drafting)
        return 0, _pick(x[0], params, r.rng), False
    if params.greedy:
        n_acc, nxt = accept_chain_greedy(np.argmax(x, axis=-1), drafts)
        return n_acc, nxt, guess is not None and n_acc == n and nxt == guess
    if guess is None:
        n_acc, nxt = accept_chain_sampled(probabilities(x, params), q, drafts, r.rng)
        return n_acc, nxt, False
    n_acc, nxt = accept_chain_sampled(probabilities(x, params), r.q_rows(n + 1), drafts + [guess], r.rng)
    if n_acc == n + 1:  # the guess passed the accept test: it is the step's last token
        return n, guess, True
    return n_acc, nxt, False


def _step(target: OrtEngine, drafter: Drafter | None, rows: list[Row], k: int,
          policy: DraftLengthPolicy | None, overlap: VerifyThread | None = None) -> list[list[int]]:
    """One draft -> verify -> accept -> commit step over every row; returns each row's new tokens."""
    # draft: up to k tokens per row, fewer where its budget or the context ends
    ks = [max(0, min(k, r.cfg.max_new_tokens - r.generated - 1, draft_room(target, r.seq))) for r in rows]
    proposals: list[tuple[list[int], np.ndarray | None]] = [([], None)] * len(rows)
    observe = None if policy is None else policy.observe_step  # calibrates the policy to what steps cost here
    step_t0 = policy.clock() if observe is not None else 0.0
    draft_seconds = None  # on the policy's clock, for its in-loop draft cost (sequential steps)
    if drafter is not None and any(ks):
        t0 = time.perf_counter()
        d0 = policy.clock() if observe is not None else 0.0
        proposals = _draft(drafter, rows, ks)
        if observe is not None and overlap is None:
            draft_seconds = policy.clock() - d0
        for r in rows:
            r.stats.time_draft += time.perf_counter() - t0

    # verify: [last committed token, drafts...] of every row in one target call
    t0 = time.perf_counter()
    ids = [np.asarray([r.tokens[-1]] + drafts, dtype=np.int64) for r, (drafts, _) in zip(rows, proposals)]
    seqs = [r.seq for r in rows]
    verify_seconds = None
    if overlap is None or drafter is None:
        v0 = policy.clock() if observe is not None else 0.0
        logits = target.forward_rows(seqs, ids)  # causal, at each row's own length
        if observe is not None:
            verify_seconds = policy.clock() - v0
    else:  # the target verifies on the worker thread while the draft looks ahead on this one
        verifying = overlap.submit(target.forward_rows, seqs, ids)
        t1 = time.perf_counter()
        try:
            _look_ahead(drafter, rows, ks, target.max_len)
        finally:
            logits = verifying.result()
        for r in rows:
            r.stats.time_lookahead += time.perf_counter() - t1

    # accept and commit, row by row
    out = []
    for r, (drafts, q), x in zip(rows, proposals, logits):
        stats = r.stats
        guess = r.ahead[len(drafts)] if overlap is not None and len(r.ahead) > len(drafts) else None
        n_acc, nxt, kept = _accept(r, drafts, q, x, guess)
        r.drop_ahead(len(drafts) + 1 if kept else len(r.ahead))
        stats.lookahead_hits += kept
        if drafts and policy is not None:
            policy.observe(len(drafts), n_acc)
        stats.time_verify += time.perf_counter() - t0
        out.append(keep_path(target, drafter, r, [r.tokens[-1]] + drafts, list(range(n_acc + 1)), nxt, len(drafts)))
    report = drafter.report if drafter is not None else None
    if observe is not None and not (report is not None and report.long_catch_up):
        observe(max(len(d) for d, _ in proposals), policy.clock() - step_t0, len(rows), draft_seconds=draft_seconds,
                verify_seconds=verify_seconds, first_draft_share=None if report is None else report.first_call_share)
    return out


class BatchLoop:
    """Rows decoding together: each joins a free cache sequence (prefilled by its own call), the
    joined rows step together (one draft -> verify -> accept -> commit for all), finished rows
    give their sequences back. :func:`run_batch` drives it from a row source; sessions
    (:class:`~specdec_rt.runtime.loop.batch_session.BatchSession`) drive it step by step.

    K is ``policy.choose(width)`` per step, else ``num_draft_tokens``. ``overlap``: verify on that
    thread while the draft looks ahead (:mod:`~specdec_rt.runtime.loop.overlap`).
    """

    def __init__(self, target: OrtEngine, drafter: Drafter | None, max_rows: int = 1, num_draft_tokens: int = 4,
                 policy: DraftLengthPolicy | None = None, batch_stats: BatchStats | None = None,
                 overlap: VerifyThread | None = None,
                 stepper: Callable[[list[Row]], list[list[int]]] | None = None) -> None:
        self.target, self.drafter, self.policy, self.overlap = target, drafter, policy, overlap
        self.stepper = stepper  # another step over the active rows (trees: tree.TreeStep); None: chains
        self.num_draft_tokens = num_draft_tokens
        self.batch_stats = batch_stats
        self.max_rows = max_rows
        # cache sequences, lowest first (one row: sequence 0). Batches with prefix reuse may use
        # every sequence of the engine, so that a conversation finds the one its last turn left
        # (at most max_rows decode at once)
        seqs = getattr(target, "max_batch", 1) if target.prefix_reuse and max_rows > 1 else max_rows
        self.free = list(range(max(seqs, max_rows) - 1, -1, -1))
        self.active: list[Row] = []

    @property
    def has_room(self) -> bool:
        return bool(self.free) and len(self.active) < self.max_rows

    def admit(self, row: Row) -> list[int]:
        """Prefill ``row`` on a free sequence; returns its first token ([] with ``row.error`` set
        when its prompt cannot run, e.g. does not fit)."""
        row.seq = self._sequence_for(row.prompt, row.cfg.user)
        try:
            first = start_row(self.target, self.drafter, row)
        except (ContextOverflowError, GenerationInputError) as exc:
            row.error, row.finished, first = exc, "error", []
        self.active.append(row)
        return first

    def _sequence_for(self, prompt: list[int], owner: str | None) -> int:
        """The free sequence whose cache shares the longest prefix with ``prompt`` (a
        conversation's next turn lands where its last turn's K/V are); with none, the one whose
        held prefix was used least recently (an empty one first), so the others stay reusable."""
        best = len(self.free) - 1  # the lowest free sequence
        if self.target.prefix_reuse and len(self.free) > 1:
            shared = [self.target.reusable_prefix(prompt, q, owner) for q in self.free]
            top = max(range(len(shared)), key=lambda i: (shared[i], i))
            if shared[top] > 0:
                best = top
            else:
                best = min(range(len(self.free)), key=lambda i: (self.target.prefix_stamp(self.free[i]), -i))
        return self.free.pop(best)

    def release(self) -> None:
        """Finished rows (by the loop, or marked by the consumer) leave and free their sequences."""
        if self.drafter is not None:
            for row in self.active:
                if row.finished:
                    self.drafter.end(row.seq)
        self.active = _leave(self.active, self.free)

    def step(self) -> list[tuple[Row, list[int]]]:
        """One batched step of every active row: (row, newly committed ids) per row."""
        self.release()
        if not self.active:
            return []
        if self.stepper is not None:
            k = 0
            new = self.stepper(self.active)
        else:
            k = self.policy.choose(len(self.active)) if self.policy is not None else self.num_draft_tokens
            new = _step(self.target, self.drafter, self.active, k, self.policy, self.overlap)
        if self.batch_stats is not None:
            self.batch_stats.steps += 1
            self.batch_stats.row_steps += len(self.active)
            self.batch_stats.ks.append(k)
        return list(zip(self.active, new))

    def drive(self, source: Iterable[T], admit: Callable[[T], Iterable[U]],
              step: Callable[[], Iterable[U]]) -> Iterator[U]:
        """Admit items of ``source`` whenever a sequence is free (``admit(item)`` prefills it and
        gives what to report; an item :data:`WAIT` means none to admit now, asked again after
        the next step) and step the active rows (``step()``) until the source is exhausted and
        every row finished. What run_batch and BatchSession.run share."""
        waiting = iter(source)
        exhausted = False
        while True:
            while self.has_room and not exhausted:
                item = next(waiting, None)
                if item is None:
                    exhausted = True
                    break
                if item is WAIT:
                    break
                yield from admit(item)
                self.release()
            self.release()  # finished meanwhile (stop strings, cancellations)
            if not self.active:
                if exhausted:
                    return
                continue
            yield from step()
            self.release()  # rows finished in this step make room before the next admissions


def run_batch(target: OrtEngine, drafter: Drafter | None, rows: Iterable[Row], max_rows: int = 1,
              num_draft_tokens: int = 4, policy: DraftLengthPolicy | None = None,
              batch_stats: BatchStats | None = None, overlap: VerifyThread | None = None,
              stepper: Callable[[list[Row]], list[list[int]]] | None = None) -> Iterator[tuple[Row, list[int]]]:
    """Decode ``rows`` with at most ``max_rows`` in flight; yield (row, newly committed ids),
    one pair per row per target call it took part in (its prefill first).

    ``rows`` is consumed lazily: a row is taken when a cache sequence is free (a source that
    yields :data:`WAIT` has none now and is asked again after the next step). A row whose prefill
    fails (e.g. its prompt does not fit) gets ``error`` and ``finished="error"`` and the others go
    on. The consumer may set ``row.finished`` (stop string, cancellation) after any yield: the
    row leaves before the next step. See :class:`BatchLoop` for K, ``overlap`` and ``stepper``.
    """
    loop = BatchLoop(target, drafter, max_rows, num_draft_tokens, policy, batch_stats, overlap, stepper)
    yield from loop.drive(rows, lambda row: [(row, loop.admit(row))], loop.step)


def _leave(active: list[Row], free: list[int]) -> list[Row]:
    """Finished rows give their cache sequences back; returns the rows still decoding."""
    for row in active:
        if row.finished:
            free.append(row.seq)
    free.sort(reverse=True)
    return [r for r in active if not r.finished]


def run_chain(target: OrtEngine, drafter: Drafter | None, prompt: list[int], cfg: LoopConfig,
              rng: np.random.Generator, stats: GenerationStats, num_draft_tokens: int = 4,
              policy: DraftLengthPolicy | None = None,
              overlap: VerifyThread | None = None) -> Iterator[list[int]]:
    """One sequence: a batch of one row. Yield lists of newly committed token ids, one list per
    target call. K is ``policy.choose(1)`` per step, else ``num_draft_tokens``."""
    row = Row(prompt, cfg, rng, stats)
    for _, new in run_batch(target, drafter, [row], 1, num_draft_tokens, policy, overlap=overlap):
        if row.error is not None:
            raise row.error
        yield new
