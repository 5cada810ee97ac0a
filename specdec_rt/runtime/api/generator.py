"""The public Python API: ``load(bundle)`` -> :class:`Generator` with ``generate``, ``stream``,
``chat`` and ``chat_stream``."""
from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np

from specdec_rt.errors import ChatTemplateError, ContextOverflowError, GenerationInputError  # noqa: F401 - re-exported here
from specdec_rt.runtime.api.chat import NO_TEMPLATE, ChatTemplate
from specdec_rt.runtime.api.limits import (DEFAULT_CONTEXT, DEFAULT_MAX_BATCH, prompt_token_ids,  # noqa: F401 - re-exported
                                           check_threads, resolve_context, resolve_draft_context, resolve_max_batch)
from specdec_rt.runtime.api.warmup import warm_up
from specdec_rt.runtime.core.bundle import Bundle, BundleError, load_bundle
from specdec_rt.runtime.core.gen_config import GenerationDefaults
from specdec_rt.runtime.core.memory import peak_rss_bytes, reset_peak_rss
from specdec_rt.runtime.core.sampling import SamplingParamsError  # noqa: F401 - re-exported
from specdec_rt.runtime.core.stats import BatchStats, GenerationStats  # noqa: F401 - BatchStats re-exported
from specdec_rt.runtime.core.tokenizer import TextTokenizer
from specdec_rt.runtime.drafters.base import DRAFT_CONTEXT
from specdec_rt.runtime.drafters.eagle import EagleHead
from specdec_rt.runtime.drafters.suffix import SuffixPool
from specdec_rt.runtime.engines.factory import make_engine
from specdec_rt.runtime.engines.ort import OrtEngine
from specdec_rt.runtime.engines.prefix_cache import enable_prefix_cache
from specdec_rt.runtime.engines.probes import probe_batch_invariance, probe_row_invariance
from specdec_rt.runtime.engines.sessions import pool_for_overlap
from specdec_rt.runtime.loop.batch_session import BatchSession, BatchStream
from specdec_rt.runtime.loop.overlap import VerifyThread
from specdec_rt.runtime.loop.planning import SpeculationPlan, plan_speculation
from specdec_rt.runtime.loop.policy_store import PolicyStore
from specdec_rt.runtime.loop.requests import DRAFTERS, RowRequest, SpeculationConfig  # noqa: F401 - DRAFTERS re-exported
from specdec_rt.runtime.loop.speculative import run_chain
from specdec_rt.runtime.loop.text_output import GenerationResult, TextAssembler, finish_reason
from specdec_rt.runtime.loop.tree_step import tree_generation

