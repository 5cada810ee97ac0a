"""Cost-model-driven draft length (``num_draft_tokens="auto"``).

Per step of a batch of B sequences, choose K in [0, k_max] maximizing expected tokens per second:

    E[tokens | K] = 1 + sum_{i=1..K} prod_{j<=i} a_j            (a_j: P(accept j | accepted j-1))
    time(K)       = K * c_draft(B) + T(B, K + 1)                  (T(B, S): target time for B x S tokens)

This is Leviathan et al.'s speedup formula generalised to per-position acceptance and a measured
T(B, S) surface instead of a constant-cost assumption (the batch's rate is B E / time, so the
same argmax). The a_j are running estimates (exponential moving average over verify calls of
every sequence, persisted across generations). T(1, S) and c_draft(1) are measured once per
generator (a few target / draft calls), T(B, S) and c_draft(B) once per batch width B (powers
of two and the batch size, interpolated in between). Wide batches make verification costlier
per extra draft position (T(B, S) grows with B x S once the weights are no longer the bottleneck)
while the draft's cost per step hardly changes, which is how the policy learns shorter K for
wide batches. A second, cheaper rule works inside a step:
the drafter stops early when the draft's own confidence (the product of its top
probabilities) says the next token is not worth its cost.

Overlapped decoding (:mod:`specdec_rt.runtime.overlap`) hides a step's drafting behind the
previous verify call whenever the previous step's look-ahead survived, which happens with
probability h(K) = a_1 ... a_{K+1} (all K accepted and the guess at the bonus position too), so

    time(K) = (1 - h(K)) * K * c_draft(B) + T(B, K + 1)

(T measured on the overlapped generator's own target session). A shorter block survives more
often, so with a cheap draft the policy may pick a shorter K than without overlap, and with a
costly, well-agreeing draft a longer one (more drafting to hide).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specdec_rt.runtime import cost_cache
from specdec_rt.runtime.engine import OrtEngine, causal_mask
from specdec_rt.runtime.overlap import hit_probability


def expected_chain_tokens(accept, k_max: int) -> np.ndarray:
    """E[tokens | K] = 1 + sum_{i<=K} prod_{j<=i} a_j for K = 0..k_max (a chain's tokens per step
    under per-position acceptance ``accept``)."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(accept[:k_max]))])


@dataclass
class CostModel:
    """Measured target time T(B, S) (B sequences of S new tokens each per call) and draft step
    time c(B), for the batch widths measured so far.

    ``target_times`` / ``draft_step`` are the one-sequence figures (B = 1); ``widths`` maps a
    width B > 1 to its (T(B, S) for S = 1.., draft step) measurements. Widths between measured
    ones are interpolated linearly in B (per S), wider ones extrapolated from the widest two.
    """

    target_times: list[float]  # T(1, S), index S-1
    draft_step: float  # c(1)
    widths: dict[int, tuple[list[float], float]] = field(default_factory=dict)

    @staticmethod
    def _curve(t: list[float], s: int) -> float:
        if s <= len(t):
            return t[s - 1]
        slope = (t[-1] - t[0]) / max(1, len(t) - 1)
        return t[-1] + slope * (s - len(t))

    def _points(self) -> list[tuple[int, list[float], float]]:
        pts = [(1, self.target_times, self.draft_step)]
        pts += [(b, t, d) for b, (t, d) in sorted(self.widths.items()) if b > 1]
        return pts

    def _at_width(self, width: int, value) -> float:
        pts = self._points()
        if width <= 1 or len(pts) == 1:
            return value(pts[0])
        for lo, hi in zip(pts, pts[1:]):
            if width <= hi[0]:
                break
        f = (width - lo[0]) / (hi[0] - lo[0])
        return max(0.0, (1 - f) * value(lo) + f * value(hi))

    def target(self, s: int, width: int = 1) -> float:
        return self._at_width(width, lambda pt: self._curve(pt[1], s))

    def draft(self, width: int = 1) -> float:
        return self._at_width(width, lambda pt: pt[2])


