"""The tree shape per step for ``speculation="tree"`` with ``num_draft_tokens="auto"``.

Its own module because it answers a different question than the chain policy (which nodes to
draft, not how many): it shares only the cost model and the in-loop calibration
(:mod:`specdec_rt.runtime.policies.cost_model`), and prices chains with the same formula so that where
side branches cannot pay it runs the best chain.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specdec_rt.runtime.policies.cost_model import (CostModel, chain_drafting, expected_chain_tokens, first_call_scale,
                                                    learn_drafting, learn_scale)
from specdec_rt.runtime.policies.tree_shapes import Template



@dataclass
class TreePolicy:
    """The tree shape for each step of ``speculation="tree"`` with ``num_draft_tokens="auto"``.

    Model: a node reached by the walk is accepted with a probability that depends on its depth
    d and on which of the draft's choices it is: ``a_d`` for the draft's top token (sampling:
    the first i.i.d. draw), ``(1 - a_d) b_d`` for its second (b_d: how often the second choice is
    the target's token when the first is not; sampling: the second draw's acceptance under the
    residual). A node's value is the product along its path (the probability that the walk
    accepts it) and ``E[tokens] = 1 + sum of the values``. A step costs one draft call per level
    (``c(F)`` for a level of F rows, measured) plus ``T(N + 1)`` for verifying N nodes. For every
    depth limit D the best tree of n nodes is the n most valuable nodes (values fall along every
    path, so they form a tree); the plan is the (D, n) with the most expected tokens per second,
    chains (width 1, K = 0..max_depth) included, a tree chosen only when it beats the best chain by
    ``branch_margin``, so where side branches
    cannot pay the tree mode runs the best chain.

    Estimates are EMAs per depth (like :class:`AdaptivePolicy`); depths never tested inherit
    the deepest tested estimate and every ``probe_every``-th step deepens the plan by two. The
    best chain is recomputed every step (vectorised, as :class:`AdaptivePolicy` does); the tree
    search (~0.2 ms of Python) runs every ``replan_every`` steps (backing off to every
    ``max_search_gap`` while it finds no tree), and its tree is used while it still beats the
    current best chain by ``branch_margin``.
    """

    cost: CostModel
    draft_rows: list[float] = field(default_factory=list)  # c(F) for F = 1.. draft rows per level call
    max_nodes: int = 15
    max_depth: int = 12
    max_rank: int = 2  # children per node: 1 = chains only
    prior: float = 0.6
    prior_second: float = 0.3
    decay: float = 0.9
    probe_every: int = 8
    replan_every: int = 4  # steps between tree searches (the best chain is recomputed every step)
    max_search_gap: int = 64  # ... backing off up to this while the searches find no tree
    # a tree must beat the best chain by this much: branching steps cost Python the model does
    # not count (tree masks, the draft's masked level calls, compaction of the accepted path)
    branch_margin: float = 0.03
    accept: list[float] = field(default_factory=list)  # a_d, d = 1..
    second: list[float] = field(default_factory=list)  # b_d, d = 1..
    last: object = None  # the template of the last step
    # per-step costs of drafting steps that the micro-benchmarks miss (as AdaptivePolicy's
    # step_overhead: model switches, bookkeeping), learned separately for chain steps and for
    # branching steps (tree masks, level calls, compaction: more Python); None until a
    # branching step was seen, then the chain figure stands in
    step_overhead: float = 0.0
    tree_overhead: float | None = None
    # in-loop cost of draft and verify calls over their micro-benchmarked cost, learned as
    # AdaptivePolicy learns them (learn_scale): without them the constant overheads above absorbed
    # a cost that grows with the template, and the policy drafted longer than chain "auto"
    # (measured on the reference pair: 5.9 vs 5.4 tokens per call, 0.96x its speed)
    draft_scale: float = 1.0
    first_draft_scale: float | None = None  # a step's first draft call, as in AdaptivePolicy
    target_scale: float = 1.0
    clock: object = time.perf_counter
    _tested: int = 0
    _tested2: int = 0
    _steps: int = 0
    _idle: int = 0  # steps since the last probe
    _backoff: int = 1  # probe interval multiplier while the plan drafts nothing
    _paying: int = 0  # consecutive steps whose plan drafted
    _plan: object = None
    _next_search: int = 1
    _search_gap: int = 0
    _templates: dict = field(default_factory=dict)
    _draft_delta: list = field(default_factory=list)
    _target_key: tuple = ()
    _target_arr: object = None

    def __post_init__(self) -> None:
        n = max(self.max_depth, self.max_nodes) + 3
        if not self.accept:
            self.accept = [self.prior] * n
        if not self.second:
            self.second = [self.prior_second] * n
        self._search_gap = self.replan_every

    # -- costs ---------------------------------------------------------------------------
    def draft_call(self, rows: int) -> float:
        """One draft call over ``rows`` tree rows."""
        if rows <= 0:
            return 0.0
        c = self.draft_rows or [self.cost.draft_step]
        if rows <= len(c):
            return c[rows - 1]
        slope = (c[-1] - c[0]) / max(1, len(c) - 1)
        return c[-1] + slope * (rows - len(c))

    def expected(self, tpl) -> tuple[float, float]:
        """(expected tokens, expected seconds) of one step with template ``tpl`` under the model."""
        a, b = self.accept, self.second
        value = [1.0] * tpl.size
        for i in range(1, tpl.size):
            d, rank = int(tpl.depths[i]) - 1, tpl.ranks[i]
            p = a[d] if rank == 0 else (1 - a[d]) * b[d] * (1 - b[d]) ** (rank - 1)
            value[i] = value[tpl.parents[i]] * p
        seconds = self.model_seconds(tpl) + (self._branch_overhead() if not tpl.is_chain
                                             else self.step_overhead if tpl.size > 1 else 0.0)
        return float(sum(value)), seconds

    def model_seconds(self, tpl) -> float:
        """A step of template ``tpl`` from the model's calls alone (micro-benchmarked costs times
        their learned in-loop scales): one draft call per expanded level
        (``Template.draft_widths``), one verify call of all its nodes."""
        if tpl.size <= 1:
            return self.cost.target(1) * self.target_scale
        return (self.draft_call(1) * first_call_scale(self) + self._later_calls(tpl) * self.draft_scale
                + self.cost.target(tpl.size) * self.target_scale)

    def _later_calls(self, tpl) -> float:
        """The micro-benchmarked cost of a template's draft calls after the first (the root's)."""
        return sum(self.draft_call(w) for w in tpl.draft_widths[1:])

    def _branch_overhead(self) -> float:
        return self.step_overhead if self.tree_overhead is None else self.tree_overhead

    def observe_step(self, tpl, seconds: float, draft_seconds: float | None = None,
                     verify_seconds: float | None = None, first_draft_share: float | None = None) -> None:
        """One whole step with template ``tpl`` took ``seconds`` (policy clock), ``draft_seconds``
        of it drafting and ``verify_seconds`` in the verify call: fold those into the in-loop
        scales and what the model still misses into the chain or the branching overhead (EMA,
        clipped to [0, 2 T(1)] as in :meth:`AdaptivePolicy.observe_step`). Steps that draft
        nothing teach nothing."""
        if tpl.size <= 1:
            return
        learn_drafting(self, draft_seconds, first_draft_share, self.draft_call(1), self._later_calls(tpl))
        self.target_scale = learn_scale(self.target_scale, verify_seconds, self.cost.target(tpl.size))
        residual = min(max(seconds - self.model_seconds(tpl), 0.0), 2.0 * self.cost.target(1))
        if tpl.is_chain:
            self.step_overhead = 0.95 * self.step_overhead + 0.05 * residual
        elif self.tree_overhead is None:
            self.tree_overhead = max(self.step_overhead, residual)
        else:
            self.tree_overhead = 0.95 * self.tree_overhead + 0.05 * residual

    def template(self, parents: tuple, ranks: tuple) -> Template:
        key = (tuple(parents), tuple(ranks))
        tpl = self._templates.get(key)
        if tpl is None:
            tpl = self._templates[key] = Template(*key)
        return tpl

    def chain(self, k: int):
        return self.template(tuple(range(-1, k)), (0,) * (k + 1))

    # -- the plan ------------------------------------------------------------------------
    def _grow(self, depth_limit: int, n_max: int, targets: list[float], best_rate: float):
        """Best-first growth of the tree under ``depth_limit``; returns (rate, n) of the best
        prefix better than ``best_rate`` (or None) and the nodes grown [(parent, rank, depth)]."""
        import heapq

        a, b = self.accept, self.second
        dc = self._draft_delta
        reached = 0
        nodes = [(-1, 0, 0)]
        value = [1.0]
        has_kids = [False]
        width = [0] * (depth_limit + 1)  # expanded nodes per level (draft call widths)
        heap = [(-a[0], 0, 0, 0, 1)]  # (-value, tie, parent, rank, depth)
        tie = 1
        e, draft, best = 1.0, 0.0, None
        # a chain prefix of the growth is priced as a tree: best_chain already covers chains, this
        # search only has to find branching trees; every tree pays the first draft call's extra
        overhead = self._branch_overhead() + self.draft_call(1) * (first_call_scale(self) - self.draft_scale)
        for n in range(1, n_max + 1):
            if not heap:
                break
            v, _, par, rank, dep = heapq.heappop(heap)
            v = -v
            idx = len(nodes)
            nodes.append((par, rank, dep))
            value.append(v)
            has_kids.append(False)
            e += v
            if not has_kids[par]:
                has_kids[par] = True
                lvl = dep - 1
                width[lvl] += 1
                draft += dc[width[lvl]]
            if dep > reached:
                reached = dep
            if dep < depth_limit:  # its top child
                heapq.heappush(heap, (-v * a[dep], tie, idx, 0, dep + 1))
                tie += 1
            if rank + 1 < self.max_rank:  # its next sibling: the draft's next choice at the parent
                # rank 0: a; rank 1: (1 - a) b; rank r > 1: (1 - a)(1 - b)^(r-1) b
                sib = value[par] * (1 - a[dep - 1]) * b[dep - 1] if rank == 0 else v * (1 - b[dep - 1])
                heapq.heappush(heap, (-sib, tie, par, rank + 1, dep))
                tie += 1
            rate = e / (draft + targets[n] + overhead)
            if rate > best_rate * (1 + 1e-9):
                best_rate, best = rate, n
        return best_rate, best, nodes, reached

    def _targets(self, n_max: int) -> np.ndarray:
        """T(n + 1) for n = 0..n_max (cached per cost model)."""
        key = (id(self.cost), n_max)
        if self._target_key != key:
            self._target_key = key
            self._target_arr = np.array([self.cost.target(s) for s in range(1, n_max + 2)])
        return self._target_arr

    def best_chain(self, n_max: int):
        """(rate, template) of the best chain of at most ``n_max`` tokens (vectorised: every step)."""
        k_max = min(self.max_depth, n_max)
        targets = self._targets(self.max_nodes)
        ks = np.arange(k_max + 1)
        tokens = expected_chain_tokens(self.accept, k_max)
        seconds = (chain_drafting(self, ks, self.draft_call(1)) + targets[ks] * self.target_scale
                   + self.step_overhead * (ks > 0))
        rates = tokens / seconds
        k = int(np.argmax(rates))  # the first maximum: the shortest of equals
        return float(rates[k]), self.chain(k)

    def best_tree(self, n_max: int, floor: float):
        """The best branching template of at most ``n_max`` nodes whose expected rate exceeds
        ``floor`` (tokens per second), or None."""
        targets = list(self._targets(self.max_nodes)[: n_max + 1] * self.target_scale)
        ds = self.draft_scale
        self._draft_delta = [0.0] + [(self.draft_call(w) - self.draft_call(w - 1)) * ds for w in range(1, n_max + 2)]
        best_rate, choice = floor, None
        for depth_limit in range(1, min(self.max_depth, n_max) + 1):
            best_rate, n, nodes, reached = self._grow(depth_limit, n_max, targets, best_rate)
            if n is not None:
                choice = nodes[: n + 1]
            if reached < depth_limit:  # the limit no longer binds: deeper limits grow the same
                break
        if choice is None:
            return None
        tpl = self._to_template(choice)
        return None if tpl.is_chain else tpl

    def plan(self, limit: int | None = None):
        """The template with the most expected tokens per second (``limit``: at most this many
        nodes including the root): the best chain unless a branching tree beats it by
        ``branch_margin``."""
        n_max = self.max_nodes if limit is None else max(0, min(self.max_nodes, limit - 1))
        rate, best = self.best_chain(n_max)
        if self.max_rank > 1 and n_max > 1:
            tree = self.best_tree(n_max, rate * (1 + self.branch_margin))
            if tree is not None:
                best = tree
        return best

    def _to_template(self, nodes: list[tuple[int, int, int]]):
        """Grown nodes [(parent, rank, depth)] in growth order -> a breadth-first template."""
        order = sorted(range(len(nodes)), key=lambda i: nodes[i][2])
        new = {}
        # within a level: by the parent's new index, then rank (the backbone first)
        out = []
        for d in range(max(n[2] for n in nodes) + 1):
            level = [i for i in order if nodes[i][2] == d]
            level.sort(key=lambda i: (new.get(nodes[i][0], -1), nodes[i][1]))
            for i in level:
                new[i] = len(out)
                out.append(i)
        parents = tuple(-1 if nodes[i][0] < 0 else new[nodes[i][0]] for i in out)
        ranks = tuple(nodes[i][1] for i in out)
        return self.template(parents, ranks)

    def _deepen(self, tpl, extra: int, limit: int | None):
        """``tpl`` with ``extra`` more top-choice nodes under its first deepest node (for a chain,
        or the backbone of a tree, its tip), so deeper depths keep being tested."""
        tip = int(np.argmax(tpl.depths))  # the first node of the deepest level
        parents, ranks = list(tpl.parents), list(tpl.ranks)
        room = (limit if limit is not None else 10 ** 9) - len(parents)
        extra = min(extra, room, self.max_depth - int(tpl.depths[tip]))
        if extra <= 0:
            return tpl
        if tpl.is_chain:
            return self.chain(len(parents) - 1 + extra)
        # appended nodes are deeper than every node on their path; keep breadth-first order by
        # rebuilding through the grower's representation
        nodes = [(parents[i], ranks[i], int(tpl.depths[i])) for i in range(len(parents))]
        for _ in range(extra):
            nodes.append((tip, 0, nodes[tip][2] + 1))
            tip = len(nodes) - 1
        return self._to_template(nodes)

    def choose(self, limit: int | None = None):
        """The template for the next step (``limit``: at most this many nodes incl. the root)."""
        self._steps += 1
        n_max = self.max_nodes if limit is None else max(0, min(self.max_nodes, limit - 1))
        rate, tpl = self.best_chain(n_max)  # every step, as the chain policy does
        if self.max_rank > 1 and self._steps >= self._next_search:
            self._plan = self.best_tree(self.max_nodes, rate * (1 + self.branch_margin))
            # while no tree beats the chains, search half as often each time (up to every
            # max_search_gap steps): the search is most of the Python of a step that runs a chain
            self._search_gap = (self.replan_every if self._plan is not None
                                else min(self.max_search_gap, 2 * self._search_gap))
            self._next_search = self._steps + self._search_gap
        if self._plan is not None:  # the last tree search's tree, if it still beats today's chain
            e, t = self.expected(self._plan)
            if e / t > rate * (1 + self.branch_margin):
                tpl = self._plan
        # explore as AdaptivePolicy does: every probe_every-th step two levels deeper; while the
        # plan drafts nothing (K = 0) the interval doubles after each probe, up to 32x (measured
        # on the layer-skip pair of scripts/policy_pairs.py: probing every 8th step cost tree
        # "auto" ~8% against target-only decoding, where chain "auto" backed off); as there, the
        # back-off resets only after probe_every drafting steps in a row
        self._idle += 1
        self._paying = self._paying + 1 if tpl.size > 1 else 0
        if self._paying >= self.probe_every:
            self._backoff = 1
        if self._idle >= self.probe_every * self._backoff:
            self._idle = 0
            if tpl.size == 1:
                self._backoff = min(32, self._backoff * 2)
            tpl = self._deepen(tpl, 2, limit)
        if limit is not None and tpl.size > limit:
            tpl = self.plan(limit)
        self.last = tpl
        return tpl

    # -- learning ------------------------------------------------------------------------
    def observe(self, depth: int, first: float, second: float | None = None) -> None:
        """At a node the walk reached whose children the draft computed: ``first`` = the
        target's token was the draft's top choice (1/0; sampling: the first draw's acceptance
        probability), ``second`` = it was the second choice given not the first (sampling: the
        second draw's acceptance probability under the residual); None: not observed."""
        j = depth - 1
        if not 0 <= j < len(self.accept):
            return
        w = 1 - self.decay
        self.accept[j] += w * (first - self.accept[j])
        self._tested = max(self._tested, j + 1)
        if second is not None:
            self.second[j] += w * (second - self.second[j])
            self._tested2 = max(self._tested2, j + 1)

    def end_step(self) -> None:
        """Untested depths inherit the deepest tested estimate."""
        for est, tested in ((self.accept, self._tested), (self.second, self._tested2)):
            if tested:
                for j in range(tested, len(est)):
                    est[j] = est[tested - 1]
