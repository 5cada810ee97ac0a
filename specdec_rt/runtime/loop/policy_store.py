"""The "auto" policies a generator keeps across generations, and the cost model they share.

"auto" learns per generator: acceptance estimates carry over from one generation to the next,
and the cost model is measured once (or read back from disk, :mod:`specdec_rt.runtime.engines.cost_cache`)
and extended per batch width the first time a batch asks. One object owns all of that, so the
generator holds no policy state of its own and nothing writes into it from outside: the store is
handed the engines it measures and the manifest it keys the disk cache by, and its ``clock`` is an
explicit setting (benchmarks that time runs in CPU time measure the cost model on that clock too).
"""
from __future__ import annotations

import time

import numpy as np

from specdec_rt.runtime.drafters.eagle import EagleHead
from specdec_rt.runtime.engines import cost_cache
from specdec_rt.runtime.engines.ort import OrtEngine
from specdec_rt.runtime.policies.adaptive import AdaptivePolicy
from specdec_rt.runtime.policies.cost_model import CostModel, batch_widths, measure_cost_model, measure_engine, measure_width
from specdec_rt.runtime.policies.tree import TreePolicy


# a draft step dearer than this share of a one-token target step: "auto" drafts with the suffix
# hybrid (PolicyStore.auto_drafter), between the two pairs measured (0.07 and 0.28)
SUFFIX_HYBRID_ABOVE = 0.15
# ... and dearer than this share: with suffix matching alone, the draft model's steps between
# matches do not pay for themselves (measured on the real pair's grounded suite, int4 on an AMX
# Xeon, c = 0.43: suffix 1.55x vs suffix_hybrid 1.42x end to end, 1.62x vs 1.11x on documents;
# on Spec-Bench chat at c = 0.28 the hybrid led by 3%: 1.20x vs 1.17x)
SUFFIX_ALONE_ABOVE = 0.35
# Suffix drafts may be this long: each proposal is cut where its own expected goodput peaks
# (drafters.suffix.SuffixGoodput), so a long block is drafted only where the match is long and
# sure and the measured T(K + 1) makes it pay (a copied stretch of a prompt, on a flat verify)
SUFFIX_K_MAX = 32