def measure_engine(engine: OrtEngine, sizes: list[int], past: int = 64, reps: int = 5,
                   width: int = 1, clock=time.perf_counter) -> list[float]:
    """Least-disturbed time of a forward call with ``width`` sequences of S new tokens each
    (S in ``sizes``), every sequence on a ``past``-position cache. ``clock``: wall time by
    default; ``time.process_time`` measures CPU time (single-threaded runs on a shared machine)."""
    sizes = [s for s in sizes if s < engine.max_len] or [1]  # a tiny context: the curve extrapolates
    past = max(0, min(past, engine.max_len - max(sizes) - 1))
    seqs = list(range(width))
    engine.reset()
    pos = np.arange(past)
    for q in seqs:
        if past:
            engine.forward(np.zeros(past, dtype=np.int64), pos, causal_mask(0, pos), q)
            engine.commit(past, q)
    calls = []
    for s in sizes:
        pos = np.arange(past, past + s)
        calls.append((seqs, [np.zeros(s, dtype=np.int64)] * width))
        engine.forward_rows(*calls[-1])  # warm this shape
    best = [float("inf")] * len(sizes)
    for _ in range(reps):  # round robin over S, so drift on a shared machine hits every S alike
        for i, args in enumerate(calls):
            t0 = clock()
            engine.forward_rows(*args)
            best[i] = min(best[i], clock() - t0)  # the least disturbed run
    out = best
    engine.reset()
    return list(np.maximum.accumulate(out))  # T(S) is non-decreasing; smooth out noise


def measure_cost_model(target: OrtEngine, draft: OrtEngine | None, max_s: int = 16,
                       clock=time.perf_counter) -> CostModel:
    # ~0.3 s on the reference pair; min over 11 round-robin passes shrugs off a noisy moment
    t = measure_engine(target, list(range(1, max_s + 1)), past=128, reps=11, clock=clock)
    d = measure_engine(draft, [1], past=128, reps=21, clock=clock)[0] if draft is not None else 0.0
    return CostModel(target_times=t, draft_step=d)


def measure_width(cost: CostModel, target: OrtEngine, draft: OrtEngine | None, width: int,
                  max_s: int = 13, clock=time.perf_counter) -> None:
    """Add T(width, S) for S = 1..max_s and the draft step at ``width`` to ``cost``."""
    t = measure_engine(target, list(range(1, max_s + 1)), past=128, reps=7, width=width, clock=clock)
    d = measure_engine(draft, [1], past=128, reps=11, width=width, clock=clock)[0] if draft is not None else 0.0
    cost.widths[width] = (t, d)


def batch_widths(max_width: int) -> list[int]:
    """Widths measured for batches of up to ``max_width`` sequences: powers of two and the top."""
    out, b = [], 2
    while b < max_width:
        out.append(b)
        b *= 2
    return out + ([max_width] if max_width > 1 else [])


def learn_scale(scale: float, measured: float | None, modelled: float, high: float = 4.0) -> float:
    """One EMA step of a model's in-loop cost over its micro-benchmarked one (``measured`` /
    ``modelled``, clipped to [0.5, ``high``] so that one descheduled call cannot swamp it);
    unchanged when the call was not timed."""
    if measured is None or modelled <= 0:
        return scale
    return 0.95 * scale + 0.05 * min(max(measured / modelled, 0.5), high)


def first_call_scale(policy) -> float:
    """A drafting step's first call over its micro-benchmark (either policy): ``draft_scale``
    until a drafter reported the first call's share."""
    return policy.draft_scale if policy.first_draft_scale is None else policy.first_draft_scale


def chain_drafting(policy, k, c: float):
    """Drafting ``k`` tokens in a chain (an int or an array of them) at ``c`` per micro-benchmarked
    call (either policy): the first call at :func:`first_call_scale`, the others at ``draft_scale``."""
    return c * (k * policy.draft_scale + (first_call_scale(policy) - policy.draft_scale) * (k > 0))


def learn_drafting(policy, draft_seconds: float | None, first_share: float | None,
                   first_modelled: float, rest_modelled: float) -> None:
    """Fold one step's drafting time into ``policy.first_draft_scale`` and ``policy.draft_scale``
    (either policy): with the drafter's ``first_share`` the first call and the rest are learned
    apart, without it their sum as one scale."""
    if draft_seconds is None:
        return
    if first_share is None:
        policy.draft_scale = learn_scale(policy.draft_scale, draft_seconds, first_modelled + rest_modelled)
        return
    first = draft_seconds * first_share
    policy.first_draft_scale = learn_scale(first_call_scale(policy), first, first_modelled, high=8.0)
    if rest_modelled > 0:
        policy.draft_scale = learn_scale(policy.draft_scale, draft_seconds - first, rest_modelled)


