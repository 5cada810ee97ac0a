"""The sizes a Generator preallocates (context, batch rows) and the checks a prompt passes
before it reaches an engine: every bad value is a clear error here, not a failure deep inside
ONNX Runtime."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec_rt.errors import ContextOverflowError, GenerationInputError
from specdec_rt.runtime.core.tokenizer import TextTokenizer

DEFAULT_CONTEXT = 4096


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


def check_threads(**values: int | None) -> None:
    """Intra-op thread counts: None (the default) or a positive integer; ONNX Runtime would take
    0 or a negative count as its own default silently."""
    for name, n in values.items():
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
            raise GenerationInputError(f"{name} must be an integer >= 1 or None (the default), got {n!r}")


def resolve_draft_context(requested: int | None) -> int | None:
    """The most tokens the draft catches up before proposing (None: all; see DRAFT_CONTEXT)."""
    if requested is None:
        return None
    if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)) or requested < 1:
        raise GenerationInputError(f"draft_context must be a positive number of tokens or None, got {requested!r}")
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


def prompt_token_ids(prompt: str | Sequence[int] | np.ndarray, tokenizer: TextTokenizer, vocab_size: int,
                     context: int, bundle_context: int) -> list[int]:
    """The prompt's token ids as a generation runs them: text is encoded, ids are checked against
    the vocabulary, and the prompt must leave at least one position of the ``context``."""
    if isinstance(prompt, str):
        if not prompt:
            raise GenerationInputError("the prompt is empty")
        ids = tokenizer.encode(prompt)
    else:
        arr = np.asarray(prompt)
        if arr.ndim != 1:
            raise GenerationInputError(f"token ids must be one sequence, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise GenerationInputError(f"token ids must be integers, got dtype {arr.dtype}")
        ids = [int(t) for t in arr]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise GenerationInputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if not ids:
        raise GenerationInputError("the prompt is empty (no tokens)")
    if len(ids) >= context:
        raise ContextOverflowError(
            f"the prompt has {len(ids)} tokens but the context is {context}; "
            "shorten the prompt (at least one position must remain for generation)"
            + (f" or raise max_context (the bundle allows {bundle_context})" if context < bundle_context else ""))
    return ids
