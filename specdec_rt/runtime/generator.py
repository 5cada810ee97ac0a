"""The public Python API: ``load(bundle)`` -> :class:`Generator` with ``generate``, ``stream``,
``chat`` and ``chat_stream``."""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from specdec_rt.errors import ChatTemplateError, GenerationInputError  # noqa: F401 - re-exported here
from specdec_rt.runtime.bundle import Bundle, BundleError, load_bundle
from specdec_rt.runtime.chat import NO_TEMPLATE, ChatTemplate
from specdec_rt.runtime.drafters import DRAFT_CONTEXT, Drafter, ModelDrafter, PromptLookupDrafter
from specdec_rt.runtime.hybrid import HybridDrafter, HybridPolicy
from specdec_rt.runtime.engine import (ContextOverflowError, make_engine, probe_batch_invariance,
                                      probe_row_invariance, shared_pool_in_use)
from specdec_rt.runtime.gen_config import GenerationDefaults
from specdec_rt.runtime.memory import peak_rss_bytes, reset_peak_rss
from specdec_rt.runtime.overlap import VerifyThread
from specdec_rt.runtime.sampling import SamplingParams, SamplingParamsError
from specdec_rt.runtime.speculative import LoopConfig, Row, run_batch, run_chain
from specdec_rt.runtime.stats import BatchStats, GenerationStats
from specdec_rt.runtime.tokenizer import IncrementalDecoder, TextTokenizer

DRAFTERS = ("model", "prompt_lookup", "hybrid")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = "length"  # "length" | "eos" | "stop" | "context" (batches: | "error" | "cancelled")
    prompt_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # batches: why this row failed (finish_reason "error")

    def to_dict(self) -> dict:
        d = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
             "stats": self.stats.to_dict()}
        if self.error is not None:
            d["error"] = self.error
        return d


DEFAULT_CONTEXT = 4096


class TextAssembler:
    """One sequence's text as its tokens are committed: incremental detokenization, with text
    that may be the start of a stop string withheld until it cannot be.

    ``push`` returns the text that can be emitted now; ``stopped`` turns true when a stop string
    completed (the text before it has been emitted, the rest is dropped); ``close`` returns what
    is still held at the end. ``finish``: "length", "eos" or "stop".
    """

    def __init__(self, tokenizer: TextTokenizer, stops: list[str], eos_ids: Sequence[int]) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = stops
        self.eos_ids = set(eos_ids)
        self.held = ""  # text withheld because it may be the start of a stop string
        self.finish = "length"
        self.stopped = False

    def _cut(self) -> int:
        return min((self.held.find(s) for s in self.stops if s in self.held), default=-1)

    def push(self, new: list[int]) -> str:
        piece = self.decoder.push(new)
        if new and new[-1] in self.eos_ids:
            self.finish = "eos"
        if not self.stops:
            return piece
        self.held += piece
        cut = self._cut()
        if cut >= 0:
            self.finish, self.stopped = "stop", True
            return self.held[:cut]
        keep = max(len(s) for s in self.stops) - 1  # a stop string may still be completing
        split = max(0, len(self.held) - keep)
        piece, self.held = self.held[:split], self.held[split:]
        return piece

    def close(self) -> str:
        tail = self.decoder.flush()
        if not self.stops:
            return tail
        self.held += tail
        cut = self._cut()
        if cut >= 0:
            self.held, self.finish = self.held[:cut], "stop"
        held, self.held = self.held, ""
        return held


DEFAULT_MAX_BATCH = 8


def resolve_max_batch(requested: int | None, provider: str, draft_provider: str | None) -> int:
    """Sequences the K/V caches hold for batched decoding: what was asked, else 8 on the CPU
    provider (host buffers from calloc: unused sequences cost no resident memory) and 1 on GPU
    providers (batched calls run on the CPU provider only in this version)."""
    cpu = all(p is None or p.lower() == "cpu" for p in (provider, draft_provider))
    if requested is None:
        return DEFAULT_MAX_BATCH if cpu else 1
    if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)) or requested < 1:
        raise GenerationInputError(f"max_batch must be an integer >= 1, got {requested!r}")
    return int(requested)


