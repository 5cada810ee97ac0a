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

from specdec_rt.runtime.drafters import BATCH_CATCH_UP, DraftReport, ModelDrafter
from specdec_rt.runtime.engine import OrtEngine
from specdec_rt.runtime.masks import NEG_INF, causal_mask, tree_mask
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


class Template:
    """A static tree shape chosen by :class:`~specdec_rt.runtime.tree_policy.TreePolicy`: node 0 is
    the root (the last committed token), node i > 0 hangs under ``parents[i]`` (< i) as the
    draft's choice of ``ranks[i]`` there (greedy: 0 = the draft's top token, 1 = its second;
    sampling: the index of the i.i.d. draw from q). Nodes are in breadth-first order and a chain
    of K tokens is nodes 0..K in a line, so verifying it is an ordinary causal chain call.

    Everything that depends only on the shape is computed once per template and cached by the
    policy: depths, children, the verify mask's tree block, and per draft level the rows fed to
    the draft and their mask block over the draft's tree region.
    """

    def __init__(self, parents: tuple[int, ...], ranks: tuple[int, ...]) -> None:
        n = len(parents)
        if n == 0 or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
            raise ValueError(f"not a tree in parent-first order: {parents}")
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        if any(depth[i] < depth[i - 1] for i in range(1, n)):
            raise ValueError(f"nodes must be in breadth-first order: {parents}")
        self.parents, self.ranks, self.size = tuple(parents), tuple(ranks), n
        self.depths = np.asarray(depth, dtype=np.int64)
        self.max_depth = int(self.depths.max())
        self.children: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # (rank, node)
        for i in range(1, n):
            self.children[parents[i]].append((ranks[i], i))
        self.width = [max((r for r, _ in c), default=-1) + 1 for c in self.children]
        self.is_chain = all(p == i - 1 for i, p in enumerate(parents) if i) and not any(ranks[1:])
        vis = np.zeros((n, n), dtype=bool)
        for i in range(n):
            vis[i, i] = True
            if i:
                vis[i] |= vis[parents[i]]
        self.visible = vis
        self.block = np.where(vis, np.float32(0), NEG_INF).astype(np.float32)
        # draft levels: level d (1..max_depth-1) feeds the depth-d nodes that have children;
        # their slots in the draft's tree region follow the levels (the root is committed)
        fed = [i for i in range(1, n) if self.children[i]]
        slot = {node: k for k, node in enumerate(fed)}
        self.slots = slot
        self.levels: list[np.ndarray] = []
        self.level_visible: list[np.ndarray] = []  # [F, region so far + F] bool
        self.level_block: list[np.ndarray] = []  # the same as additive float32
        done = 0
        for d in range(1, self.max_depth):
            nodes = [i for i in fed if depth[i] == d]
            v = np.zeros((len(nodes), done + len(nodes)), dtype=bool)
            for r, i in enumerate(nodes):
                a = i
                while a > 0:
                    v[r, slot[a]] = True
                    a = parents[a]
            done += len(nodes)
            self.levels.append(np.asarray(nodes, dtype=np.int64))
            self.level_visible.append(v)
            self.level_block.append(np.where(v, np.float32(0), NEG_INF).astype(np.float32))
        # rows of each draft call drafting this shape: the root's (catch-up) call, then the levels
        self.draft_widths: list[int] = [1] + [len(nodes) for nodes in self.levels] if n > 1 else []

    @classmethod
    def chain(cls, k: int) -> "Template":
        return cls(tuple(range(-1, k)), (0,) * (k + 1))

    @property
    def key(self) -> tuple:
        return (self.parents, self.ranks)

    def __repr__(self) -> str:
        if self.is_chain:
            return f"Template.chain({self.size - 1})"
        return f"Template(nodes={self.size - 1}, depth={self.max_depth}, parents={self.parents}, ranks={self.ranks})"


class FixedTemplate:
    """A shape policy that always answers one template (``tree_shape=Template(...)``: tests, or
    a hand-picked shape); near the context end or the token budget, the chain that fits."""

    def __init__(self, template: Template) -> None:
        self.template = template

    def choose(self, limit: int | None = None) -> Template:
        if limit is not None and self.template.size > limit:
            return Template.chain(max(0, limit - 1))
        return self.template

    def observe(self, depth: int, first: float, second: float | None = None) -> None:
        pass

    def end_step(self) -> None:
        pass

    clock = staticmethod(time.perf_counter)

    def observe_step(self, tpl: Template, seconds: float, draft_seconds: float | None = None,
                     verify_seconds: float | None = None, first_draft_share: float | None = None) -> None:
        pass


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
        root_row = d.advance(d.unseen(tokens))  # catch up; the last token is the root
        base = eng.length  # committed draft prefix incl. the root
        root_pos = base - 1  # the draft's own position of the root (its history may be cut: unseen())
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