@dataclass
class AdaptivePolicy:
    cost: CostModel
    k_max: int = 12
    prior: float = 0.6
    decay: float = 0.9  # EMA weight of history per verify call
    accept: list[float] = field(default_factory=list)  # a_j estimates, j = 1..k_max
    probe_every: int = 8  # every this many steps, draft 2 more than the optimum to re-estimate
    # a probe from K = 0 drafts ``probe_k`` tokens for ``probe_steps`` steps in a row: its cost is
    # mostly the draft's catch-up (RESYNC_CONTEXT tokens of prefill, ~5 target steps on the
    # Qwen2.5-Coder int4 pair), paid once, so the steps after it are cheap evidence (a lone K = 1
    # probe tested one position per catch-up, and "auto" never learned that K = 2 paid 1.36x
    # on code and math while it lost 5-7% to probes on writing)
    probe_k: int = 2
    probe_steps: int = 4
    # Off by default: measured on the reference pair, the distilled draft is under-confident
    # (top-1 acceptance 0.83 while its top probability is often < 0.5), so the floor cut drafts
    # short and "auto" ran at 1.28x against 1.75x for the best fixed K.
    use_confidence_stop: bool = False
    last_k: int = 0
    overlap: bool = False  # drafting hidden behind verification on look-ahead hits
    # per-step cost of drafting steps that the micro-benchmarks do not see (EMA of measured step
    # time minus the model's): the loop's drafting bookkeeping and, above all, switching models
    # (each model's weights evicted from the caches by the other's calls); target-only steps
    # (K = 0) do not pay it. It does not grow with K, so it favours longer blocks;
    # measured on a 6-layer int8 self-draft pair, where it made the difference between "auto"
    # stopping at K = 3-5 and reaching the best fixed K (8-10)
    step_overhead: float = 0.0
    # a draft call's cost in the loop over its micro-benchmarked cost (EMA of each step's drafting
    # time / (K c)): drafting right after a verify call runs on caches the target evicted,
    # measured 1.2-1.5x the warm figure on the reference pair. Learned apart from step_overhead,
    # which would otherwise absorb a cost that grows with K as a constant and push K too long
    draft_scale: float = 1.0
    # the same for a drafting step's first call alone, where the drafter reports its share
    # (ModelDrafter.first_call_share; None: not seen, draft_scale stands in): the catch-up call
    # runs on the caches the verify call evicted and costs more than the later ones (measured
    # 2-3x c on an int8 self-draft pair); priced per drafting step, not per drafted token, it no
    # longer makes long blocks look dear (there "auto" had settled at K ~5 where K = 10 was best)
    first_draft_scale: float | None = None
    target_scale: float = 1.0  # the same for the verify call (EMA of its time / T(K + 1))
    clock: object = time.perf_counter  # the cost model's clock, for observe_step's timings
    _idle: int = 0
    _backoff: int = 1  # probe interval multiplier while K = 0
    _probing: int = 0  # steps of the current probe still to run (see probe_steps)
    _paying: int = 0  # consecutive steps whose optimum drafted (K > 0)
    _tested: int = 0  # positions with at least one observation
    _step_times: dict[int, tuple] = field(default_factory=dict)  # per batch width: see _costs_at
    _ks: np.ndarray = field(default_factory=lambda: np.arange(0))

    def __post_init__(self) -> None:
        if not self.accept:
            self.accept = [self.prior] * self.k_max

    def step_time(self, k: int, width: int = 1) -> float:
        """One step of ``width`` sequences drafting ``k`` tokens each: k draft calls, one verify
        (with overlap, the k draft calls only when the last look-ahead missed)."""
        return (self.step_overhead if k > 0 else 0.0) + self.model_step_time(k, width)

    def model_step_time(self, k: int, width: int = 1) -> float:
        """:meth:`step_time` from the micro-benchmarked costs alone."""
        drafting = chain_drafting(self, k, self.cost.draft(width))
        if self.overlap:
            drafting *= 1.0 - hit_probability(self.accept, k)
        return drafting + self.cost.target(k + 1, width) * self.target_scale

    def best_k(self, width: int = 1) -> int:
        """The K maximising expected tokens per second for a batch of ``width`` sequences (each
        sequence expects the same tokens per step, so the batch's rate is ``width`` times it):
        :meth:`step_time` for every K at once, in a few array operations (it runs every step;
        tabulating it per K in Python cost ~60 us a step, 2-3% of "auto"'s decode time)."""
        ks = self._ks
        if len(ks) != self.k_max + 1:
            ks = self._ks = np.arange(self.k_max + 1)
        tokens = expected_chain_tokens(self.accept, self.k_max)
        c, targets = self._costs_at(width)
        drafting = chain_drafting(self, ks, c)
        if self.overlap:  # drafting only when the last look-ahead missed (hit_probability)
            drafting = drafting * (1.0 - np.cumprod(self.accept)[np.minimum(ks, self.k_max - 1)])
        times = drafting + targets * self.target_scale + self.step_overhead * (ks > 0)
        return int(np.argmax(tokens / times))

    def _costs_at(self, width: int) -> tuple[float, np.ndarray]:
        """(c, T(K + 1) for K = 0..k_max) at this batch width: fixed once measured, so tabulated
        once per width (make_policy clears the table when it swaps the cost model)."""
        costs = self._step_times.get(width)
        if costs is None:
            costs = self._step_times[width] = (
                self.cost.draft(width), np.array([self.cost.target(k + 1, width) for k in range(self.k_max + 1)]))
        return costs

    def update(self, proposed: int, accepted: int) -> None:
        """Fold one verify call's outcome into the per-position estimates.

        Positions never tested yet inherit the deepest tested estimate instead of keeping the
        prior: otherwise a policy that settled on K never learns that K + 2 would pay (measured:
        with a fixed 0.6 prior it stayed at K = 3-5 where K = 7-10 was best).
        """
        for j in range(min(proposed, self.k_max)):
            if j > accepted:
                break  # positions after the first rejection were not tested
            hit = 1.0 if j < accepted else 0.0
            self.accept[j] = self.decay * self.accept[j] + (1 - self.decay) * hit
            self._tested = max(self._tested, j + 1)
        for j in range(self._tested, self.k_max):
            self.accept[j] = self.accept[self._tested - 1]

    def observe_step(self, k: int, seconds: float, width: int = 1, draft_seconds: float | None = None,
                     verify_seconds: float | None = None, first_draft_share: float | None = None) -> None:
        """One whole step (draft, verify, accept) of ``width`` rows drafting ``k`` tokens took
        ``seconds`` (policy clock), ``draft_seconds`` of it drafting and ``verify_seconds`` in the
        verify call (None: not measured, e.g. overlapped), ``first_draft_share`` of the drafting
        in its first call (None: not reported): fold those into :attr:`first_draft_scale`,
        :attr:`draft_scale` and :attr:`target_scale` (clipped) and what the model still misses into
        :attr:`step_overhead` (clipped to [0, 2 T(1)]), so one descheduled step cannot swamp
        any of them."""
        if k <= 0:  # no drafting, no model switch: nothing to learn about drafting steps
            return
        c = self.cost.draft(width)
        learn_drafting(self, draft_seconds, first_draft_share, c, (k - 1) * c)
        self.target_scale = learn_scale(self.target_scale, verify_seconds, self.cost.target(k + 1, width))
        t1 = self.cost.target(1, width)
        residual = min(max(seconds - self.model_step_time(k, width), 0.0), 2.0 * t1)  # per step: no numpy
        self.step_overhead = 0.95 * self.step_overhead + 0.05 * residual

    def confidence_floor(self) -> float:
        """Stop drafting when prod(draft top-prob) falls below this: the expected gain of one
        more token (that probability, in tokens) is worth less than its cost in token-times."""
        t1 = self.cost.target(1)
        marginal = self.cost.draft_step + (self.cost.target(2) - t1)
        return float(np.clip(marginal / t1, 0.0, 0.9)) if t1 > 0 else 0.0

    def observe(self, proposed: int, accepted: int) -> None:
        """One sequence's verify outcome (every row of a batch reports its own)."""
        if proposed:
            self.update(proposed, accepted)
            if accepted == 0:
                self._probing = 0  # a probe that finds nothing stops (see choose)

    def choose(self, width: int = 1) -> int:
        """K for the next step of a batch of ``width`` sequences."""
        k = self.best_k(width)
        # explore: now and then draft two more than the optimum, so estimates of deeper
        # positions (which the chosen K stops testing) can recover after a bad stretch. Every
        # (probe_every x width)-th step: a step of ``width`` rows tests ``width`` sequences at
        # once, and a wide verify call is costly (measured at B = 8 on the reference pair:
        # exploring every 8th step cost ~15% of "auto"'s throughput).
        # While drafting does not pay at all (K = 0: a weak or costly draft), each probe is pure
        # loss, so the interval doubles after every probe that leaves K at 0 (up to 32x) and
        # resets once K > 0 (measured on a pair with 6% acceptance and c = 1: probing every 8th
        # step cost 20% against target-only decoding).
        # A probe from K = 0 runs probe_steps steps of probe_k (see there), cut short when one of
        # them accepts nothing (observe). The backoff resets only once drafting has paid for
        # probe_every steps in a row: estimates carried over from an earlier generation (code,
        # acceptance 0.9) made a summarization prompt (0.15) draft a few steps, and resetting the
        # backoff on those steps made it probe every 8-32 steps after (-13%).
        self._idle += 1
        self._paying = self._paying + 1 if k > 0 else 0
        if k > 0:
            self._probing = 0
            if self._paying >= self.probe_every:
                self._backoff = 1
        elif self._probing > 0:
            self._probing -= 1
            k = min(self.k_max, self.probe_k)
        elif self._idle >= self.probe_every * width * self._backoff:
            self._idle = 0
            self._backoff = min(32, self._backoff * 2)
            self._probing = self.probe_steps - 1
            k = min(self.k_max, self.probe_k)
        if k > 0 and self._idle >= self.probe_every * width * self._backoff:
            self._idle = 0
            k = min(self.k_max, k + 2)
        self.last_k = k
        return k