def resolve_context(bundle_max: int, requested: int | None) -> int:
    """Positions to preallocate K/V for: what was asked, else min(bundle maximum, 4096).

    The cache costs 2 x layers x kv_heads x head_dim x dtype bytes per position (a 128k-context
    1.5B model would take ~3.5 GB of float32 K/V), so the model's maximum is never the default.
    """
    if requested is None:
        return min(bundle_max, DEFAULT_CONTEXT)
    if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)) or requested < 2:
        raise GenerationInputError(f"max_context must be an integer >= 2, got {requested!r}")
    if requested > bundle_max:
        raise GenerationInputError(
            f"max_context {requested} exceeds the bundle's context of {bundle_max} tokens "
            "(re-export with a larger specdec-export --max-context)")
    return int(requested)


class Generator:
    """A loaded bundle: target engine, optional draft engine, tokenizer."""

    def __init__(self, bundle: Bundle, provider: str = "cpu", draft_provider: str | None = None,
                 threads: int | None = None, max_length: int | None = None,
                 io_binding: bool | None = None, draft_threads: int | None = 1,
                 shared_thread_pool: bool = False, probe_rows: bool = True,
                 max_context: int | None = None, max_batch: int | None = None,
                 overlap: bool = False, draft_context: int | None = DRAFT_CONTEXT) -> None:
        self.bundle = bundle
        # the most tokens the draft catches up before proposing (None: all); see DRAFT_CONTEXT
        if draft_context is not None and (isinstance(draft_context, bool) or not isinstance(draft_context, (int, np.integer))
                                          or draft_context < 1):
            raise GenerationInputError(f"draft_context must be a positive number of tokens or None, got {draft_context!r}")
        self.draft_context = None if draft_context is None else int(draft_context)
        self.overlap = bool(overlap)
        self._verify_thread: VerifyThread | None = None
        if self.overlap:
            if shared_thread_pool or shared_pool_in_use():
                warnings.warn("overlap=True: the models run on ONNX Runtime's process-wide thread pool, "
                              "so the draft and the target compete for its workers (measured slower than "
                              "their own pools: load without shared_thread_pool in a process that never "
                              "enabled it)", stacklevel=3)
            shared_thread_pool = False
        self.max_length = resolve_context(bundle.max_context, max_context or max_length)
        self.max_batch = resolve_max_batch(max_batch, provider, draft_provider if bundle.draft else None)
        self.tokenizer = TextTokenizer(bundle.tokenizer_path)
        self.target = make_engine(bundle.graph_path("target"), bundle.target, self.max_length, provider,
                                threads, bundle.root, io_binding, shared_thread_pool, self.max_batch,
                                spin=not self.overlap)
        self.draft_engine = None
        if bundle.draft is not None:
            self.draft_engine = make_engine(bundle.graph_path("draft"), bundle.draft, self.max_length,
                                          draft_provider or provider, draft_threads or threads,
                                          bundle.root, io_binding, shared_thread_pool, self.max_batch)
        self.vocab_size = bundle.target.vocab_size
        self.eos_token_ids = tuple(bundle.eos_token_ids)
        if probe_rows and hasattr(self.target, "min_rows"):
            probe_row_invariance(self.target)  # exactness: pads 1-row calls where kernels differ
            # exactness of batches: a sequence's bits must not depend on who shares its call
            # (said at load where batching was asked for, else at the first batched call)
            probe_batch_invariance(self.target, warn=max_batch is not None and max_batch > 1)
        self.chat_template = (ChatTemplate(bundle.chat_template, bundle.special_token_strings)
                              if bundle.chat_template is not None else None)
        self.generation_defaults = GenerationDefaults.from_config(bundle.generation_config)
        if self.generation_defaults.ignored:
            warnings.warn(
                f"{bundle.root}: generation_config.json sets {', '.join(self.generation_defaults.ignored)}, "
                "which specdec-rt does not apply (it applies temperature, top_k, top_p, do_sample and "
                "the EOS ids)", stacklevel=3)

    @property
    def exact_trees(self) -> bool:
        """Whether tree verification is token-identical to target-only decoding: the target sums
        attention in float64 (docs/design.md, "Exactness, bit for bit"). Chains are exact either way."""
        target = self.bundle.manifest.get("models", {}).get("target", {})
        return target.get("attention_accumulation") == "fp64"

    # -- argument checks ----------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationInputError("the prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            arr = np.asarray(prompt)
            if arr.ndim != 1:
                raise GenerationInputError(f"token ids must be one sequence, got shape {arr.shape}")
            if arr.size and arr.dtype.kind not in "iu":
                raise GenerationInputError(f"token ids must be integers, got dtype {arr.dtype}")
            ids = [int(t) for t in arr]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise GenerationInputError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise GenerationInputError("the prompt is empty (no tokens)")
        if len(ids) >= self.max_length:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens but the context is {self.max_length}; "
                "shorten the prompt (at least one position must remain for generation)"
                + (f" or raise max_context (the bundle allows {self.bundle.max_context})"
                   if self.max_length < self.bundle.max_context else ""))
        return ids

    def _drafter(self, drafter: str | None) -> Drafter | None:
        if drafter is None or drafter == "none":
            return None
        if drafter == "model":
            if self.draft_engine is None:
                raise GenerationInputError("this bundle has no draft model; use drafter='prompt_lookup' or None")
            return ModelDrafter(self.draft_engine, self.vocab_size, self.draft_context)
        if drafter == "prompt_lookup":
            return PromptLookupDrafter()
        if drafter == "hybrid":
            if self.draft_engine is None:
                raise GenerationInputError("drafter='hybrid' mixes prompt lookup with the draft model, and this "
                                           "bundle has no draft model; use drafter='prompt_lookup'")
            return HybridDrafter(ModelDrafter(self.draft_engine, self.vocab_size, self.draft_context))
        raise GenerationInputError(f"unknown drafter '{drafter}'; choose one of {DRAFTERS} or None")

    def _row_config(self, max_new_tokens: int, temperature: float | None, top_k: int | None,
                    top_p: float | None, do_sample: bool | None, ignore_eos: bool) -> LoopConfig:
        """One sequence's limits and sampling, validated, bundle defaults applied."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise GenerationInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        temperature, top_k, top_p = self.generation_defaults.resolve(temperature, top_k, top_p, do_sample)
        SamplingParams(temperature, top_k, top_p)  # validates before converting
        params = SamplingParams(float(temperature), int(top_k), float(top_p))
        return LoopConfig(max_new_tokens=int(max_new_tokens), params=params,
                          eos_token_ids=self.eos_token_ids, ignore_eos=bool(ignore_eos))

    def _overlap(self, overlap: bool | None, speculation: str) -> VerifyThread | None:
        """The verify thread for an overlapped generation (``None``: the generator's default)."""
        if overlap is None:  # the generator's default applies to chains (trees are not overlapped)
            overlap = self.overlap and speculation == "chain"
        if not isinstance(overlap, (bool, np.bool_)):
            raise GenerationInputError(f"overlap must be True, False or None, got {overlap!r}")
        if not overlap:
            return None
        if speculation != "chain":
            raise GenerationInputError("overlap=True drafts ahead of a chain; it does not apply to "
                                       "speculation='tree'")
        if self._verify_thread is None:
            self._verify_thread = VerifyThread()
        return self._verify_thread

    def _speculation(self, num_draft_tokens: int | str, drafter: str | None, speculation: str,
                     width: int = 1, overlap: bool = False) -> tuple[int, object, Drafter | None]:
        """(fixed K, adaptive policy or None, drafter) for a generation of ``width`` sequences."""
        policy = None
        k = 0
        if drafter == "hybrid" and overlap:
            raise GenerationInputError("drafter='hybrid' does not draft ahead: use overlap=False with it")
        if num_draft_tokens == "auto" and speculation == "chain" and drafter == "hybrid":
            from specdec_rt.runtime.policy import make_policy

            policy = HybridPolicy(make_policy(self, "prompt_lookup", width, scope="hybrid:"),
                                  make_policy(self, "model", width, scope="hybrid:"))
        elif num_draft_tokens == "auto" and speculation == "chain":
            from specdec_rt.runtime.policy import make_policy

            policy = make_policy(self, drafter, width, overlap)
        elif num_draft_tokens != "auto":
            if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)) \
                    or not 0 <= num_draft_tokens <= 64:
                raise GenerationInputError(f"num_draft_tokens must be 0..64 or 'auto', got {num_draft_tokens!r}")
            k = int(num_draft_tokens)
        d = self._drafter(drafter)
        if isinstance(d, HybridDrafter):
            d.policy = policy
        if policy is not None and isinstance(d, ModelDrafter) and policy.use_confidence_stop:
            d.confidence_floor = policy.confidence_floor()
        return k, policy, d

    def _loop(self, prompt_ids: list[int], max_new_tokens: int, temperature: float | None,
              top_k: int | None, top_p: float | None, seed: int | None, num_draft_tokens: int | str,
              drafter: str | None, speculation: str, do_sample: bool | None, ignore_eos: bool,
              stats: GenerationStats, tree_shape=None, overlap: bool | None = None) -> Iterator[list[int]]:
        cfg = self._row_config(max_new_tokens, temperature, top_k, top_p, do_sample, ignore_eos)
        verify_thread = self._overlap(overlap, speculation)
        cfg.num_draft_tokens, cfg.policy, d = self._speculation(num_draft_tokens, drafter, speculation,
                                                                overlap=verify_thread is not None)
        stats.overlap = verify_thread is not None and d is not None
        stats.prompt_tokens = len(prompt_ids)
        stats.drafter = None if d is None else d.name
        stats.speculation = speculation
        stats.num_draft_tokens = num_draft_tokens
        rng = np.random.default_rng(seed)
        if speculation == "chain":
            inner = run_chain(self.target, d, prompt_ids, cfg, rng, stats, verify_thread)
        elif speculation == "tree":
            from specdec_rt.runtime.tree import FixedTemplate, Template, TreeShape, run_tree

            if not isinstance(d, ModelDrafter):
                raise GenerationInputError("speculation='tree' needs drafter='model'")
            if not self.exact_trees:
                raise GenerationInputError(
                    "this bundle's target sums attention in float32 (exported with --portable, "
                    "--target-attention native or fused, or by an older specdec-rt), so tree verification would not be token-identical to "
                    "target-only decoding; use speculation='chain' or re-export with --target-attention fp64")
            if isinstance(tree_shape, Template):
                inner = run_tree(self.target, d, prompt_ids, cfg, rng, stats, policy=FixedTemplate(tree_shape))
            elif num_draft_tokens == "auto" and tree_shape is None:
                # the shape policy: budget, depth and width per step from the cost model and
                # the running acceptance estimates (a chain where branches do not pay)
                from specdec_rt.runtime.policy import make_tree_policy

                inner = run_tree(self.target, d, prompt_ids, cfg, rng, stats, policy=make_tree_policy(self))
            else:
                budget = 15 if num_draft_tokens == "auto" else max(1, int(num_draft_tokens))
                shape = tree_shape or TreeShape.for_budget(budget)
                inner = run_tree(self.target, d, prompt_ids, cfg, rng, stats, shape)
        else:
            raise GenerationInputError(f"speculation must be 'chain' or 'tree', not {speculation!r}")
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
               num_draft_tokens: int | str = "auto", drafter: str | None = "model",
               speculation: str = "chain", stop: Sequence[str] | str | None = None,
               do_sample: bool | None = None, ignore_eos: bool = False,
               result: GenerationResult | None = None, tree_shape=None,
               every_step: bool = False, overlap: bool | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are committed. Pass ``result`` to collect ids and stats.

        ``every_step=True`` also yields ``""`` for a step whose tokens add no visible text yet (a
        partial UTF-8 character, text held back while it may start a stop string), so a consumer
        sees every target call and can stop between any two of them (the server cancels a
        disconnected client's generation this way).

        ``temperature`` / ``top_k`` / ``top_p`` / ``do_sample`` left as ``None`` take the bundle's
        defaults (:attr:`generation_defaults`, from its ``generation_config.json``; greedy when it
        has none). Explicit values win; ``temperature=0`` or ``do_sample=False`` is greedy.

        ``overlap``: draft the next block while the target verifies this one (a worker thread;
        :mod:`specdec_rt.runtime.overlap`); ``None`` takes the generator's default
        (``load(..., overlap=...)``, which also sets the thread pools up for it). Output is the
        same as without (greedy: token for token; sampled: the same distribution).
        """
        prompt_ids = self._prompt_ids(prompt)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        stats = GenerationStats()
        res = result if result is not None else GenerationResult("", [], stats)
        res.stats, res.prompt_token_ids, res.token_ids, res.text = stats, prompt_ids, [], ""
        text = TextAssembler(self.tokenizer, stops, () if ignore_eos else self.eos_token_ids)
        for new in self._loop(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                              num_draft_tokens, drafter, speculation, do_sample, ignore_eos, stats,
                              tree_shape, overlap):
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
        res.finish_reason = self._finish_reason(text, len(prompt_ids), len(res.token_ids), max_new_tokens)

    def _finish_reason(self, text: TextAssembler, prompt_len: int, generated: int, max_new_tokens: int) -> str:
        if text.finish == "length" and prompt_len + generated >= self.max_length and generated < max_new_tokens:
            return "context"
        return text.finish

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 num_draft_tokens: int | str = "auto", drafter: str | None = "model",
                 speculation: str = "chain", stop: Sequence[str] | str | None = None,
                 do_sample: bool | None = None, ignore_eos: bool = False,
                 tree_shape=None, overlap: bool | None = None) -> GenerationResult:
        """Generate a completion of a plain prompt (text or token ids).

        Sampling arguments left as ``None`` take the bundle's defaults (greedy unless its
        ``generation_config.json`` sets ``do_sample``); ``temperature=0`` forces greedy. With
        ``speculation="tree"``, ``num_draft_tokens`` is the tree's node budget (default shape from
        :meth:`TreeShape.for_budget`; pass ``tree_shape`` to override it); ``"auto"`` lets
        :class:`~specdec_rt.runtime.policy.TreePolicy` choose the shape per step (a chain where
        side branches do not pay). ``overlap``: see :meth:`stream`.
        """
        result = GenerationResult("", [], GenerationStats())
        for _ in self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, num_draft_tokens,
                             drafter, speculation, stop, do_sample, ignore_eos, result=result,
                             tree_shape=tree_shape, overlap=overlap):
            pass
        result.text = self.tokenizer.decode(result.token_ids) if not stop else result.text
        return result

    def generate_ids(self, prompt_ids: Sequence[int], **kwargs) -> list[int]:
        """Token ids only, skipping detokenization (benchmarks, exactness tests)."""
        stats = GenerationStats()
        out: list[int] = []
        args = dict(max_new_tokens=128, temperature=None, top_k=None, top_p=None, seed=None,
                    num_draft_tokens="auto", drafter="model", speculation="chain", do_sample=None,
                    ignore_eos=False, tree_shape=None, overlap=None)
        unknown = sorted(set(kwargs) - set(args))
        if unknown:
            raise TypeError(f"generate_ids() got unexpected keyword argument(s): {', '.join(unknown)}")
        args.update(kwargs)
        for new in self._loop(self._prompt_ids(prompt_ids), args["max_new_tokens"], args["temperature"],
                              args["top_k"], args["top_p"], args["seed"], args["num_draft_tokens"],
                              args["drafter"], args["speculation"], args["do_sample"], args["ignore_eos"], stats,
                              args["tree_shape"], args["overlap"]):
            out.extend(new)
        self.last_stats = stats
        return out

    # -- batches ------------------------------------------------------------------------------
    def stream_batch(self, prompts: Sequence, max_new_tokens: int = 128, *, batch_size: int | None = None,
                     temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                     seed: int | None = None, num_draft_tokens: int | str = "auto", drafter: str | None = "model",
                     stop: Sequence[str] | str | None = None, do_sample: bool | None = None,
                     ignore_eos: bool = False, overlap: bool | None = None) -> BatchStream:
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
        verify_thread = self._overlap(overlap, "chain")
        k, policy, d = self._speculation(num_draft_tokens, drafter, "chain", width, verify_thread is not None)
        defaults = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, stop=stop, do_sample=do_sample, ignore_eos=ignore_eos)
        rows: list[Row | None] = []
        results: list[GenerationResult] = []
        texts: list[TextAssembler | None] = []
        for i, item in enumerate(prompts):
            stats = GenerationStats(drafter=None if d is None else d.name, speculation="chain",
                                    num_draft_tokens=num_draft_tokens,
                                    overlap=verify_thread is not None and d is not None)
            res = GenerationResult("", [], stats)
            results.append(res)
            try:
                opts = dict(defaults)
                if isinstance(item, dict):
                    unknown = sorted(set(item) - {"prompt", *defaults})
                    if unknown or "prompt" not in item:
                        raise GenerationInputError(
                            f"a prompt dict needs 'prompt' and may set {', '.join(defaults)}"
                            + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
                    opts.update((key, v) for key, v in item.items() if key != "prompt")
                    item = item["prompt"]
                ids = self._prompt_ids(item)
                cfg = self._row_config(opts["max_new_tokens"], opts["temperature"], opts["top_k"],
                                       opts["top_p"], opts["do_sample"], opts["ignore_eos"])
            except (GenerationInputError, ContextOverflowError, SamplingParamsError) as exc:
                res.error, res.finish_reason = f"{type(exc).__name__}: {exc}", "error"
                rows.append(None)
                texts.append(None)
                continue
            stats.prompt_tokens = len(ids)
            res.prompt_token_ids = ids
            cfg.num_draft_tokens = k
            rows.append(Row(ids, cfg, np.random.default_rng(opts["seed"]), stats, index=i))
            stops = opts["stop"]
            stops = [stops] if isinstance(stops, str) else list(stops or [])
            texts.append(TextAssembler(self.tokenizer, stops, () if cfg.ignore_eos else self.eos_token_ids))
        return BatchStream(self, rows, results, texts, width, k, policy, d, verify_thread)

    def generate_batch(self, prompts: Sequence, max_new_tokens: int = 128, *, batch_size: int | None = None,
                       temperature: float | None = None, top_k: int | None = None,
                       top_p: float | None = None, seed: int | None = None,
                       num_draft_tokens: int | str = "auto", drafter: str | None = "model",
                       stop: Sequence[str] | str | None = None, do_sample: bool | None = None,
                       ignore_eos: bool = False, overlap: bool | None = None) -> list[GenerationResult]:
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
        ``do_sample`` or ``ignore_eos`` for that row. A row whose input is bad (empty, too long
        for the context, bad sampling values) gets ``finish_reason="error"`` and the message in
        ``error``; the others run. ``last_batch_stats`` holds the batch's totals. ``overlap``:
        the draft looks ahead for every row while the target verifies (see :meth:`stream`).
        """
        run = self.stream_batch(prompts, max_new_tokens, batch_size=batch_size, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed, num_draft_tokens=num_draft_tokens,
                                drafter=drafter, stop=stop, do_sample=do_sample, ignore_eos=ignore_eos,
                                overlap=overlap)
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