class TemplateDrafter:
    """Drafts the tokens of a :class:`Template`: the catch-up call gives the root's row, then
    one draft call per level over the level's nodes that have children.

    Greedy: a node's children are the draft's top choices by rank; the top two of every
    expanded node are kept (``top``) so that the policy learns how often the second choice is
    the target's token, whatever the shape. Sampling: an expanded node draws as many i.i.d.
    tokens from q as it has children (rank r = draw r), as :class:`TreeDrafter` does.

    A chain template runs on the draft's one-token fast path and its drafted tokens stay in the
    draft's cache (the next :meth:`ModelDrafter.observe` rolls back what the target rejected),
    exactly like the chain loop; a branching template runs in a tree region that is rolled back.
    """

    def __init__(self, drafter: ModelDrafter) -> None:
        self.d = drafter
        self.report = DraftReport()  # as ModelDrafter's, for the shape policy

    def build(self, tokens: list[int], tpl: Template, params: SamplingParams, rng: np.random.Generator):
        """Returns (ids [n], top [n, 2] (greedy; -1 where not expanded), q per node or None,
        draws per node or None)."""
        d, eng, n = self.d, self.d.engine, tpl.size
        ids = np.empty(n, dtype=np.int64)
        ids[0] = tokens[-1]
        top = np.full((n, 2), -1, dtype=np.int64)
        greedy = params.greedy
        qs = None if greedy else [None] * n
        draws = None if greedy else [[] for _ in range(n)]
        if n == 1:
            return ids, top, qs, draws
        t0 = time.perf_counter()
        pending = d.unseen(tokens)
        # fresh, restarted or a long gap: the catch-up is prefill (DraftReport.long_catch_up)
        long_catch_up = not d.seen() or len(pending) > BATCH_CATCH_UP
        row = d.advance(pending)  # catch up; the root's row
        first = time.perf_counter() - t0
        fill = self._fill_greedy if greedy else self._fill_sampled
        if tpl.is_chain:
            for depth in range(1, n):
                fill(tpl, [depth - 1], row[None, :], ids, top, qs, draws, params, rng)
                if depth < n - 1:
                    row = d.advance([int(ids[depth])])
            self.report = DraftReport(time.perf_counter() - t0, None, long_catch_up)
            self.report.first_call_share = first / self.report.seconds if self.report.seconds > 0 else None
            return ids, top, qs, draws
        fill(tpl, [0], row[None, :], ids, top, qs, draws, params, rng)
        base = eng.length  # committed draft prefix incl. the root
        root_pos = base - 1  # the draft's own position of the root (its history may be cut: unseen())
        window = eng.info.sliding_window
        for lvl, nodes in enumerate(tpl.levels):
            f = len(nodes)
            pos = np.full(f, root_pos + lvl + 1, dtype=np.int64)
            if window:
                vis = tpl.level_visible[lvl]
                mask = tree_mask(base, vis[:, :-f], pos, window, new_block=vis[:, -f:])
            else:
                block = tpl.level_block[lvl]
                mask = np.zeros((f, base + block.shape[1]), dtype=np.float32)
                mask[:, base:] = block
            logits = eng.forward(ids[nodes], pos, mask)
            eng.commit(f)
            d.calls += 1
            fill(tpl, nodes, logits, ids, top, qs, draws, params, rng)
        eng.rollback(base)  # tree nodes never enter the draft's committed cache
        self.report = DraftReport(time.perf_counter() - t0, None, long_catch_up)
        self.report.first_call_share = first / self.report.seconds if self.report.seconds > 0 else None
        return ids, top, qs, draws

    @staticmethod
    def _fill_greedy(tpl, nodes, x, ids, top, qs, draws, params, rng) -> None:
        # the top choice is masked in place and restored (no copy of the [F, V] logits: this runs
        # once per drafted level)
        rows = np.arange(len(nodes))
        t1 = x.argmax(axis=1)
        saved = x[rows, t1]
        x[rows, t1] = -np.inf
        t2 = x.argmax(axis=1)
        top[nodes, 0] = t1
        top[nodes, 1] = t2
        for r, u in enumerate(nodes):
            for rank, child in tpl.children[u]:
                if rank < 2:
                    ids[child] = t1[r] if rank == 0 else t2[r]
                else:  # further choices by repeated argmax (wide templates only)
                    scratch = x[r].copy()
                    for _ in range(rank - 1):
                        scratch[int(np.argmax(scratch))] = -np.inf
                    ids[child] = int(np.argmax(scratch))
        x[rows, t1] = saved

    def _fill_sampled(self, tpl, nodes, x, ids, top, qs, draws, params, rng) -> None:
        probs = probabilities(x, params)
        vocab = self.d.target_vocab
        for r, u in enumerate(nodes):
            q = probs[r]
            if len(q) < vocab:  # a draft with a smaller (unpadded) vocabulary
                q = np.pad(q, (0, vocab - len(q)))
            qs[u] = q
            drawn = [sample(q, rng) for _ in range(tpl.width[u])]
            draws[u] = drawn
            for rank, child in tpl.children[u]:
                ids[child] = drawn[rank]


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
             shape: TreeShape | None = None, policy=None) -> Iterator[list[int]]:
    """Like :func:`run_chain`, verifying a token tree per target call: a fixed-budget
    :class:`TreeShape`, or with ``policy`` (:class:`~specdec_rt.runtime.tree_policy.TreePolicy`) the
    template it chooses per step."""
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
    if policy is not None:
        yield from _run_templates(target, drafter, tokens, cfg, rng, stats, policy, clock, eos)
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
        clock.commit(stats, tokens, new, drafter, proposed=len(tree) - 1, accepted=n_acc)
        yield new
        if new[-1] in eos:
            return