def make_policy(generator, drafter: str | None, max_width: int = 1, overlap: bool = False,
                scope: str = "") -> AdaptivePolicy:
    """The generator's policy for this drafter, measured once and kept across generations.

    The cost model is measured once per generator for one sequence, and once per batch width
    the first time a batch of up to ``max_width`` sequences asks (before it starts: measuring
    uses the engines' caches).
    """
    cache = generator.__dict__.setdefault("_policies", {})
    key = (scope + (drafter or "none"), bool(overlap))  # scope: e.g. the hybrid's own pair of policies
    draft = generator.draft_engine if drafter == "model" else None
    clock = generator.__dict__.get("measure_clock", time.perf_counter)
    cost = generator.__dict__.get("_cost_model")
    disk_key = _cost_key(generator, clock)
    if cost is None and disk_key is not None:  # measured before on this machine (cost_cache)
        cached = cost_cache.load_cost(disk_key)
        if cached is not None:
            cost = generator._cost_model = CostModel(**cached)
    changed = False
    if cost is None or (draft is not None and cost.draft_step == 0.0):
        cost = measure_cost_model(generator.target, draft, clock=clock)
        generator._cost_model = cost
        changed = True
    for width in batch_widths(max_width):
        if width not in cost.widths or (draft is not None and cost.widths[width][1] == 0.0):
            measure_width(cost, generator.target, draft, width, clock=clock)
            changed = True
    if changed and disk_key is not None:
        cost_cache.save_cost(disk_key, cost.target_times, cost.draft_step, cost.widths)
    if drafter != "model":  # prompt lookup: drafting costs (next to) nothing
        cost = CostModel(cost.target_times, 0.0, {b: (t, 0.0) for b, (t, _) in cost.widths.items()})
    policy = cache.setdefault(key, AdaptivePolicy(cost, overlap=bool(overlap), clock=clock))
    policy.cost = cost  # possibly with more widths than when the policy was made
    policy._step_times = {}
    return policy


