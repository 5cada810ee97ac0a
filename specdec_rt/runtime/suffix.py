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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.rows import DraftReport, StepReport

if TYPE_CHECKING:
    from specdec_rt.runtime.rows import Row

__all__ = ["SuffixTrie", "SuffixPool", "SuffixDrafter", "SuffixProposal"]

DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth
MIN_PROB = 0.1  # vLLM's suffix_decoding_min_token_prob
MAX_SPEC_FACTOR = 1.0  # vLLM's suffix_decoding_max_spec_factor


class _Node:
    """A substring: how often it occurred (``count``), how often something followed it
    (``cont``), when it last occurred (``last``), and what followed (``children``)."""

    __slots__ = ("count", "cont", "last", "children")

    def __init__(self) -> None:
        self.count = 0
        self.cont = 0
        self.last = 0
        self.children: dict[int, _Node] = {}


@dataclass
class SuffixProposal:
    """A continuation: ``tokens``, the estimated chance that each prefix is accepted (``probs``,
    non-increasing), the context suffix it continues (``match`` tokens) and where it came from."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match: int = 0
    source: str = ""

    @property
    def score(self) -> float:
        """Expected accepted tokens."""
        return float(sum(self.probs))


class SuffixTrie:
    """Occurrence counts of every substring of at most ``depth`` tokens of the sequences fed to
    it. A sequence is fed incrementally through a cursor (its suffix nodes, one per length
    0..depth-1), each new token costing ``depth`` dictionary updates."""

    def __init__(self, depth: int = DEPTH) -> None:
        if depth < 2:
            raise GenerationInputError(f"the suffix index depth must be at least 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.clock = 0  # insertion counter: a node's ``last`` orders occurrences by recency
        self.tokens = 0  # tokens fed and not removed

    def cursor(self) -> list[_Node]:
        """Where a new sequence starts."""
        return [self.root]

    def extend(self, cursor: list[_Node], tokens: list[int]) -> list[_Node]:
        """Feed ``tokens`` after the sequence ``cursor`` stands at; returns the new cursor."""
        depth, root = self.depth, self.root
        for t in tokens:
            self.clock += 1
            nxt = [root]
            for node in cursor:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                child.last = self.clock
                node.cont += 1
                nxt.append(child)
            cursor = nxt[:depth]  # depths 0..depth-1: their children reach ``depth``
        self.tokens += len(tokens)
        return cursor

    def remove(self, tokens: list[int]) -> None:
        """Undo feeding ``tokens`` as one whole sequence (the pool's eviction)."""
        cursor = [self.root]
        for t in tokens:
            nxt = [self.root]
            for node in cursor:
                child = node.children[t]
                child.count -= 1
                node.cont -= 1
                if child.count == 0:
                    del node.children[t]
                nxt.append(child)
            cursor = nxt[:self.depth]
        self.tokens -= len(tokens)

    def find(self, context: list[int], max_match: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` (at most ``max_match`` tokens) that
        occurred with a continuation, and its length; (None, 0) if even its last token never
        did. Binary search: a suffix that occurred with a continuation has shorter suffixes that
        did too (at the same place)."""
        lo, hi, best = 1, min(max_match, len(context), self.depth - 1), (None, 0)
        while lo <= hi:
            m = (lo + hi) // 2
            node = self.root
            for t in context[len(context) - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.cont > 0:
                best, lo = (node, m), m + 1
            else:
                hi = m - 1
        return best

    def propose(self, context: list[int], k: int, *, max_match: int, min_match: int = 1,
                min_prob: float = MIN_PROB, max_spec_factor: float = MAX_SPEC_FACTOR,
                source: str = "") -> SuffixProposal:
        """Up to ``k`` tokens after ``context`` (see the module doc)."""
        node, m = self.find(context, max_match)
        if node is None or m < min_match:
            return SuffixProposal(source=source)
        limit = min(k, max(1, int(max_spec_factor * m)), self.depth - m)
        out = SuffixProposal(match=m, source=source)
        p = 1.0
        while len(out.tokens) < limit and node.cont > 0:
            tok, child = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].last))
            p *= child.count / node.cont
            if p < min_prob:
                break
            out.tokens.append(tok)
            out.probs.append(p)
            node = child
        return out


class SuffixPool:
    """Recent requests' outputs, for suffix drafting across requests (opt-in: ``suffix_pool`` of
    :func:`specdec_rt.load`, ``--suffix-pool`` of the server).

    ``max_tokens`` bounds what it holds (oldest requests leave first); ``per_user``: one index per
    user (a request's ``user``), and none for requests without one, so no user's text is ever
    proposed to another; False: one index for everyone (a single-tenant process). The pool only
    changes proposals, never an output. Thread-safe (a server's worker feeds it while requests
    read it).
    """

    def __init__(self, max_tokens: int = 200_000, per_user: bool = True, depth: int = DEPTH) -> None:
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
        for p in self.last:
            if p.tokens:
                self.proposals[p.source] += 1
        spent = time.perf_counter() - t0
        self.time += spent
        self.report = DraftReport(spent)
        return [(p.tokens, None) for p in self.last]

    def observe(self, step: StepReport) -> None:
        s = self._seqs.get(step.seq)
        if s is not None:
            s.tokens = step.tokens

    def end(self, seq: int = 0) -> None:
        """The request is over: its index is dropped, its output feeds the pool (if any)."""
        s = self._seqs.pop(seq, None)
        if s is not None and self.pool is not None:
            self.pool.add(s.user, s.tokens[s.prompt_len:])
