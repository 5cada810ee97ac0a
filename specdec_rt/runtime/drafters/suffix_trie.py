"""The index behind suffix drafting (:mod:`specdec_rt.runtime.drafters.suffix`): every substring of at most
``depth`` tokens counted in a trie (a suffix tree cut at ``depth``), and the proposal it makes
after a context: the most frequent continuation of the longest matching suffix, with the
estimated chance that each of its prefixes is accepted."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec_rt.errors import GenerationInputError

__all__ = ["SuffixTrie", "SuffixProposal", "DEPTH", "POOL_DEPTH", "MIN_PROB", "MAX_SPEC_FACTOR"]

# vLLM's suffix_decoding_max_tree_depth is 24; a request's own index goes deeper so that a match of
# up to DEPTH // 2 tokens may propose as many (copies of 32 tokens and more from the prompt); the
# cross-request pool keeps vLLM's depth (its size grows with depth x pooled tokens)
DEPTH = 64
POOL_DEPTH = 24
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
        # a match leaves depth - m tokens to propose: past depth // 2 a longer match would only
        # shorten the proposal (a pool shallower than the request's own index)
        node, m = self.find(context, min(max_match, self.depth // 2))
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
