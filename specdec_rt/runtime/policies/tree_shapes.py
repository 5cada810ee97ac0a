"""Tree shapes: a node budget for the dynamic tree (:class:`TreeShape`) and static templates
(:class:`Template`) that the shape policy picks per step, with everything that depends only on
the shape precomputed once (masks, draft levels)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specdec_rt.runtime.core.masks import NEG_INF


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
    """A static tree shape chosen by :class:`~specdec_rt.runtime.policies.tree.TreePolicy`: node 0 is
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
