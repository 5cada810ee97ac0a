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
from typing import Iterator

import numpy as np

from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.core.masks import causal_mask, tree_mask
from specdec_rt.runtime.core.rows import LoopConfig, Row, draft_room
from specdec_rt.runtime.core.sampling import probabilities, sample
from specdec_rt.runtime.core.stats import GenerationStats
from specdec_rt.runtime.drafters.base import ModelDrafter
from specdec_rt.runtime.drafters.eagle import EagleDrafter
from specdec_rt.runtime.drafters.tree import TemplateDrafter, TreeDrafter, TreeNode, tree_visibility
from specdec_rt.runtime.engines.ort import OrtEngine
from specdec_rt.runtime.loop.policy_store import PolicyStore
from specdec_rt.runtime.loop.requests import SpeculationConfig
from specdec_rt.runtime.loop.speculative import keep_path, run_batch, start_row
from specdec_rt.runtime.policies.tree_shapes import FixedTemplate, Template, TreeShape

# the shapes live in policies/tree_shapes, the drafters in drafters/tree; their names stay importable from here
__all__ = ["FixedTemplate", "Template", "TemplateDrafter", "TreeDrafter", "TreeNode", "TreeShape", "TreeStep",
           "batch_tree_step", "run_tree", "tree_generation", "tree_visibility"]


def _accept_greedy(tree: list[TreeNode], argmax: np.ndarray) -> tuple[list[int], int]:
    path, u = [0], 0
    while True:
        a = int(argmax[u])
        child = tree[u].children.get(a)
        if child is None:
            return path, a
        path.append(child)
        u = child


def _accept_sampled(tree: list[TreeNode], p_rows: np.ndarray, rng: np.random.Generator) -> tuple[list[int], int]:
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


def tree_generation(target: OrtEngine, drafter, prompt: list[int], cfg: LoopConfig, rng: np.random.Generator,
                    stats: GenerationStats, config: SpeculationConfig, policies: PolicyStore,
                    exact_trees: bool) -> Iterator[list[int]]:
    """A ``speculation="tree"`` generation as ``config`` asks: a fixed template, the shape
    policy ("auto" without a shape), or a dynamic tree of ``num_draft_tokens`` nodes."""
    check_tree_setting(drafter, exact_trees)
    shape = config.tree_shape
    if isinstance(shape, Template):
        if not isinstance(drafter, ModelDrafter):
            raise GenerationInputError("a fixed tree Template is drafted by the draft model (drafter='model'); "
                                       "drafter='eagle' grows dynamic trees: give a TreeShape or a node budget")
        return run_tree(target, drafter, prompt, cfg, rng, stats, policy=FixedTemplate(shape))
    if config.auto and shape is None and isinstance(drafter, ModelDrafter):
        # the shape policy: budget, depth and width per step from the cost model and the running
        # acceptance estimates (a chain where branches do not pay)
        return run_tree(target, drafter, prompt, cfg, rng, stats, policy=policies.tree())
    budget = 15 if config.auto else max(1, int(config.num_draft_tokens))
    return run_tree(target, drafter, prompt, cfg, rng, stats, shape or TreeShape.for_budget(budget))


def batch_tree_step(target: OrtEngine, drafter, config: SpeculationConfig, exact_trees: bool) -> TreeStep:
    """The tree step of a batch session (``generate_batch(..., speculation="tree")``): the same
    checks as one sequence's trees; a fixed :class:`TreeShape` (``tree_shape``, else one of
    ``num_draft_tokens`` nodes, 15 under "auto": the shape policy chooses per sequence, so batched
    trees take a fixed shape)."""
    check_tree_setting(drafter, exact_trees)
    shape = config.tree_shape
    if isinstance(shape, Template):
        raise GenerationInputError("batched trees take a TreeShape or a node budget, not a fixed Template")
    budget = 15 if config.auto else max(1, int(config.num_draft_tokens))
    return TreeStep(target, drafter, shape or TreeShape.for_budget(budget))


def check_tree_setting(drafter, exact_trees: bool) -> None:
    """Trees need the draft model or an EAGLE-3 head, and a target whose tree verification is exact."""
    if not isinstance(drafter, (ModelDrafter, EagleDrafter)):
        raise GenerationInputError("speculation='tree' needs drafter='model' or 'eagle'")
    if not exact_trees:
        raise GenerationInputError(
            "this bundle's target sums attention in float32 (exported with --portable, "
            "--target-attention native or fused, or by an older specdec-rt), so tree verification would not be "
            "token-identical to target-only decoding; use speculation='chain' or re-export with "
            "--target-attention fp64")


