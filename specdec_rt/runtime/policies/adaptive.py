"""Cost-model-driven draft length for chains (``num_draft_tokens="auto"``).

Per step of a batch of B sequences, choose K in [0, k_max] maximizing expected tokens per second:

    E[tokens | K] = 1 + sum_{i=1..K} prod_{j<=i} a_j            (a_j: P(accept j | accepted j-1))
    time(K)       = K * c_draft(B) + T(B, K + 1)                  (T(B, S): target time for B x S tokens)

This is Leviathan et al.'s speedup formula generalised to per-position acceptance and a measured
T(B, S) surface (:mod:`specdec_rt.runtime.policies.cost_model`) instead of a constant-cost assumption (the
batch's rate is B E / time, so the same argmax). The a_j are running estimates (exponential
moving average over verify calls of every sequence, kept across generations by the generator's
:class:`~specdec_rt.runtime.loop.policy_store.PolicyStore`). Wide batches make verification costlier
per extra draft position (T(B, S) grows with B x S once the weights are no longer the bottleneck)
while the draft's cost per step hardly changes, which is how the policy learns shorter K for
wide batches. A second, cheaper rule works inside a step:
the drafter stops early when the draft's own confidence (the product of its top
probabilities) says the next token is not worth its cost.

Overlapped decoding (:mod:`specdec_rt.runtime.loop.overlap`) hides a step's drafting behind the
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

from specdec_rt.runtime.policies.cost_model import CostModel, chain_drafting, expected_chain_tokens, learn_drafting, learn_scale


def hit_probability(accept: list[float], k: int) -> float:
    """P(the look-ahead survives a step of k drafts): all k accepted and the guess for the
    bonus position accepted too (per-position acceptance a_1..a_{k+1}); drafting overlapped with
    verification (:mod:`specdec_rt.runtime.loop.overlap`) hides the draft's time with this chance."""
    p = 1.0
    for a in accept[: k + 1]:
        p *= a
    return p


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
    target_scale: float = 1.0  # the same for the verify call (EMA of its time / (T(K + 1) + plain_offset))
    # per-call target time the micro-benchmark misses at this generation's context, the same for
    # every S (EMA of a K = 0 step's verify time - T(1)): the cost model's T(S) is measured over a
    # short past, and a long prompt adds a per-call cost (the attention's copy of the past) that
    # does not grow with S. As a scale it made T(2)/T(1) look like 1.23 where it was ~1.1 at
    # ~700 positions on the Qwen2.5-Coder int4 target, and "auto" never drafted with prompt
    # lookup where K = 1 paid 1.04-1.65x in every category
    plain_offset: float = 0.0
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

    @property
    def free_drafting(self) -> bool:
        """Proposals cost no model call (prompt lookup): a probe costs only a wider verify call."""
        return self.cost.draft(1) <= 0.0

    def start(self) -> None:
        """A new generation. Prompt lookup's acceptance is the prompt's (0.1 on writing, 0.8 on
        summarization on the Qwen2.5-Coder pair), not the pair's: its estimates restart from the
        prior, which costs a few wider verify calls where lookup does not pay and finds the
        1.6-1.8x of summarization that estimates carried over from other prompts hid (they had
        settled at K = 0 with the probes backed off). A drafter with a cost (a draft model) keeps
        its estimates and back-off: its acceptance is mostly the pair's, and a probe costs a
        catch-up."""
        if not self.free_drafting:
            return
        self.accept = [self.prior] * self.k_max
        self._tested = 0
        self._idle = self._probing = self._paying = 0
        self._backoff = 1

    def set_cost(self, cost: CostModel) -> None:
        """Decide from ``cost`` from now on (e.g. the same figures with more batch widths
        measured): the per-width tables of :meth:`best_k` are rebuilt from it."""
        self.cost = cost
        self._step_times = {}

    def step_time(self, k: int, width: int = 1) -> float:
        """One step of ``width`` sequences drafting ``k`` tokens each: k draft calls, one verify
        (with overlap, the k draft calls only when the last look-ahead missed)."""
        return (self.step_overhead if k > 0 else 0.0) + self.model_step_time(k, width)

    def model_step_time(self, k: int, width: int = 1) -> float:
        """:meth:`step_time` from the micro-benchmarked costs alone."""
        drafting = chain_drafting(self, k, self.cost.draft(width))
        if self.overlap:
            drafting *= 1.0 - hit_probability(self.accept, k)
        return drafting + (self.cost.target(k + 1, width) + self.plain_offset) * self.target_scale

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
        times = drafting + (targets + self.plain_offset) * self.target_scale + self.step_overhead * (ks > 0)
        return int(np.argmax(tokens / times))

    def _costs_at(self, width: int) -> tuple[float, np.ndarray]:
        """(c, T(K + 1) for K = 0..k_max) at this batch width: fixed once measured, so tabulated
        once per width (:meth:`set_cost` clears the table)."""
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
        any of them. A step without drafting teaches only :attr:`plain_offset` (its verify call is
        T(1) plus what the context adds; clipped to [0, 4 T(1)])."""
        if k <= 0:  # no drafting, no model switch: only the plain call's cost at this context
            if verify_seconds is not None:
                t1 = self.cost.target(1, width)
                # a context only adds: a plain call faster than its micro-benchmark (a tiny model
                # whose in-loop calls run on warmer caches) is no reason to price verification
                # steeper (learned as -0.5 T(1) on the reference pair, "auto" lookup fell 1.4 -> 1.2x)
                extra = min(max(verify_seconds / self.target_scale - t1, 0.0), 4.0 * t1)
                self.plain_offset = 0.9 * self.plain_offset + 0.1 * extra
            return
        c = self.cost.draft(width)
        learn_drafting(self, draft_seconds, first_draft_share, c, (k - 1) * c)
        self.target_scale = learn_scale(self.target_scale, verify_seconds,
                                        self.cost.target(k + 1, width) + self.plain_offset)
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
            # free drafting (lookup) has no catch-up to amortise: one-step probes, at most every
            # 32 steps, so a stretch that starts copying from the prompt is found within it
            self._idle = 0
            self._backoff = min(4 if self.free_drafting else 32, self._backoff * 2)
            self._probing = (1 if self.free_drafting else self.probe_steps) - 1
            k = min(self.k_max, self.probe_k)
        if k > 0 and self._idle >= self.probe_every * width * self._backoff:
            self._idle = 0
            k = min(self.k_max, k + 2)
        self.last_k = k
        return k