def _run_templates(target: OrtEngine, drafter: ModelDrafter, tokens: list[int], cfg: LoopConfig,
                   rng: np.random.Generator, stats: GenerationStats, policy, clock: StepClock,
                   eos: set[int]) -> Iterator[list[int]]:
    """The tree loop with a shape policy: per step the policy's template, drafted level by level,
    verified in one call (a chain template as a plain causal chain), the accepted path's K/V
    compacted (nothing to move when the path is the template's first nodes)."""
    params = cfg.params
    greedy = params.greedy
    window = target.info.sliding_window
    dr = TemplateDrafter(drafter)
    d_eng = drafter.engine
    while (generated := stats.new_tokens) < cfg.max_new_tokens:
        p0 = target.length
        if p0 + 1 >= target.max_len:
            return
        # nodes incl. the root: the target's and the draft's room, and no more than the budget
        limit = max(1, min(target.max_len - p0, d_eng.max_len - len(tokens) + 1, cfg.max_new_tokens - generated))
        step_t0 = policy.clock()
        tpl = policy.choose(limit)
        t0 = time.perf_counter()
        d0 = policy.clock()
        ids, top, qs, draws = dr.build(tokens, tpl, params, rng)
        draft_seconds = policy.clock() - d0
        t1 = time.perf_counter()
        stats.time_draft += t1 - t0
        n = tpl.size
        pos = p0 + tpl.depths
        if tpl.is_chain:
            mask = causal_mask(p0, pos, window)
        elif window:
            mask = tree_mask(p0, np.zeros((n, 0), dtype=bool), pos, window, new_block=tpl.visible)
        else:
            mask = np.zeros((n, p0 + n), dtype=np.float32)
            mask[:, p0:] = tpl.block
        v0 = policy.clock()
        logits = target.forward(ids, pos, mask)
        verify_seconds = policy.clock() - v0
        children = tpl.children
        if greedy:
            best = logits.argmax(axis=-1)
            path, u = [0], 0
            while True:
                tok = best[u]
                if top[u, 0] >= 0:  # the draft expanded u: what did it rank first and second?
                    first = tok == top[u, 0]
                    policy.observe(int(tpl.depths[u]) + 1, float(first),
                                   None if first else float(tok == top[u, 1]))
                nxt = next((c for _, c in children[u] if ids[c] == tok), None)
                if nxt is None:
                    break
                path.append(nxt)
                u = nxt
            nxt_tok = int(tok)
        else:
            p_rows = probabilities(logits, params)
            nodes = []
            for i in range(n):
                kids: dict[int, int] = {}
                for _, c in children[i]:
                    kids.setdefault(int(ids[c]), c)
                nodes.append(_Node(int(ids[i]), tpl.parents[i], int(tpl.depths[i]), 0.0, kids,
                                   draws[i], qs[i]))
            path, nxt_tok = _accept_sampled(nodes, p_rows, rng)
            for u in path:
                q = qs[u]
                if q is None:
                    continue
                p = p_rows[u]
                first = float(np.minimum(p, q).sum())  # a draw from q is accepted w.p. sum min(p, q)
                resid = np.maximum(p - q, 0.0)
                z = resid.sum()
                second = float(np.minimum(resid / z, q).sum()) if z > 0 else 0.0
                policy.observe(int(tpl.depths[u]) + 1, first, second)
        policy.end_step()
        if path[-1] == len(path) - 1:  # the first nodes in order (always, for a chain)
            target.commit(len(path))
        else:
            target.compact(path)
        stats.time_verify += time.perf_counter() - t1
        stats.target_calls += 1
        n_acc = len(path) - 1
        if n > 1:
            stats.record(tpl.max_depth, n_acc)
        stats.draft_lengths.append(n - 1)
        new = clip_new_tokens([int(ids[i]) for i in path[1:]] + [nxt_tok], cfg.max_new_tokens - generated, eos)
        clock.commit(stats, tokens, new, drafter, proposed=n - 1, accepted=n_acc)
        # calibrates the shape model to this machine (not from a step that caught up a prompt)
        # (a root-only step drafts nothing, and observe_step learns nothing from it)
        if not dr.report.long_catch_up:
            policy.observe_step(tpl, policy.clock() - step_t0, draft_seconds, verify_seconds,
                                dr.report.first_call_share)
        yield new
        if new[-1] in eos:
            return