def run_tree(target: OrtEngine, drafter: ModelDrafter, prompt: list[int], cfg: LoopConfig,
             rng: np.random.Generator, stats: GenerationStats,
             shape: TreeShape | None = None, policy=None) -> Iterator[list[int]]:
    """Like :func:`run_chain`, verifying a token tree per target call: a fixed-budget
    :class:`TreeShape` (the batch loop with :class:`TreeStep`, one row), or with ``policy``
    (:class:`~specdec_rt.runtime.policies.tree.TreePolicy`) the template it chooses per step."""
    row = Row(prompt, cfg, rng, stats)
    if policy is None:
        for _, new in run_batch(target, drafter, [row], 1, stepper=TreeStep(target, drafter, shape or TreeShape())):
            if row.error is not None:
                raise row.error
            yield new
        return
    row.seq = 0
    yield start_row(target, drafter, row)
    yield from _run_templates(target, drafter, row, policy)


class TreeStep:
    """One tree step of every row of a batch (:class:`~specdec_rt.runtime.loop.speculative.BatchLoop`'s
    ``stepper``): each row's tree drafted on its own draft sequence (:class:`TreeDrafter`), all
    trees verified in one target call (each row its own tree mask at its own length), each
    accepted (greedy: the target's argmax walk; sampled: recursive rejection sampling) and
    committed by :func:`~specdec_rt.runtime.loop.speculative.keep_path`, as chains are."""

    def __init__(self, target: OrtEngine, drafter: ModelDrafter, shape: TreeShape) -> None:
        self.target, self.drafter = target, drafter
        self.tree_drafter = TreeDrafter(drafter, shape)

    def __call__(self, rows: list[Row]) -> list[list[int]]:
        target = self.target
        out: list[list[int]] = [[] for _ in rows]
        live, trees, ids, positions, masks = [], [], [], [], []
        for i, row in enumerate(rows):
            p0 = target.lengths[row.seq]
            if p0 + 1 >= target.max_len:
                row.finished = "context"
                continue
            t0 = time.perf_counter()
            tree = self.tree_drafter.build(row.tokens, row.cfg.params, row.rng, row.seq)
            row.stats.time_draft += time.perf_counter() - t0
            room = draft_room(target, row.seq) + 1  # nodes with the root
            if len(tree) > room:  # near the context end: keep what fits (BFS order keeps parents)
                tree = tree[:room]
                for node in tree:
                    node.children = {t: c for t, c in node.children.items() if c < room}
            depth = np.asarray([n.depth for n in tree], dtype=np.int64)
            live.append(i)
            trees.append(tree)
            ids.append(np.asarray([n.token for n in tree], dtype=np.int64))
            positions.append(p0 + depth)
            masks.append(tree_mask(p0, np.zeros((len(tree), 0), dtype=bool), p0 + depth,
                                   target.info.sliding_window, new_block=tree_visibility(tree)))
        if not live:
            return out
        t0 = time.perf_counter()
        logits = target.forward_rows([rows[i].seq for i in live], ids, positions, masks)
        for i, tree, x, row_ids, pos in zip(live, trees, logits, ids, positions):
            row = rows[i]
            params = row.cfg.params
            if params.greedy:
                path, nxt = _accept_greedy(tree, np.argmax(x, axis=-1))
            else:
                path, nxt = _accept_sampled(tree, probabilities(x, params), row.rng)
            row.stats.time_verify += time.perf_counter() - t0
            out[i] = keep_path(target, self.drafter, row, row_ids, path, nxt, len(tree) - 1,
                               depth=int(pos.max() - pos[0]))
        return out


def _run_templates(target: OrtEngine, drafter: ModelDrafter, row: Row, policy) -> Iterator[list[int]]:
    """The tree loop with a shape policy: per step the policy's template, drafted level by level,
    verified in one call (a chain template as a plain causal chain), the accepted path's K/V
    compacted (nothing to move when the path is the template's first nodes)."""
    cfg, rng, stats, tokens = row.cfg, row.rng, row.stats, row.tokens
    params = cfg.params
    greedy = params.greedy
    window = target.info.sliding_window
    dr = TemplateDrafter(drafter)
    d_eng = drafter.engine
    while not row.finished:
        p0 = target.lengths[row.seq]
        if p0 + 1 >= target.max_len:
            return
        # nodes incl. the root: the target's and the draft's room, and no more than the budget
        limit = max(1, min(draft_room(target, row.seq) + 1, d_eng.max_len - len(tokens) + 1,
                           cfg.max_new_tokens - row.generated))
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
        logits = target.forward_rows([row.seq], [ids], [pos], [mask])[0]
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
                nodes.append(TreeNode(int(ids[i]), tpl.parents[i], int(tpl.depths[i]), 0.0, kids,
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
        stats.time_verify += time.perf_counter() - t1
        new = keep_path(target, drafter, row, ids, path, int(nxt_tok), n - 1, depth=tpl.max_depth)
        # calibrates the shape model to this machine (not from a step that caught up a prompt)
        # (a root-only step drafts nothing, and observe_step learns nothing from it)
        if not dr.report.long_catch_up:
            policy.observe_step(tpl, policy.clock() - step_t0, draft_seconds, verify_seconds,
                                dr.report.first_call_share)
        yield new