def _cost_key(generator, clock) -> str | None:
    """The on-disk cost model's key for this generator's bundle, engines and clock (None: a
    bundle without a manifest, e.g. engines built by hand in tests)."""
    manifest = getattr(getattr(generator, "bundle", None), "manifest", None)
    if not manifest:
        return None
    graphs = [m["graph"] for m in manifest.get("models", {}).values() if isinstance(m, dict) and "graph" in m]
    draft = getattr(generator, "draft_engine", None)
    machine = {"target": cost_cache.engine_settings(generator.target), "draft": cost_cache.engine_settings(draft),
               "clock": getattr(clock, "__name__", str(clock)), "max_len": getattr(generator.target, "max_len", None)}
    return cost_cache.cost_key(manifest, graphs, machine)


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

    def template(self, parents: tuple, ranks: tuple):
        from specdec_rt.runtime.tree import Template

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


def make_tree_policy(generator) -> TreePolicy:
    """The generator's tree policy: its cost model (as for "auto" chains) plus the draft's cost
    for calls of 1..8 rows, measured once; estimates kept across generations."""
    cache = generator.__dict__.setdefault("_policies", {})
    policy = cache.get("tree")
    if policy is None:
        cost = make_policy(generator, "model").cost
        clock = generator.__dict__.get("measure_clock", time.perf_counter)
        sizes = [1, 2, 3, 4, 6, 8]
        rows = measure_engine(generator.draft_engine, sizes, past=128, reps=11, clock=clock)
        c = [float(x) for x in np.interp(np.arange(1, 9), sizes, rows)]
        policy = cache["tree"] = TreePolicy(cost, draft_rows=c, clock=clock)
    return policy
