"""Suffix drafting (``drafter="suffix"``): propose what followed the current context where this
request, or (opt-in) an earlier request of the same process, already said it.

After SuffixDecoding (Oliaro et al., 2024; vLLM's ``suffix`` speculative method): every substring
of at most ``depth`` tokens is counted in a trie (a suffix tree cut at ``depth``); a proposal
matches the longest suffix of the context that occurred before with a continuation, then follows
the most frequent continuation (ties: the most recent), token by token, while the product of the
continuation frequencies (the proposal's estimated chance of being accepted so far) stays at or
above ``min_prob``. Its length is also capped by ``max_spec_factor`` x the match length: a
one-token match says little. The proposal's score, the sum of those products, is the expected
number of accepted tokens; where a request's own index and the pool both match, the higher score
wins.

Two indexes per proposal:

* the request's own prompt and output, built when the request begins and dropped when it ends
  (never kept across requests on a reused sequence: llama.cpp's ngram-cache kept one and its
  acceptance fell from 86% to 11%, ggml-org/llama.cpp#27852);
* a :class:`SuffixPool` of recent requests' outputs, bounded in tokens (oldest out first) and, by
  default, one per user: a request without a user reads and feeds no pool when users are
  isolated. The pool only changes proposals; every output stays exactly the target's.

Drafting costs microseconds of Python (no model call), so "auto" prices it as free, like prompt
lookup; a weak or stale match costs only a wider verify call, which the policy learns from.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.core.rows import DraftReport, StepReport
from specdec_rt.runtime.drafters.suffix_trie import DEPTH, MAX_SPEC_FACTOR, MIN_PROB, POOL_DEPTH, SuffixProposal, SuffixTrie

if TYPE_CHECKING:
    from specdec_rt.runtime.core.rows import Row
    from specdec_rt.runtime.policies.adaptive import AdaptivePolicy

__all__ = ["SuffixTrie", "SuffixPool", "SuffixDrafter", "SuffixProposal", "SuffixGoodput"]


class SuffixPool:
    """Recent requests' outputs, for suffix drafting across requests (opt-in: ``suffix_pool`` of
    :func:`specdec_rt.load`, ``--suffix-pool`` of the server).

    ``max_tokens`` bounds what it holds (oldest requests leave first); ``per_user``: one index per
    user (a request's ``user``), and none for requests without one, so no user's text is ever
    proposed to another; False: one index for everyone (a single-tenant process). The pool only
    changes proposals, never an output. Thread-safe (a server's worker feeds it while requests
    read it).
    """

    def __init__(self, max_tokens: int = 200_000, per_user: bool = True, depth: int = POOL_DEPTH) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise GenerationInputError(f"the suffix pool's max_tokens must be a positive integer, got {max_tokens!r}")
        self.max_tokens = int(max_tokens)
        self.per_user = bool(per_user)
        self.depth = depth
        self.lock = threading.Lock()
        self._tries: dict[str, SuffixTrie] = {}
        self._held: deque[tuple[str, list[int]]] = deque()
        self.tokens = 0
        self.added = 0  # requests fed so far (statistics)

    @classmethod
    def from_setting(cls, value: SuffixPool | bool | None) -> SuffixPool | None:
        """``load(suffix_pool=...)``: a pool, True (a default pool), or None / False (none)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, cls):
            raise GenerationInputError(f"suffix_pool must be a SuffixPool, True or None, got {value!r}")
        return value

    def key(self, user: str | None) -> str | None:
        """Which index serves ``user`` (None: no pool for this request)."""
        if not self.per_user:
            return ""
        return None if user is None else "u:" + str(user)

    def add(self, user: str | None, tokens: list[int]) -> None:
        """Feed one finished request's output; evict the oldest ones past ``max_tokens``."""
        key = self.key(user)
        if key is None or not tokens:
            return
        tokens = list(tokens[-self.max_tokens:])
        with self.lock:
            trie = self._tries.get(key)
            if trie is None:
                trie = self._tries[key] = SuffixTrie(self.depth)
            trie.extend(trie.cursor(), tokens)
            self._held.append((key, tokens))
            self.tokens += len(tokens)
            self.added += 1
            while self.tokens > self.max_tokens:
                old_key, old = self._held.popleft()
                self._tries[old_key].remove(old)
                self.tokens -= len(old)
                if self._tries[old_key].tokens == 0:
                    del self._tries[old_key]

    def propose(self, user: str | None, context: list[int], k: int, **options) -> SuffixProposal:
        """The pool's proposal for ``user`` (empty where it serves no pool or nothing matches)."""
        key = self.key(user)
        if key is None:
            return SuffixProposal(source="pool")
        with self.lock:
            trie = self._tries.get(key)
            if trie is None:
                return SuffixProposal(source="pool")
            return trie.propose(context, k, source="pool", **options)

    def clear(self) -> None:
        with self.lock:
            self._tries.clear()
            self._held.clear()
            self.tokens = 0