class BatchStream:
    """A running batch (:meth:`Generator.stream_batch`). Iterating yields ``(index, text piece)``
    as rows commit tokens; ``results[index]`` fills in meanwhile (final once the row is done);
    ``cancel(index)`` ends one row (``finish_reason="cancelled"``) without changing any other
    row's tokens; ``stats`` holds the batch's totals."""

    def __init__(self, gen: Generator, rows: list[Row | None], results: list[GenerationResult],
                 texts: list[TextAssembler | None], width: int, k: int, policy, drafter: Drafter | None,
                 verify_thread: VerifyThread | None = None) -> None:
        self.gen = gen
        self.rows = rows
        self.results = results
        self.texts = texts
        self.stats = BatchStats(prompts=len(rows), max_rows=width)
        self.stats.errors = sum(r is None for r in rows)
        self._closed = [r is None for r in rows]
        self._verify_thread = verify_thread
        self._events = self._run(width, k, policy, drafter)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[int, str]:
        return next(self._events)

    def cancel(self, index: int) -> None:
        """End row ``index`` now (its text so far stays); a row not started yet never starts."""
        row = self.rows[index]
        if row is None or self._closed[index]:
            return
        row.finished = "cancelled"
        self._close(row)

    def _close(self, row: Row) -> str:
        """Final text and finish reason of a row that finished; returns text still to emit."""
        if self._closed[row.index]:
            return ""
        self._closed[row.index] = True
        res, text = self.results[row.index], self.texts[row.index]
        if row.error is not None:
            res.error, res.finish_reason = f"{type(row.error).__name__}: {row.error}", "error"
            self.stats.errors += 1
            return ""
        tail = "" if text.stopped else text.close()
        res.text += tail
        if row.finished == "cancelled":
            res.finish_reason = "cancelled"
        else:
            res.finish_reason = self.gen._finish_reason(text, len(row.prompt), len(res.token_ids),
                                                        row.cfg.max_new_tokens)
        row.stats.peak_rss_bytes = peak_rss_bytes()
        return tail

    def _run(self, width: int, k: int, policy, drafter: Drafter | None) -> Iterator[tuple[int, str]]:
        gen, stats = self.gen, self.stats
        t0 = time.perf_counter()
        reset_peak_rss()
        queue = (r for r in self.rows if r is not None and not r.finished)
        try:
            for row, new in run_batch(gen.target, drafter, queue, width, k, policy, stats, self._verify_thread):
                i = row.index
                if self._closed[i]:
                    continue
                self.results[i].token_ids.extend(new)
                stats.new_tokens += len(new)
                text = self.texts[i]
                piece = text.push(new) if new else ""
                if piece:
                    self.results[i].text += piece
                    yield i, piece
                if text.stopped and not row.finished:
                    row.finished = "stop"
                if row.finished:
                    tail = self._close(row)
                    if tail:
                        yield i, tail
        finally:
            stats.time_total = time.perf_counter() - t0
            stats.peak_rss_bytes = peak_rss_bytes()
            gen.last_batch_stats = stats


