"""The draft side of tree speculation: :class:`TreeDrafter` grows a dynamic tree (EAGLE-2
style) and :class:`TemplateDrafter` fills a :class:`~specdec_rt.runtime.policies.tree_shapes.Template`
chosen by the shape policy; both evaluate a whole tree level in one draft call with a tree mask
over the draft's own cache and roll that region back afterwards."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specdec_rt.runtime.core.masks import tree_mask
from specdec_rt.runtime.core.sampling import SamplingParams, probabilities, sample
from specdec_rt.runtime.drafters.base import BATCH_CATCH_UP, DraftReport, ModelDrafter
from specdec_rt.runtime.policies.tree_shapes import Template, TreeShape


@dataclass
class TreeNode:
    token: int
    parent: int  # index into the node list; -1 for the root
    depth: int
    score: float  # cumulative draft log-probability (greedy) or expansion priority (sampling)
    children: dict[int, int] = field(default_factory=dict)  # token -> node index
    draws: list[int] = field(default_factory=list)  # sampled candidate tokens, in draw order
    q: np.ndarray | None = None  # draft distribution at this node (sampling)
    slot: int = -1  # slot in the draft's cache region for this step


class TreeSource(Protocol):
    """What a dynamic tree is drafted with (the draft model, or an EAGLE-3 head): ``tree_root``
    catches up and gives the root's row (logits over the target vocabulary), a per-node state
    (None for a draft model; the head's hidden output) and where its tree region starts (``base``,
    committed cache slots) and the root's position; ``tree_level`` runs one level's nodes in one
    call under a tree mask (each with its parent's state) and commits them to the region."""

    engine: object

    def tree_root(self, tokens: list[int], seq: int) -> tuple[np.ndarray, object, int, int]: ...

    def tree_level(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, states: list,
                   seq: int) -> tuple[np.ndarray, list]: ...


class TreeDrafter:
    """Builds a token tree with the draft model or any other :class:`TreeSource`."""

    def __init__(self, drafter: TreeSource, shape: TreeShape) -> None:
        self.d = drafter
        self.shape = shape

    def build(self, tokens: list[int], params: SamplingParams, rng: np.random.Generator,
              seq: int = 0) -> list[TreeNode]:
        """The tree after ``tokens`` (its root: the last one), drafted on the drafter's cache
        sequence ``seq``."""
        d, eng, shape = self.d, self.d.engine, self.shape
        root_row, root_state, base, root_pos = d.tree_root(tokens, seq)  # catch up; the last token is the root
        nodes = [TreeNode(tokens[-1], -1, 0, 0.0)]
        frontier = [0]
        backbone = [0]  # the draft's greedy chain: always expanded, always kept (greedy mode)
        rows = {0: root_row}
        states = {0: root_state}
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
            logits, level_states = d.tree_level(ids, pos, mask, [states[nodes[i].parent] for i in frontier], seq)
            rows = {ni: logits[r] for r, ni in enumerate(frontier)}
            states = {ni: level_states[r] for r, ni in enumerate(frontier)}
        eng.rollback(base, seq)  # tree nodes never enter the draft's committed cache
        if params.greedy and nodes[backbone[-1]].children:  # the deepest level's top child
            backbone.append(max(nodes[backbone[-1]].children.values(), key=lambda i: nodes[i].score))
        return self._select(nodes, params, backbone)

    def _expand(self, nodes: list[TreeNode], ni: int, row: np.ndarray, params: SamplingParams,
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
                nodes.append(TreeNode(tok, ni, node.depth + 1, node.score + float(row[tok]) - log_z))
                node.children[tok] = len(nodes) - 1
                created.append(len(nodes) - 1)
            return created
        q = probabilities(row[None, :], params)[0]
        node.q = q
        for _ in range(w):
            tok = sample(q, rng)
            node.draws.append(tok)
            if tok not in node.children:
                nodes.append(TreeNode(tok, ni, node.depth + 1, node.score + float(np.log(q[tok]))))
                node.children[tok] = len(nodes) - 1
                created.append(len(nodes) - 1)
        return created

    def _select(self, nodes: list[TreeNode], params: SamplingParams, backbone: list[int]) -> list[TreeNode]:
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
            out.append(TreeNode(n.token, new_index.get(n.parent, -1), n.depth, n.score,
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
            self._report(t0, first, long_catch_up)
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
        self._report(t0, first, long_catch_up)
        return ids, top, qs, draws

    def _report(self, t0: float, first: float, long_catch_up: bool) -> None:
        spent = time.perf_counter() - t0
        self.report = DraftReport(spent, first / spent if spent > 0 else None, long_catch_up)

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


def tree_visibility(tree: list[TreeNode]) -> np.ndarray:
    n = len(tree)
    vis = np.zeros((n, n), dtype=bool)
    for i, node in enumerate(tree):
        vis[i, i] = True
        if node.parent >= 0:
            vis[i] |= vis[node.parent]
    return vis