class SuffixGoodput:
    """``num_draft_tokens="auto"`` for the suffix drafter: the chain policy decides whether this
    step speculates at all (its K > 0, probes and back-off included), and each row's proposal is
    then cut where its expected tokens per second peak: the length L maximising
    (1 + s * sum_{j<=L} P_j) / step_time(L), P_j the proposal's own estimate that its first j
    tokens are accepted, step_time the policy's measured and calibrated cost, s the running
    ratio of accepted to predicted tokens (counts of one or two occurrences overstate P).

    Why: "auto" picks one K for an average proposal from per-position acceptance, while suffix
    proposals are bimodal (a copied stretch is nearly sure, a fresh one nearly hopeless):
    measured on multi-turn edits (Qwen2.5-Coder int4 pair), a fixed K = 12 decoded 2.85x
    target-only against auto's 2.51x."""

    def __init__(self, policy: AdaptivePolicy) -> None:
        self.policy = policy
        self.clock = policy.clock
        self.predicted = self.accepted = 1.0  # decayed sums (a neutral start: s = 1)

    @property
    def calibration(self) -> float:
        return min(1.0, max(0.05, self.accepted / self.predicted))

    def choose(self, width: int = 1) -> int:
        return self.policy.k_max if self.policy.choose(width) > 0 else 0

    def observe(self, proposed: int, accepted: int) -> None:
        self.policy.observe(proposed, accepted)

    def observe_step(self, k: int, seconds: float, width: int = 1, **measured) -> None:
        self.policy.observe_step(k, seconds, width, **measured)

    def learn(self, predicted: float, accepted: int) -> None:
        """One verified proposal: ``predicted`` expected accepted tokens, ``accepted`` real ones."""
        self.predicted = 0.95 * self.predicted + predicted
        self.accepted = 0.95 * self.accepted + accepted

    def length(self, probs: list[float], width: int) -> int:
        """Where a proposal with acceptance estimates ``probs`` is best cut (0: not at all)."""
        return self.batch_length([probs], width)

    def batch_length(self, rows: list[list[float]], width: int) -> int:
        """One cut L for a step's proposals (acceptance estimates per row): a verify call costs
        what its longest row makes it for every row of the batch, so L maximises the batch's
        expected tokens, each row's up to min(L, its length), over the step time at K = L
        (cut per row, one sure match widened the call for all eight rows of a batch)."""
        s, step_time = self.calibration, self.policy.step_time
        longest = max((len(p) for p in rows), default=0)
        gains = np.zeros(longest + 1)  # expected accepted tokens of the whole step, cut at L
        for p in rows:
            if p:
                cum = np.cumsum(p)
                gains[1:len(p) + 1] += cum
                gains[len(p) + 1:] += cum[-1]
        base = float(width)  # every row's own token, drafted or not
        best_len, best = 0, base / step_time(0, width)
        for n in range(1, longest + 1):
            rate = (base + s * gains[n]) / step_time(n, width)
            if rate > best:
                best_len, best = n, rate
        return best_len


class _Sequence:
    """One request's own index: its tokens so far and who asked (for the pool at its end)."""

    def __init__(self, prompt_len: int, depth: int) -> None:
        self.prompt_len = prompt_len
        self.trie = SuffixTrie(depth)
        self.cursor = self.trie.cursor()
        self.fed = 0  # tokens of the sequence in the index
        self.tokens: list[int] = []  # the committed tokens, as last observed
        self.user: str | None = None

    def sync(self, tokens: list[int]) -> None:
        """Feed the tokens committed since the last proposal (rebuild if they are not an
        extension of what was fed: never the case for committed tokens, kept as a guard)."""
        if len(tokens) < self.fed:
            self.trie = SuffixTrie(self.trie.depth)
            self.cursor, self.fed = self.trie.cursor(), 0
        if len(tokens) > self.fed:
            self.cursor = self.trie.extend(self.cursor, tokens[self.fed:])
            self.fed = len(tokens)
        self.tokens = tokens


