"""From a validated :class:`~specdec_rt.runtime.loop.requests.SpeculationConfig` to what the loop runs:
the drafter, a fixed K or the policy that picks K per step, and the verify thread of an
overlapped run (:class:`SpeculationPlan`). The single-sequence API, batch sessions and the
server all plan through :func:`plan_speculation`, so a setting means the same everywhere."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.drafters.base import Drafter, ModelDrafter, PromptLookupDrafter
from specdec_rt.runtime.drafters.eagle import EagleHead
from specdec_rt.runtime.drafters.hybrid import HybridDrafter, HybridPolicy
from specdec_rt.runtime.drafters.names import AUTO, NO_OVERLAP
from specdec_rt.runtime.drafters.suffix import SuffixDrafter, SuffixGoodput, SuffixPool
from specdec_rt.runtime.loop.overlap import VerifyThread
from specdec_rt.runtime.loop.policy_store import PolicyStore
from specdec_rt.runtime.loop.requests import SpeculationConfig

# a suffix proposal the suffix hybrid takes over the draft model's: at least this many expected
# accepted tokens (the sum of its continuation frequencies; see suffix.py)
SUFFIX_HYBRID_MIN_SCORE = 1.0


@dataclass
class SpeculationPlan:
    """What a generation runs: ``k`` (fixed K; 0 with a policy), ``policy`` (picks K per step for
    "auto" chains; None otherwise), ``drafter`` (None: target-only) and ``verify_thread`` (the
    worker an overlapped run verifies on; None: sequential)."""

    k: int
    policy: object | None
    drafter: Drafter | None
    verify_thread: VerifyThread | None = None

    @property
    def overlapped(self) -> bool:
        return self.verify_thread is not None and self.drafter is not None


def make_drafter(name: str | None, draft_engine, vocab_size: int, draft_context: int | None,
                 suffix_pool: SuffixPool | None = None, head: EagleHead | None = None) -> Drafter | None:
    """The drafter called ``name`` ("model", "prompt_lookup", "hybrid", "suffix", "suffix_hybrid",
    "eagle"; None: target-only). ``suffix_pool``: what the suffix drafters also match against;
    ``head``: the bundle's EAGLE-3 head, opened."""
    if name is None:
        return None
    if name == "eagle":
        if head is None:
            raise GenerationInputError("this bundle has no EAGLE-3 head (drafter='eagle'); export one with "
                                       "specdec-export --draft-head DIR")
        return head.drafter(draft_context)
    if name == "prompt_lookup":
        return PromptLookupDrafter()
    if name == "suffix":
        return SuffixDrafter(suffix_pool)
    if draft_engine is None:
        if name in ("hybrid", "suffix_hybrid"):
            free = "prompt_lookup" if name == "hybrid" else "suffix"
            raise GenerationInputError(f"drafter='{name}' mixes {free} with the draft model, and this "
                                       f"bundle has no draft model; use drafter='{free}'")
        raise GenerationInputError("this bundle has no draft model; use drafter='prompt_lookup', 'suffix' or None")
    model = ModelDrafter(draft_engine, vocab_size, draft_context)
    if name == "hybrid":
        return HybridDrafter(model)
    if name == "suffix_hybrid":
        return HybridDrafter(model, SuffixDrafter(suffix_pool, min_score=SUFFIX_HYBRID_MIN_SCORE),
                             name="suffix_hybrid")
    return model


def plan_speculation(config: SpeculationConfig, width: int, *, draft_engine, vocab_size: int,
                     draft_context: int | None, policies: PolicyStore, default_overlap: bool,
                     verify_thread: Callable[[], VerifyThread],
                     suffix_pool: SuffixPool | None = None, head: EagleHead | None = None) -> SpeculationPlan:
    """Resolve ``config`` for a generation of ``width`` sequences: ``drafter="auto"`` becomes the
    drafter :meth:`PolicyStore.auto_drafter` picks for this bundle. ``default_overlap``: the
    generator's setting where ``config.overlap`` is None (chains only, and drafters that can
    draft ahead: the others run sequentially); ``verify_thread``: gives the generator's (one,
    reused) verify worker; ``suffix_pool``: the generator's pool for the suffix drafters; ``head``:
    the generator's EAGLE-3 head, if its bundle has one."""
    name = config.drafter
    if name == AUTO:  # a generator loaded with overlap=True asks for a drafter that drafts ahead
        wants_overlap = default_overlap if config.overlap is None else config.overlap
        name = policies.auto_drafter(config.speculation, overlap=bool(wants_overlap))
    overlap = config.overlap
    if overlap is None:
        overlap = default_overlap and config.speculation == "chain" and name not in NO_OVERLAP
    if overlap and name in NO_OVERLAP:
        picked = " (what drafter='auto' picks for this bundle)" if config.drafter == AUTO else ""
        raise GenerationInputError(f"drafter='{name}'{picked} does not draft ahead: use overlap=False with it")
    drafter = make_drafter(name, draft_engine, vocab_size, draft_context, suffix_pool, head)
    k, policy = 0, None
    if not config.auto:
        k = int(config.num_draft_tokens)
    elif config.speculation == "chain" and drafter is not None:
        if isinstance(drafter, HybridDrafter):
            free = "prompt_lookup" if drafter.name == "hybrid" else "suffix"
            lookup, model = (policies.chain(free, width, scope=drafter.name + ":"),
                             policies.chain("model", width, scope=drafter.name + ":"))
            lookup.start()  # a new generation (prompt lookup's estimates are per prompt)
            model.start()
            if isinstance(drafter.lookup, SuffixDrafter):  # its proposals cut where their goodput peaks
                lookup = drafter.lookup.goodput = SuffixGoodput(lookup)
            policy = drafter.policy = HybridPolicy(lookup, model)
        else:
            policy = policies.chain(name, width, overlap)
            policy.start()
            if isinstance(drafter, ModelDrafter) and policy.use_confidence_stop:
                drafter.confidence_floor = policy.confidence_floor()
            if isinstance(drafter, SuffixDrafter):  # each proposal cut where its goodput peaks
                policy = drafter.goodput = SuffixGoodput(policy)
    return SpeculationPlan(k, policy, drafter, verify_thread() if overlap else None)