class PolicyStore:
    """A generator's policies for ``num_draft_tokens="auto"`` and their cost model.

    ``cost_model``: the measured figures, None until the first "auto" generation measures them
    (or finds them on disk); set it beforehand to inject one (e.g. modelled costs in tests), and
    it is used instead of measuring. ``clock``: what the cost model is measured with and what the
    policies made afterwards time their steps with (``time.perf_counter``; ``time.process_time``
    for CPU time in single-threaded benchmarks). ``chains``: the chain policies made so far, by
    (scope + drafter, overlap); ``tree_policy``: the tree policy once made.
    """

    def __init__(self, target: OrtEngine, draft: OrtEngine | None = None, manifest: dict | None = None,
                 clock=time.perf_counter, head: EagleHead | None = None) -> None:
        self.target = target
        self.draft = draft
        self.head = head  # the bundle's EAGLE-3 head: its step is drafter="eagle"'s cost
        self.head_step: float | None = None  # measured at the first "auto" eagle generation
        self.head_widths: dict[int, float] = {}  # a batched head step per batch width, measured as needed
        self.manifest = manifest  # the bundle's: keys the on-disk cost model (None: no disk cache)
        self.clock = clock
        self.cost_model: CostModel | None = None
        self.chains: dict[tuple[str, bool], AdaptivePolicy] = {}
        self.tree_policy: TreePolicy | None = None

    def chain(self, drafter: str | None, max_width: int = 1, overlap: bool = False,
              scope: str = "") -> AdaptivePolicy:
        """The chain policy for this drafter, made once and kept across generations (``scope``:
        a separate set, e.g. the hybrid drafter's own pair), deciding from a cost model that
        covers batches of up to ``max_width`` sequences."""
        key = (scope + (drafter or "none"), bool(overlap))
        cost = self.measured(self.draft if drafter == "model" else None, max_width)
        if drafter == "eagle" and self.head is not None:  # a head call per drafted token, the rows batched
            if self.head_step is None:
                self.head_step = self.head.measure_step(clock=self.clock)
            for b in cost.widths:
                if b not in self.head_widths:
                    self.head_widths[b] = self.head.measure_step(clock=self.clock, width=b)
            cost = CostModel(cost.target_times, self.head_step,
                             {b: (t, self.head_widths[b]) for b, (t, _) in cost.widths.items()})
        elif drafter != "model":  # prompt lookup: drafting costs (next to) nothing
            cost = CostModel(cost.target_times, 0.0, {b: (t, 0.0) for b, (t, _) in cost.widths.items()})
        policy = self.chains.get(key)
        if policy is None:
            k_max = SUFFIX_K_MAX if drafter == "suffix" else AdaptivePolicy.k_max
            policy = self.chains[key] = AdaptivePolicy(cost, k_max=k_max, overlap=bool(overlap), clock=self.clock)
        policy.set_cost(cost)  # possibly with more widths than when the policy was made
        return policy

    def cheaper_drafter(self) -> str | None:
        """Of the bundle's draft model and EAGLE-3 head, the one whose drafted token costs less
        (measured on this machine; None when it has neither): the server's ``--drafter auto``.
        Acceptance is unknown before requests arrive and a head trained for its target usually
        agrees with it at least as well as a separate draft, so the step decides: measured, the
        reference pair's 2-layer draft (0.10 ms) beats its head (0.13 ms; 1.99x vs 1.81x end to
        end), while beside Qwen2.5-Coder-1.5B a head step is 3.2 ms against the 0.5B draft's 20.5."""
        if self.head is None:
            return "model" if self.draft is not None else None
        if self.draft is None:
            return "eagle"
        if self.head_step is None:
            self.head_step = self.head.measure_step(clock=self.clock)
        return "eagle" if self.head_step <= self.measured(self.draft).draft_step else "model"

    def auto_drafter(self, speculation: str = "chain", overlap: bool = False) -> str | None:
        """What ``drafter="auto"`` (the default everywhere) runs on this bundle and machine.

        Trees: :meth:`cheaper_drafter` (they need a model or a head; None when the bundle has
        neither). Chains: the same, except that a draft model dearer than ``SUFFIX_HYBRID_ABOVE``
        of a target step drafts only where suffix matching (free: the prompt, the output and the
        suffix pool) has nothing sure to propose ("suffix_hybrid"), one dearer than
        ``SUFFIX_ALONE_ABOVE`` not at all ("suffix"), and a bundle with neither a draft model nor
        a head drafts by suffix matching alone ("suffix"). Every choice keeps its
        K policy, which drafts nothing (plain decoding) where drafting does not pay. Measured: the
        reference pair's draft (c = 0.07) is best alone (2.11x vs the suffix hybrid's 1.96x), the
        0.5B draft beside Qwen2.5-Coder-1.5B (c = 0.28-0.46) is not (Spec-Bench 1.20x vs ~1.0x,
        code edits 2.05x vs 1.33x). ``overlap``: only the draft model drafts ahead ("model")."""
        base = self.cheaper_drafter()
        if speculation == "tree":
            return base
        if overlap:
            return "model" if self.draft is not None else base
        if base is None:
            return "suffix"
        if base != "model":
            return base
        cost = self.measured(self.draft)
        share = cost.draft_step / cost.target(1)
        return "suffix" if share > SUFFIX_ALONE_ABOVE else "suffix_hybrid" if share > SUFFIX_HYBRID_ABOVE else "model"

    def tree(self) -> TreePolicy:
        """The tree policy: the cost model (as for "auto" chains) plus the draft's cost for calls
        of 1..8 rows, measured once; estimates kept across generations."""
        if self.tree_policy is None:
            cost = self.chain("model").cost
            sizes = [1, 2, 3, 4, 6, 8]
            rows = measure_engine(self.draft, sizes, past=128, reps=11, clock=self.clock)
            c = [float(x) for x in np.interp(np.arange(1, 9), sizes, rows)]
            self.tree_policy = TreePolicy(cost, draft_rows=c, clock=self.clock)
        return self.tree_policy

    def measured(self, draft: OrtEngine | None, max_width: int = 1) -> CostModel:
        """:attr:`cost_model`, read from disk or measured where missing: the target's T(S), the
        step of ``draft`` (when given), and every batch width up to ``max_width`` (measured before
        the batch starts: measuring uses the engines' caches). New figures are saved to disk."""
        cost = self.cost_model
        key = self.cache_key() if cost is None else None
        if key is not None:  # measured before on this machine (cost_cache)
            cached = cost_cache.load_cost(key)
            if cached is not None:
                cost = self.cost_model = CostModel(**cached)
        changed = False
        if cost is None or (draft is not None and cost.draft_step == 0.0):
            cost = self.cost_model = measure_cost_model(self.target, draft, clock=self.clock)
            changed = True
        for width in batch_widths(max_width):
            if width not in cost.widths or (draft is not None and cost.widths[width][1] == 0.0):
                measure_width(cost, self.target, draft, width, clock=self.clock)
                changed = True
        key = (key or self.cache_key()) if changed else None
        if key is not None:
            cost_cache.save_cost(key, cost.target_times, cost.draft_step, cost.widths)
        return cost

    def cache_key(self) -> str | None:
        """The on-disk cost model's key for this bundle, these engines and this clock (None: no
        manifest, e.g. engines built by hand in tests)."""
        if not self.manifest:
            return None
        models = self.manifest.get("models", {}).values()
        graphs = [m["graph"] for m in models if isinstance(m, dict) and "graph" in m]
        machine = {"target": cost_cache.engine_settings(self.target), "draft": cost_cache.engine_settings(self.draft),
                   "clock": getattr(self.clock, "__name__", str(self.clock)),
                   "max_len": getattr(self.target, "max_len", None)}
        return cost_cache.cost_key(self.manifest, graphs, machine)