class Generator:
    """A loaded bundle: target engine, optional draft engine, tokenizer."""

    def __init__(self, bundle: Bundle, provider: str = "cpu", draft_provider: str | None = None,
                 threads: int | None = None, max_length: int | None = None,
                 io_binding: bool | None = None, draft_threads: int | None = 1,
                 shared_thread_pool: bool = False, probe_rows: bool = True,
                 max_context: int | None = None, max_batch: int | None = None,
                 overlap: bool = False, draft_context: int | None = DRAFT_CONTEXT,
                 suffix_pool: SuffixPool | bool | None = None, prefix_cache: bool | str = True) -> None:
        self.bundle = bundle
        self.suffix_pool = SuffixPool.from_setting(suffix_pool)  # None: each request on its own
        check_threads(threads=threads, draft_threads=draft_threads)
        self.draft_context = resolve_draft_context(draft_context)  # None: the draft catches up on all
        self.overlap = bool(overlap)
        self._verify_thread: VerifyThread | None = None
        shared_thread_pool = pool_for_overlap(shared_thread_pool) if self.overlap else shared_thread_pool
        self.max_length = resolve_context(bundle.max_context, max_context or max_length)
        self.max_batch = resolve_max_batch(max_batch, provider, draft_provider if bundle.draft else None)
        self.tokenizer = TextTokenizer(bundle.tokenizer_path)
        self.target = make_engine(bundle.graph_path("target"), bundle.target, self.max_length, provider,
                                threads, bundle.root, io_binding, shared_thread_pool, self.max_batch,
                                spin=not self.overlap)
        self.draft_engine = None if bundle.draft is None else make_engine(
            bundle.graph_path("draft"), bundle.draft, self.max_length, draft_provider or provider,
            draft_threads or threads, bundle.root, io_binding, shared_thread_pool, self.max_batch)
        self.head = None if bundle.head is None else EagleHead(  # drafter="eagle"
            bundle, self.target, self.max_length, draft_provider or provider, draft_threads or threads,
            io_binding, shared_thread_pool, self.max_batch)
        self.policies = PolicyStore(self.target, self.draft_engine, bundle.manifest, head=self.head)  # "auto"
        self.vocab_size = bundle.target.vocab_size
        self.eos_token_ids = tuple(bundle.eos_token_ids)
        if probe_rows and isinstance(self.target, OrtEngine):  # native TensorRT engines are not probed
            probe_row_invariance(self.target)  # exactness: pads 1-row calls where kernels differ
            # batches: a sequence's bits must not depend on who shares its call (said at load if asked)
            probe_batch_invariance(self.target, warn=max_batch is not None and max_batch > 1)
        # a chat's next turn keeps its earlier turns' K/V where that changes no bit (TensorRT: off)
        enable_prefix_cache(self.target, bundle.manifest, bundle.target.graph, prefix_cache,
                            probe=probe_rows and isinstance(self.target, OrtEngine))
        self.chat_template = (ChatTemplate(bundle.chat_template, bundle.special_token_strings)
                              if bundle.chat_template is not None else None)
        self.generation_defaults = GenerationDefaults.from_config(bundle.generation_config)
        self.generation_defaults.warn_ignored(bundle.root)

    prefix_cache = property(lambda self: self.target.prefix_reuse)  # load's prefix_cache, on where exact

    def clear_prefix_cache(self) -> None:
        """Forget every sequence's cached prefix (benchmarks timing one prompt several ways)."""
        self.target.reset()

    # older scripts set ``gen.measure_clock``: the clock is the policy store's setting now
    measure_clock = property(lambda self: self.policies.clock, lambda self, c: setattr(self.policies, "clock", c))

    @property
    def exact_trees(self) -> bool:
        """Whether tree verification is token-identical to target-only decoding: the target sums
        attention in float64 (docs/design.md, "Exactness, bit for bit"). Chains are exact either way."""
        return self.bundle.manifest.get("models", {}).get("target", {}).get("attention_accumulation") == "fp64"

    # -- argument checks ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
        """The prompt's token ids as a generation runs them, validated: text is encoded, ids are
        checked against the vocabulary, and the prompt must leave room in the context."""
        return prompt_token_ids(prompt, self.tokenizer, self.vocab_size, self.max_length, self.bundle.max_context)

    def speculation_plan(self, config: SpeculationConfig, width: int = 1) -> SpeculationPlan:
        """What a generation of ``width`` sequences with ``config`` runs: drafter, K or policy, and
        the verify thread when overlapped (the generator's default where ``config.overlap`` is None)."""
        return plan_speculation(config, width, draft_engine=self.draft_engine, vocab_size=self.vocab_size,
                                draft_context=self.draft_context, policies=self.policies,
                                default_overlap=self.overlap, verify_thread=self._shared_verify_thread,
                                suffix_pool=self.suffix_pool, head=self.head)

    def warm_up(self, max_batch: int | None = None) -> dict[str, float]:
        """Pay now what the first requests would: the cost model of "auto" for batches of up to
        ``max_batch`` rows, first calls of every decoding path (:mod:`specdec_rt.runtime.api.warmup`)."""
        return warm_up(self, max_batch)

    def _shared_verify_thread(self) -> VerifyThread:
        self._verify_thread = self._verify_thread or VerifyThread()
        return self._verify_thread

    def _loop(self, prompt_ids: list[int], request: RowRequest, config: SpeculationConfig,
              stats: GenerationStats) -> Iterator[list[int]]:
        """One sequence's committed tokens, step by step (chain or tree)."""
        cfg = request.loop_config(self.generation_defaults, self.eos_token_ids)
        plan = self.speculation_plan(config)
        d = plan.drafter
        stats.overlap, stats.prompt_tokens, stats.speculation = plan.overlapped, len(prompt_ids), config.speculation
        stats.drafter, stats.drafter_requested = None if d is None else d.name, config.drafter
        stats.num_draft_tokens, rng = config.num_draft_tokens, np.random.default_rng(request.seed)
        if config.speculation == "chain":
            inner = run_chain(self.target, d, prompt_ids, cfg, rng, stats, plan.k, plan.policy, plan.verify_thread)
        else:
            inner = tree_generation(self.target, d, prompt_ids, cfg, rng, stats, config, self.policies,
                                    self.exact_trees)
        reset_peak_rss()
        try:
            yield from inner
        finally:
            stats.peak_rss_bytes = peak_rss_bytes()
        if d is not None:
            stats.draft_calls = getattr(d, "calls", 0)

    # -- public API -------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               num_draft_tokens: int | str = "auto", drafter: str | None = "auto",
               speculation: str = "chain", stop: Sequence[str] | str | None = None,
               do_sample: bool | None = None, ignore_eos: bool = False,
               result: GenerationResult | None = None, tree_shape=None,
               every_step: bool = False, overlap: bool | None = None, user: str | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are committed. Pass ``result`` to collect ids and stats.

        ``every_step=True`` also yields ``""`` for a step whose tokens add no visible text yet (a
        partial UTF-8 character, text held back while it may start a stop string), so a consumer
        sees every target call and can stop between any two of them (the server cancels a
        disconnected client's generation this way).

        ``temperature`` / ``top_k`` / ``top_p`` / ``do_sample`` left as ``None`` take the bundle's
        defaults (:attr:`generation_defaults`, from its ``generation_config.json``; greedy when it
        has none). Explicit values win; ``temperature=0`` or ``do_sample=False`` is greedy.

        ``overlap``: draft the next block while the target verifies this one (a worker thread;
        :mod:`specdec_rt.runtime.loop.overlap`); ``None`` takes the generator's default
        (``load(..., overlap=...)``, which also sets the thread pools up for it). Output is the
        same as without (greedy: token for token; sampled: the same distribution).

        ``user``: who asks (OpenAI's ``user``); it selects the suffix pool a suffix drafter
        reads and feeds (``load(..., suffix_pool=...)``) and changes nothing else.
        """
        prompt_ids = self.encode_prompt(prompt)
        request = RowRequest(prompt_ids, max_new_tokens, temperature, top_k, top_p, do_sample, seed, stop, ignore_eos,
                             user)
        config = SpeculationConfig(num_draft_tokens, drafter, speculation, overlap, tree_shape)
        stats = GenerationStats()
        res = result if result is not None else GenerationResult("", [], stats)
        res.stats, res.prompt_token_ids, res.token_ids, res.text = stats, prompt_ids, [], ""
        text = TextAssembler(self.tokenizer, request.stops, () if ignore_eos else self.eos_token_ids)
        for new in self._loop(prompt_ids, request, config, stats):
            res.token_ids.extend(new)
            piece = text.push(new)
            if piece or every_step:
                res.text += piece
                yield piece
            if text.stopped:
                break
        else:
            tail = text.close()
            if tail:
                res.text += tail
                yield tail
        res.finish_reason = finish_reason(text, len(prompt_ids), len(res.token_ids), max_new_tokens, self.max_length)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 num_draft_tokens: int | str = "auto", drafter: str | None = "auto",
                 speculation: str = "chain", stop: Sequence[str] | str | None = None,
                 do_sample: bool | None = None, ignore_eos: bool = False,
                 tree_shape=None, overlap: bool | None = None, user: str | None = None) -> GenerationResult:
        """Generate a completion of a plain prompt (text or token ids).

        Sampling arguments left as ``None`` take the bundle's defaults (greedy unless its
        ``generation_config.json`` sets ``do_sample``); ``temperature=0`` forces greedy. With
        ``speculation="tree"``, ``num_draft_tokens`` is the tree's node budget (default shape from
        :meth:`TreeShape.for_budget`; pass ``tree_shape`` to override it); ``"auto"`` lets
        :class:`~specdec_rt.runtime.policies.tree.TreePolicy` choose the shape per step (a chain where
        side branches do not pay). ``overlap``, ``user``: see :meth:`stream`.
        """
        result = GenerationResult("", [], GenerationStats())
        for _ in self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, num_draft_tokens,
                             drafter, speculation, stop, do_sample, ignore_eos, result=result,
                             tree_shape=tree_shape, overlap=overlap, user=user):
            pass
        result.text = self.tokenizer.decode(result.token_ids) if not stop else result.text
        return result

    def generate_ids(self, prompt_ids: Sequence[int], **kwargs) -> list[int]:
        """Token ids only, skipping detokenization (benchmarks, exactness tests)."""
        stats = GenerationStats()
        out: list[int] = []
        args = dict(max_new_tokens=128, temperature=None, top_k=None, top_p=None, seed=None,
                    num_draft_tokens="auto", drafter="auto", speculation="chain", do_sample=None,
                    ignore_eos=False, tree_shape=None, overlap=None, user=None)
        unknown = sorted(set(kwargs) - set(args))
        if unknown:
            raise TypeError(f"generate_ids() got unexpected keyword argument(s): {', '.join(unknown)}")
        args.update(kwargs)
        ids = self.encode_prompt(prompt_ids)
        request = RowRequest(ids, **{key: args[key] for key in RowRequest.FIELDS if key != "stop"})
        config = SpeculationConfig(args["num_draft_tokens"], args["drafter"], args["speculation"], args["overlap"],
                                   args["tree_shape"])
        for new in self._loop(ids, request, config, stats):
            out.extend(new)
        self.last_stats = stats
        return out

    # -- batches ------------------------------------------------------------------------------
    def stream_batch(self, prompts: Sequence, max_new_tokens: int = 128, *, batch_size: int | None = None,
                     temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                     seed: int | None = None, num_draft_tokens: int | str = "auto", drafter: str | None = "auto",
                     stop: Sequence[str] | str | None = None, do_sample: bool | None = None,
                     ignore_eos: bool = False, overlap: bool | None = None, user: str | None = None,
                     speculation: str = "chain", tree_shape=None) -> BatchStream:
        """:meth:`generate_batch` as it runs: iterate the returned :class:`BatchStream` for
        ``(index, text piece)`` pairs; its ``results`` fill in as rows progress and
        ``cancel(index)`` ends one row (the others are not affected)."""
        if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Sequence):
            raise GenerationInputError("prompts must be a list of prompts (text, token ids, or dicts)")
        if not prompts:
            raise GenerationInputError("the prompt list is empty")
        width = min(len(prompts), self.max_batch) if batch_size is None else batch_size
        if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
            raise GenerationInputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if width > self.max_batch:
            raise GenerationInputError(
                f"batch_size {width} exceeds this generator's maximum of {self.max_batch} sequences "
                f"(load(..., max_batch={width}) on the CPU provider; GPU providers run one at a time)")
        session = BatchSession(self, SpeculationConfig(num_draft_tokens, drafter, speculation, overlap, tree_shape), width)
        defaults = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, stop=stop, do_sample=do_sample, ignore_eos=ignore_eos, user=user)
        return BatchStream.from_prompts(session, prompts, defaults)

    def generate_batch(self, prompts: Sequence, max_new_tokens: int = 128, *, batch_size: int | None = None,
                       temperature: float | None = None, top_k: int | None = None,
                       top_p: float | None = None, seed: int | None = None,
                       num_draft_tokens: int | str = "auto", drafter: str | None = "auto",
                       stop: Sequence[str] | str | None = None, do_sample: bool | None = None,
                       ignore_eos: bool = False, overlap: bool | None = None, user: str | None = None,
                       speculation: str = "chain", tree_shape=None) -> list[GenerationResult]:
        """Complete many prompts with up to ``batch_size`` of them decoding at once (default:
        all of them, at most :attr:`max_batch`); returns one result per prompt, in order.

        Every row's output is what :meth:`generate` gives for that prompt with the same
        arguments: greedy rows token for token, sampled rows draw for draw with the same ``seed``
        (with a fixed ``num_draft_tokens`` and a draft whose rows are batch-invariant; with
        "auto", K depends on the batch, so sampled rows draw differently, from the same
        distribution). Each step drafts for every row, verifies
        all of them in one target call and accepts per row; finished rows leave and waiting
        prompts take their place (continuous batching). ``num_draft_tokens="auto"`` chooses K
        per step from the target's measured T(B, S) surface at the batch's width B.

        A prompt is text, token ids, or a dict ``{"prompt": ..., <argument>: value}`` that
        overrides ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``,
        ``do_sample``, ``ignore_eos`` or ``user`` for that row. A row whose input is bad (empty, too long
        for the context, bad sampling values) gets ``finish_reason="error"`` and the message in
        ``error``; the others run. ``last_batch_stats`` holds the batch's totals. ``overlap``:
        the draft looks ahead for every row while the target verifies (see :meth:`stream`).
        ``speculation="tree"``: every row verifies a token tree (a fixed shape: ``tree_shape``, or
        one of ``num_draft_tokens`` nodes, 15 with "auto"), all rows in one target call.
        """
        run = self.stream_batch(prompts, max_new_tokens, batch_size=batch_size, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed, num_draft_tokens=num_draft_tokens,
                                drafter=drafter, stop=stop, do_sample=do_sample, ignore_eos=ignore_eos,
                                overlap=overlap, user=user, speculation=speculation, tree_shape=tree_shape)
        for _ in run:
            pass
        for res, text in zip(run.results, run.texts):
            if text is not None and not text.stops and res.finish_reason != "error":
                res.text = self.tokenizer.decode(res.token_ids)
        return run.results

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, chat_template: str | None = None,
                            tools: list[dict] | None = None, **template_kwargs) -> str | list[int]:
        """Render a conversation with the bundle's chat template (transformers' semantics).

        ``tokenize=True`` returns the token ids, encoded without the tokenizer's post-processor
        (as transformers does: a template that writes ``bos_token`` gets exactly one BOS).
        ``chat_template``: the name of one of the bundle's templates, or a template string.
        Extra keyword arguments are template variables (e.g. ``enable_thinking=False``).
        """
        if self.chat_template is None:
            raise ChatTemplateError(NO_TEMPLATE)
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, tools=tools, **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False) if tokenize else text

    def _chat_ids(self, messages, chat_template, tools, template_kwargs) -> list[int]:
        ids = self.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       chat_template=chat_template, tools=tools, **(template_kwargs or {}))
        if not ids:
            raise ChatTemplateError("the chat template rendered this conversation as empty text")
        return ids

    def chat_stream(self, messages: Sequence[dict], max_new_tokens: int = 128, *,
                    chat_template: str | None = None, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, result: GenerationResult | None = None,
                    **kwargs) -> Iterator[str]:
        """:meth:`chat`, yielding the reply's text as tokens are committed (``result`` collects
        ids and stats). Keyword arguments are those of :meth:`stream`."""
        ids = self._chat_ids(messages, chat_template, tools, template_kwargs)
        yield from self.stream(ids, max_new_tokens, result=result, **kwargs)

    def chat(self, messages: Sequence[dict], max_new_tokens: int = 128, *,
             chat_template: str | None = None, tools: list[dict] | None = None,
             template_kwargs: dict | None = None, **kwargs) -> GenerationResult:
        """The assistant's next reply to ``messages`` (a list of ``{"role", "content"}`` dicts).

        The conversation is rendered with the bundle's chat template and
        ``add_generation_prompt=True``; generation stops at any of the bundle's EOS ids (e.g.
        ``<|im_end|>`` / ``<|eot_id|>`` from ``generation_config.json``). Keyword arguments are
        those of :meth:`generate` (sampling defaults from the bundle likewise). To continue the
        conversation, append ``{"role": "assistant", "content": result.text}`` and the next user
        turn.
        """
        ids = self._chat_ids(messages, chat_template, tools, template_kwargs)
        return self.generate(ids, max_new_tokens, **kwargs)


def load(bundle: str | os.PathLike, provider: str = "cpu", draft_provider: str | None = None,
         threads: int | None = None, max_length: int | None = None,
         verify_checksums: bool = True, io_binding: bool | None = None,
         draft_threads: int | None = 1, shared_thread_pool: bool = False,
         probe_rows: bool = True, max_context: int | None = None,
         max_batch: int | None = None, overlap: bool = False,
         draft_context: int | None = DRAFT_CONTEXT, suffix_pool: SuffixPool | bool | None = None,
         prefix_cache: bool | str = True) -> Generator:
    """Load a bundle. ``provider``: "cpu" | "cuda" | "tensorrt"; the draft may use another one.

    ``io_binding``: bind the KV buffers by pointer (default on GPUs; on CPU the default feeds the
    target zero-copy views, measured faster for small models, and the draft through persistent
    bindings of its past in 32-position windows, docs/design.md; False: views for both, True:
    per-call bindings for both). ``max_context``: positions (prompt plus
    generation) to preallocate K/V for; default min(bundle's context, 4096), never more than the
    bundle's (``max_length`` is its older name, still accepted). ``threads``: intra-op threads of the
    target (default: the cores); ``draft_threads``: of the draft (default 1, measured fastest
    for small drafts; None = same as ``threads``). ``shared_thread_pool``: run both models on
    ONNX Runtime's process-wide thread pool (measured ~1.5x faster per draft+verify cycle on 2
    cores, docs/design.md); ONNX Runtime then refuses sessions with their own pool in this
    process, so it is opt-in here and on in the command-line tools and the server.
    ``probe_rows``: measure at load whether the target computes a token's logits bit for bit
    alike in a one-row call and in a verify call, and pad one-row calls to two rows where it
    does not (int4 MatMulNBits on CPU): what keeps greedy speculation token-identical to
    target-only decoding (:func:`specdec_rt.runtime.engines.probes.probe_row_invariance`), and whether a
    sequence's logits are the same in a batched call as alone (else one sequence per call:
    :func:`specdec_rt.runtime.engines.probes.probe_batch_invariance`); False also leaves prefix reuse off.
    ``max_batch``: sequences :meth:`Generator.generate_batch` may run at once (default 8 on the
    CPU provider, 1 on GPU providers, where batched calls are not implemented yet).
    ``overlap``: the default of every generation's ``overlap`` (draft the next block while the
    target verifies this one, on a worker thread); it also gives the target its own thread pool
    whose workers do not spin, and so should not be combined with ``shared_thread_pool``.
    ``draft_context``: the most tokens the draft model (or EAGLE-3 head) runs to catch up before
    proposing (default 64; None: all); a longer gap restarts it on its last ``draft_context`` tokens
    (a re-entry after a stretch decoded without drafting: 32). Proposals see less, outputs are the same.
    ``suffix_pool``: let ``drafter="suffix"`` / ``"suffix_hybrid"`` also match the outputs of
    this generator's earlier requests (:class:`~specdec_rt.runtime.drafters.suffix.SuffixPool`; True: a
    pool of 200k tokens, one per ``user``, none for requests without one). Outputs stay exact.
    ``prefix_cache``: a prompt starting with what a sequence holds (a chat's earlier turns) keeps
    that K/V (``stats.cached_prompt_tokens``), only where probed bit-exact; "per-user": within
    one ``user`` only (:mod:`specdec_rt.runtime.engines.prefix_cache`).
    """
    b = load_bundle(bundle, verify_checksums=verify_checksums)
    return Generator(b, provider=provider, draft_provider=draft_provider, threads=threads,
                     max_length=max_length, io_binding=io_binding, draft_threads=draft_threads,
                     shared_thread_pool=shared_thread_pool, probe_rows=probe_rows,
                     max_context=max_context, max_batch=max_batch, overlap=overlap,
                     draft_context=draft_context, suffix_pool=suffix_pool, prefix_cache=prefix_cache)


__all__ = ["load", "Generator", "GenerationResult", "GenerationStats", "BatchStats", "BatchStream",
           "BundleError", "SuffixPool"]