class SuffixDrafter:
    """Proposals from the request's own suffix index and, if given, a :class:`SuffixPool`.

    ``max_match``: the longest context suffix matched (at most ``depth - 1``); ``min_score``: a
    proposal whose expected accepted tokens fall below it is dropped (0 here; the hybrid drafter
    sets it so that a weak match falls back to the draft model); ``pool_min_match``: pool
    matches shorter than this are ignored (a one-token match in other requests says little).
    """

    name = "suffix"

    def __init__(self, pool: SuffixPool | None = None, *, depth: int = DEPTH, max_match: int | None = None,
                 min_prob: float = MIN_PROB, max_spec_factor: float = MAX_SPEC_FACTOR,
                 min_score: float = 0.0, pool_min_match: int = 2) -> None:
        self.pool = pool
        self.depth = depth
        self.max_match = min(max_match or depth // 2, depth - 1)
        self.min_prob = min_prob
        self.max_spec_factor = max_spec_factor
        self.min_score = min_score
        self.pool_min_match = pool_min_match
        self.goodput: SuffixGoodput | None = None  # "auto": cuts each proposal (set by planning)
        self._last: dict[int, SuffixProposal] = {}  # per sequence: the proposal being verified
        self._seqs: dict[int, _Sequence] = {}
        self.calls = 0
        self.time = 0.0
        self.report = DraftReport()
        self.proposals = {"own": 0, "pool": 0}  # proposals taken per source (statistics)
        self.last: list[SuffixProposal] = []  # the last call's proposals, one per row

    def begin(self, prompt: list[int], seq: int = 0) -> None:
        """A fresh index for the sequence (the prompt is fed at the first proposal)."""
        self._seqs[seq] = _Sequence(len(prompt), self.depth)

    def _sequence(self, row: Row) -> _Sequence:
        s = self._seqs.get(row.seq)
        if s is None:
            s = self._seqs[row.seq] = _Sequence(len(row.tokens), self.depth)  # begin() was not called
        return s

    def proposal(self, row: Row, k: int) -> SuffixProposal:
        """The best proposal for ``row`` (empty when nothing matches well enough)."""
        s = self._sequence(row)
        s.user = row.cfg.user
        s.sync(row.tokens)
        if k <= 0:
            return SuffixProposal()
        opts = dict(max_match=self.max_match, min_prob=self.min_prob, max_spec_factor=self.max_spec_factor)
        best = s.trie.propose(row.tokens, k, source="own", **opts)
        if self.pool is not None:
            other = self.pool.propose(s.user, row.tokens, k, min_match=self.pool_min_match, **opts)
            if other.score > best.score:
                best = other
        if best.tokens and best.score < self.min_score:
            return SuffixProposal(match=best.match, source=best.source)
        return best

    def propose(self, rows: list[Row], ks: list[int]) -> list[tuple[list[int], np.ndarray | None]]:
        t0 = time.perf_counter()
        self.last = [self.proposal(row, k) for row, k in zip(rows, ks)]
        if self.goodput is not None:  # one cut for the step: its verify is as wide as its longest row
            n = self.goodput.batch_length([p.probs for p in self.last], len(rows))
            for p in self.last:
                p.tokens, p.probs = p.tokens[:n], p.probs[:n]
        for row, p in zip(rows, self.last):
            if p.tokens:
                self.proposals[p.source] += 1
            self._last[row.seq] = p
        spent = time.perf_counter() - t0
        self.time += spent
        self.report = DraftReport(spent)
        return [(p.tokens, None) for p in self.last]

    def observe(self, step: StepReport) -> None:
        s = self._seqs.get(step.seq)
        if s is not None:
            s.tokens = step.tokens
        p = self._last.pop(step.seq, None)
        # only what this drafter proposed (in a hybrid, an empty proposal went to the model)
        if p is not None and p.tokens and step.proposed and self.goodput is not None:
            self.goodput.learn(sum(p.probs[:step.proposed]), step.accepted)

    def end(self, seq: int = 0) -> None:
        """The request is over: its index is dropped, its output feeds the pool (if any)."""
        s = self._seqs.pop(seq, None)
        if s is not None and self.pool is not None:
            self.pool.add(s.user, s.tokens[s.prompt_len:])
