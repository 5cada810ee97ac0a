"""Token-tree speculation: the draft grows a tree, the target verifies it in one call.

Greedy (dynamic tree, EAGLE-2 style): at each depth the ``beam`` best nodes by cumulative draft
log-probability are expanded with their top ``width`` children; after ``depth`` levels the best
``budget`` nodes overall form the tree (ancestor-closed, since a child never scores above its
parent). Acceptance walks down from the root following the target's argmax, so the output is
target-only greedy decoding token for token.

Sampling (SpecInfer-style recursive rejection sampling): each expanded node gets ``width``
i.i.d. draws from the draft's processed distribution q (duplicates share a node, all draws are
kept), so at every node the candidates are i.i.d. q. Walking down, the candidates are tried in
draw order: accept x with probability min(1, p'(x)/q(x)), else p' <- norm(max(0, p' - q)); if
all fail, the token is drawn from p'. Which nodes get expanded may depend on earlier draws (it is
decided before the node's own draws), which keeps every node's candidates i.i.d. q.

The draft evaluates a whole tree level in one call with a tree mask over its own cache; the
target's K/V of the accepted path are compacted into consecutive cache slots afterwards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from specdec_rt.runtime.drafters import ModelDrafter
from specdec_rt.runtime.engine import OrtEngine, tree_mask
from specdec_rt.runtime.sampling import SamplingParams, probabilities, sample
from specdec_rt.runtime.speculative import LoopConfig, StepClock, clip_new_tokens, prefill
from specdec_rt.runtime.stats import GenerationStats


@dataclass
class TreeShape:
    """Node budget (excluding the root), depth, nodes expanded per level, children per node.

    ``min_path_prob``: stop growing the tree when the best node of the newest level has a
    cumulative draft probability below this (the draft's own confidence says deeper levels
    would not be accepted), saving draft calls.
    """

    budget: int = 15
    depth: int = 10
    beam: int = 2
    width: int = 2
    min_path_prob: float = 0.0

    @classmethod
    def for_budget(cls, budget: int) -> "TreeShape":
        """The default shape for a node budget (``num_draft_tokens`` with speculation="tree"):
        a backbone as deep as 70% of the budget, the rest spent on the best side branches.

        Measured on the reference pair: the distilled draft is under-confident (its top
        probability is well below the rate at which the target accepts its top token), so
        ranking nodes by raw cumulative draft probability (EAGLE-2) built wide, shallow trees
        that accepted fewer tokens per call than a chain of the same width; hence the backbone
        and no confidence cut-off by default.
        """
        return cls(budget=budget, depth=max(1, round(0.7 * budget)))


@dataclass
class _Node:
    token: int
    parent: int  # index into the node list; -1 for the root
    depth: int
    score: float  # cumulative draft log-probability (greedy) or expansion priority (sampling)
    children: dict[int, int] = field(default_factory=dict)  # token -> node index
    draws: list[int] = field(default_factory=list)  # sampled candidate tokens, in draw order
    q: np.ndarray | None = None  # draft distribution at this node (sampling)
    slot: int = -1  # slot in the draft's cache region for this step


class TreeDrafter:
    """Builds a token tree with the draft model."""

    def __init__(self, drafter: ModelDrafter, shape: TreeShape) -> None:
        self.d = drafter
        self.shape = shape

    def build(self, tokens: list[int], params: SamplingParams, rng: np.random.Generator) -> list[_Node]:
        d, eng, shape = self.d, self.d.engine, self.shape
        pending = tokens[len(d.seen()):]
        root_row = d._step(pending)  # catch up; the last token is the root
        base = eng.length  # committed draft prefix incl. the root
        root_pos = len(tokens) - 1
        nodes = [_Node(tokens[-1], -1, 0, 0.0)]
        frontier = [0]
        backbone = [0]  # the draft's greedy chain: always expanded, always kept (greedy mode)
        rows = {0: root_row}
        region: list[int] = []  # node index of each slot in the draft's tree region
        room = eng.max_len - base
        for level in range(1, shape.depth + 1):
            created = []
            for ni in frontier:
                if not params.greedy and len(nodes) - 1 + shape.width > shape.budget:
                    break  # sampled trees keep every draw: stop expanding at the node budget
                created += self._expand(nodes, ni, rows[ni], params, rng)
            if level == shape.depth or not created:
                break
            # expand the best few of this level next (decided before their children are drawn)
            created.sort(key=lambda i: -nodes[i].score)
            if np.exp(nodes[created[0]].score) < shape.min_path_prob:
                break
            if params.greedy and nodes[backbone[-1]].children:
                top = max(nodes[backbone[-1]].children.values(), key=lambda i: nodes[i].score)
                backbone.append(top)
                frontier = [top] + [i for i in created if i != top][: shape.beam - 1]
            else:
                frontier = created[: shape.beam]
            if len(region) + len(frontier) > room:
                break
            visible = np.zeros((len(frontier), len(region) + len(frontier)), dtype=bool)
            for r, ni in enumerate(frontier):
                nodes[ni].slot = len(region) + r
                visible[r, len(region) + r] = True
                anc = nodes[ni].parent
                while anc > 0:
                    visible[r, nodes[anc].slot] = True
                    anc = nodes[anc].parent
            region += frontier
            ids = np.asarray([nodes[i].token for i in frontier], dtype=np.int64)
            pos = np.asarray([root_pos + nodes[i].depth for i in frontier], dtype=np.int64)
            # columns: committed prefix (positions 0..base-1), then the tree region
            mask = tree_mask(base, visible[:, :len(region) - len(frontier)], pos, eng.info.sliding_window,
                             new_block=visible[:, len(region) - len(frontier):])
            logits = eng.forward(ids, pos, mask)
            eng.commit(len(frontier))
            d.calls += 1
            rows = {ni: logits[r] for r, ni in enumerate(frontier)}
        eng.rollback(base)  # tree nodes never enter the draft's committed cache
        if params.greedy and nodes[backbone[-1]].children:  # the deepest level's top child
            backbone.append(max(nodes[backbone[-1]].children.values(), key=lambda i: nodes[i].score))
        return self._select(nodes, params, backbone)

    def _expand(self, nodes: list[_Node], ni: int, row: np.ndarray, params: SamplingParams,
                rng: np.random.Generator) -> list[int]:
        node, w = nodes[ni], self.shape.width
        created = []
        if params.greedy:
            # the top w by repeated argmax (w is small: cheaper than a partition of V entries)
            scratch = row.copy()
            top = []
            for _ in range(min(w, len(row))):
                tok = int(np.argmax(scratch))
                top.append(tok)
                scratch[tok] = -np.inf
            best = row[top[0]]
            log_z = float(best + np.log(np.exp(row - best).sum()))
            for tok in top:  # already in descending order
                nodes.append(_Node(tok, ni, node.depth + 1, node.score + float(row[tok]) - log_z))
                node.children[tok] = len(nodes) - 1
                created.append(len(nodes) - 1)
            return created
        q = probabilities(row[None, :], params)[0]
        node.q = q
        for _ in range(w):
            tok = sample(q, rng)
            node.draws.append(tok)
            if tok not in node.children:
                nodes.append(_Node(tok, ni, node.depth + 1, node.score + float(np.log(q[tok]))))
                node.children[tok] = len(nodes) - 1
                created.append(len(nodes) - 1)
        return created

    def _select(self, nodes: list[_Node], params: SamplingParams, backbone: list[int]) -> list[_Node]:
        """Greedy: the backbone, then the best nodes by score up to the budget. Sampling: all
        nodes (every draw must stay)."""
        budget = self.shape.budget
        if params.greedy and len(nodes) - 1 > budget:
            keep = set(backbone[1:budget + 1])
            order = sorted((i for i in range(1, len(nodes)) if i not in keep),
                           key=lambda i: (-nodes[i].score, nodes[i].depth))
            keep |= set(order[:budget - len(keep)])
            for i in list(keep):  # ancestor closure (ties)
                a = nodes[i].parent
                while a > 0:
                    keep.add(a)
                    a = nodes[a].parent
            keep.add(0)
        else:
            keep = set(range(len(nodes)))
        # BFS order: parents before children; re-index
        order = sorted(keep, key=lambda i: (nodes[i].depth, i))
        new_index = {old: new for new, old in enumerate(order)}
        out = []
        for old in order:
            n = nodes[old]
            out.append(_Node(n.token, new_index.get(n.parent, -1), n.depth, n.score,
                             {t: new_index[c] for t, c in n.children.items() if c in new_index},
                             n.draws, n.q))
        return out


def _tree_visibility(tree: list[_Node]) -> np.ndarray:
    n = len(tree)
    vis = np.zeros((n, n), dtype=bool)
    for i, node in enumerate(tree):
        vis[i, i] = True
        if node.parent >= 0:
            vis[i] |= vis[node.parent]
    return vis


def _accept_greedy(tree: list[_Node], argmax: np.ndarray) -> tuple[list[int], int]:
    path, u = [0], 0
    while True:
        a = int(argmax[u])
        child = tree[u].children.get(a)
        if child is None:
            return path, a
        path.append(child)
        u = child


def _accept_sampled(tree: list[_Node], p_rows: np.ndarray, rng: np.random.Generator) -> tuple[list[int], int]:
    path, u = [0], 0
    while True:
        node = tree[u]
        p = p_rows[u]
        accepted = None
        for x in node.draws:
            qx = node.q[x]
            if rng.random() * qx < p[x]:
                accepted = x
                break
            p = np.maximum(p - node.q, 0.0)
            total = p.sum()
            p = p / total if total > 0 else p_rows[u]
        if accepted is None or accepted not in node.children:
            return path, sample(p, rng) if accepted is None else accepted
        u = node.children[accepted]
        path.append(u)


def run_tree(target: OrtEngine, drafter: ModelDrafter, prompt: list[int], cfg: LoopConfig,
             rng: np.random.Generator, stats: GenerationStats,
             shape: TreeShape | None = None) -> Iterator[list[int]]:
    """Like :func:`run_chain`, verifying a token tree per target call."""
    shape = shape or TreeShape()
    t_start = time.perf_counter()
    eos = set() if cfg.ignore_eos else set(cfg.eos_token_ids)
    params = cfg.params
    tokens = prefill(target, drafter, prompt, params, rng, stats, t_start)
    tree_drafter = TreeDrafter(drafter, shape)
    clock = StepClock(target, drafter, t_start)
    yield [tokens[-1]]
    if tokens[-1] in eos or cfg.max_new_tokens <= 1:
        return
    while (generated := stats.new_tokens) < cfg.max_new_tokens:
        p0 = target.length
        if p0 + 1 >= target.max_len:
            return
        t0 = time.perf_counter()
        tree = tree_drafter.build(tokens, params, rng)
        stats.time_draft += time.perf_counter() - t0
        room = target.max_len - p0
        if len(tree) > room:  # near the context end: keep what fits (BFS order keeps parents)
            tree = tree[:room]
            for node in tree:
                node.children = {t: c for t, c in node.children.items() if c < room}
        t0 = time.perf_counter()
        vis = _tree_visibility(tree)
        depth = np.asarray([n.depth for n in tree], dtype=np.int64)
        mask = tree_mask(p0, np.zeros((len(tree), 0), dtype=bool), p0 + depth, target.info.sliding_window,
                         new_block=vis)
        ids = np.asarray([n.token for n in tree], dtype=np.int64)
        logits = target.forward(ids, p0 + depth, mask)
        if params.greedy:
            path, nxt = _accept_greedy(tree, np.argmax(logits, axis=-1))
        else:
            path, nxt = _accept_sampled(tree, probabilities(logits, params), rng)
        target.compact(path)
        stats.time_verify += time.perf_counter() - t0
        stats.target_calls += 1
        n_acc = len(path) - 1
        stats.record(int(depth.max()), n_acc)
        stats.draft_lengths.append(len(tree) - 1)
        new = clip_new_tokens([tree[i].token for i in path[1:]] + [nxt], cfg.max_new_tokens - generated, eos)
        clock.commit(stats, tokens, new, drafter)
        yield new
        if new[-1] in eos:
            return
