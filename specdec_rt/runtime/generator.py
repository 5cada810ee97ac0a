"""The public Python API: ``load(bundle)`` -> :class:`Generator` with ``generate``, ``stream``,
``chat`` and ``chat_stream``."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from specdec_rt.errors import ChatTemplateError, GenerationInputError  # noqa: F401 - re-exported here
from specdec_rt.runtime.bundle import Bundle, BundleError, load_bundle
from specdec_rt.runtime.chat import NO_TEMPLATE, ChatTemplate
from specdec_rt.runtime.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from specdec_rt.runtime.engine import ContextOverflowError, make_engine, probe_row_invariance
from specdec_rt.runtime.gen_config import GenerationDefaults
from specdec_rt.runtime.memory import peak_rss_bytes, reset_peak_rss
from specdec_rt.runtime.sampling import SamplingParams, SamplingParamsError
from specdec_rt.runtime.speculative import LoopConfig, run_chain
from specdec_rt.runtime.stats import GenerationStats
from specdec_rt.runtime.tokenizer import IncrementalDecoder, TextTokenizer

DRAFTERS = ("model", "prompt_lookup")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = "length"  # "length" | "eos" | "stop" | "context"
    prompt_token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


DEFAULT_CONTEXT = 4096


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
                 max_context: int | None = None) -> None:
        self.bundle = bundle
        self.max_length = resolve_context(bundle.max_context, max_context or max_length)
        self.tokenizer = TextTokenizer(bundle.tokenizer_path)
        self.target = make_engine(bundle.graph_path("target"), bundle.target, self.max_length, provider,
                                threads, bundle.root, io_binding, shared_thread_pool)
        self.draft_engine = None
        if bundle.draft is not None:
            self.draft_engine = make_engine(bundle.graph_path("draft"), bundle.draft, self.max_length,
                                          draft_provider or provider, draft_threads or threads,
                                          bundle.root, io_binding, shared_thread_pool)
        self.vocab_size = bundle.target.vocab_size
        self.eos_token_ids = tuple(bundle.eos_token_ids)
        if probe_rows and hasattr(self.target, "min_rows"):
            probe_row_invariance(self.target)  # exactness: pads 1-row calls where kernels differ
        self.chat_template = (ChatTemplate(bundle.chat_template, bundle.special_token_strings)
                              if bundle.chat_template is not None else None)
        self.generation_defaults = GenerationDefaults.from_config(bundle.generation_config)
        if self.generation_defaults.ignored:
            warnings.warn(
                f"{bundle.root}: generation_config.json sets {', '.join(self.generation_defaults.ignored)}, "
                "which specdec-rt does not apply (it applies temperature, top_k, top_p, do_sample and "
                "the EOS ids)", stacklevel=3)

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
            return ModelDrafter(self.draft_engine, self.vocab_size)
        if drafter == "prompt_lookup":
            return PromptLookupDrafter()
        raise GenerationInputError(f"unknown drafter '{drafter}'; choose one of {DRAFTERS} or None")

    def _loop(self, prompt_ids: list[int], max_new_tokens: int, temperature: float | None,
              top_k: int | None, top_p: float | None, seed: int | None, num_draft_tokens: int | str,
              drafter: str | None, speculation: str, do_sample: bool | None, ignore_eos: bool,
              stats: GenerationStats, tree_shape=None) -> Iterator[list[int]]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise GenerationInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        temperature, top_k, top_p = self.generation_defaults.resolve(temperature, top_k, top_p, do_sample)
        SamplingParams(temperature, top_k, top_p)  # validates before converting
        params = SamplingParams(float(temperature), int(top_k), float(top_p))
        policy = None
        if num_draft_tokens == "auto" and speculation == "chain":
            from specdec_rt.runtime.policy import make_policy

            policy = make_policy(self, drafter)
            k = 0
        elif num_draft_tokens != "auto":
            if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)) \
                    or not 0 <= num_draft_tokens <= 64:
                raise GenerationInputError(f"num_draft_tokens must be 0..64 or 'auto', got {num_draft_tokens!r}")
            k = int(num_draft_tokens)
        else:
            k = 0
        d = self._drafter(drafter)
        if policy is not None and isinstance(d, ModelDrafter) and policy.use_confidence_stop:
            d.confidence_floor = policy.confidence_floor()
        stats.prompt_tokens = len(prompt_ids)
        stats.drafter = None if d is None else d.name
        stats.speculation = speculation
        stats.num_draft_tokens = num_draft_tokens
        rng = np.random.default_rng(seed)
        cfg = LoopConfig(max_new_tokens=int(max_new_tokens), params=params, num_draft_tokens=k,
                         eos_token_ids=self.eos_token_ids, ignore_eos=ignore_eos, policy=policy)
        if speculation == "chain":
            inner = run_chain(self.target, d, prompt_ids, cfg, rng, stats)
        elif speculation == "tree":
            from specdec_rt.runtime.tree import TreeShape, run_tree

            if not isinstance(d, ModelDrafter):
                raise GenerationInputError("speculation='tree' needs drafter='model'")
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
               num_draft_tokens: int | str = 4, drafter: str | None = "model",
               speculation: str = "chain", stop: Sequence[str] | str | None = None,
               do_sample: bool | None = None, ignore_eos: bool = False,
               result: GenerationResult | None = None, tree_shape=None,
               every_step: bool = False) -> Iterator[str]:
        """Yield text pieces as tokens are committed. Pass ``result`` to collect ids and stats.

        ``every_step=True`` also yields ``""`` for a step whose tokens add no visible text yet (a
        partial UTF-8 character, text held back while it may start a stop string), so a consumer
        sees every target call and can stop between any two of them (the server cancels a
        disconnected client's generation this way).

        ``temperature`` / ``top_k`` / ``top_p`` / ``do_sample`` left as ``None`` take the bundle's
        defaults (:attr:`generation_defaults`, from its ``generation_config.json``; greedy when it
        has none). Explicit values win; ``temperature=0`` or ``do_sample=False`` is greedy.
        """
        prompt_ids = self._prompt_ids(prompt)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        stats = GenerationStats()
        res = result if result is not None else GenerationResult("", [], stats)
        res.stats, res.prompt_token_ids, res.token_ids, res.text = stats, prompt_ids, [], ""
        decoder = IncrementalDecoder(self.tokenizer)
        held = ""  # text withheld because it may be the start of a stop string
        finish = "length"
        for new in self._loop(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                              num_draft_tokens, drafter, speculation, do_sample, ignore_eos, stats,
                              tree_shape):
            res.token_ids.extend(new)
            piece = decoder.push(new)
            if new and new[-1] in self.eos_token_ids and not ignore_eos:
                finish = "eos"
            if stops:
                held += piece
                cut = min((held.find(s) for s in stops if s in held), default=-1)
                if cut >= 0:
                    res.text += held[:cut]
                    if held[:cut]:
                        yield held[:cut]
                    finish = "stop"
                    break
                keep = max(len(s) for s in stops) - 1  # a stop string may still be completing
                split = max(0, len(held) - keep)
                piece, held = held[:split], held[split:]
            if piece or every_step:
                res.text += piece
                yield piece
        else:
            tail = decoder.flush()
            if stops:
                held += tail
                cut = min((held.find(s) for s in stops if s in held), default=-1)
                if cut >= 0:
                    held, finish = held[:cut], "stop"
            elif tail:
                res.text += tail
                yield tail
            if held:
                res.text += held
                yield held
            if finish == "length" and len(prompt_ids) + len(res.token_ids) >= self.max_length \
                    and len(res.token_ids) < max_new_tokens:
                finish = "context"
        res.finish_reason = finish

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 num_draft_tokens: int | str = 4, drafter: str | None = "model",
                 speculation: str = "chain", stop: Sequence[str] | str | None = None,
                 do_sample: bool | None = None, ignore_eos: bool = False,
                 tree_shape=None) -> GenerationResult:
        """Generate a completion of a plain prompt (text or token ids).

        Sampling arguments left as ``None`` take the bundle's defaults (greedy unless its
        ``generation_config.json`` sets ``do_sample``); ``temperature=0`` forces greedy. With
        ``speculation="tree"``, ``num_draft_tokens`` is the tree's node budget (default shape from
        :meth:`TreeShape.for_budget`; pass ``tree_shape`` to override it).
        """
        result = GenerationResult("", [], GenerationStats())
        for _ in self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, num_draft_tokens,
                             drafter, speculation, stop, do_sample, ignore_eos, result=result,
                             tree_shape=tree_shape):
            pass
        result.text = self.tokenizer.decode(result.token_ids) if not stop else result.text
        return result

    def generate_ids(self, prompt_ids: Sequence[int], **kwargs) -> list[int]:
        """Token ids only, skipping detokenization (benchmarks, exactness tests)."""
        stats = GenerationStats()
        out: list[int] = []
        args = dict(max_new_tokens=128, temperature=None, top_k=None, top_p=None, seed=None,
                    num_draft_tokens=4, drafter="model", speculation="chain", do_sample=None,
                    ignore_eos=False, tree_shape=None)
        unknown = sorted(set(kwargs) - set(args))
        if unknown:
            raise TypeError(f"generate_ids() got unexpected keyword argument(s): {', '.join(unknown)}")
        args.update(kwargs)
        for new in self._loop(self._prompt_ids(prompt_ids), args["max_new_tokens"], args["temperature"],
                              args["top_k"], args["top_p"], args["seed"], args["num_draft_tokens"],
                              args["drafter"], args["speculation"], args["do_sample"], args["ignore_eos"], stats,
                              args["tree_shape"]):
            out.extend(new)
        self.last_stats = stats
        return out

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
         probe_rows: bool = True, max_context: int | None = None) -> Generator:
    """Load a bundle. ``provider``: "cpu" | "cuda" | "tensorrt"; the draft may use another one.

    ``io_binding``: bind the KV buffers by pointer (default on GPUs; on CPU the default feeds
    zero-copy views, measured faster for small models). ``max_context``: positions (prompt plus
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
    target-only decoding (:func:`specdec_rt.runtime.engine.probe_row_invariance`).
    """
    b = load_bundle(bundle, verify_checksums=verify_checksums)
    return Generator(b, provider=provider, draft_provider=draft_provider, threads=threads,
                     max_length=max_length, io_binding=io_binding, draft_threads=draft_threads,
                     shared_thread_pool=shared_thread_pool, probe_rows=probe_rows,
                     max_context=max_context)


__all__ = ["load", "Generator", "GenerationResult", "GenerationStats", "BundleError"]