def load(bundle: str | os.PathLike, provider: str = "cpu", draft_provider: str | None = None,
         threads: int | None = None, max_length: int | None = None,
         verify_checksums: bool = True, io_binding: bool | None = None,
         draft_threads: int | None = 1, shared_thread_pool: bool = False,
         probe_rows: bool = True, max_context: int | None = None,
         max_batch: int | None = None, overlap: bool = False,
         draft_context: int | None = DRAFT_CONTEXT) -> Generator:
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
    target-only decoding (:func:`specdec_rt.runtime.engine.probe_row_invariance`), and whether a
    sequence's logits are the same in a batched call as alone (if not, batches run one sequence
    per call: :func:`specdec_rt.runtime.engine.probe_batch_invariance`).
    ``max_batch``: sequences :meth:`Generator.generate_batch` may run at once (default 8 on the
    CPU provider, 1 on GPU providers, where batched calls are not implemented yet).
    ``overlap``: the default of every generation's ``overlap`` (draft the next block while the
    target verifies this one, on a worker thread); it also gives the target its own thread pool
    whose workers do not spin (a spinning worker takes the core the draft needs), and so should
    not be combined with ``shared_thread_pool``.
    ``draft_context``: the most tokens the draft model runs to catch up before proposing (default
    64; None: all of them). A longer gap (a long prompt) restarts the draft on its last
    ``draft_context`` tokens, and a re-entry after a stretch decoded without drafting on its last
    32 (``RESYNC_CONTEXT``, at most ``draft_context``): proposals see a shorter history, the
    output is unchanged, and the draft's prefill of a long prompt no longer costs more than
    what speculation saves on the answer.
    """
    b = load_bundle(bundle, verify_checksums=verify_checksums)
    return Generator(b, provider=provider, draft_provider=draft_provider, threads=threads,
                     max_length=max_length, io_binding=io_binding, draft_threads=draft_threads,
                     shared_thread_pool=shared_thread_pool, probe_rows=probe_rows,
                     max_context=max_context, max_batch=max_batch, overlap=overlap,
                     draft_context=draft_context)


__all__ = ["load", "Generator", "GenerationResult", "GenerationStats", "BatchStats", "BatchStream",
           "BundleError"]
