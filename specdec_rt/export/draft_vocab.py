"""A draft that proposes from part of the vocabulary: its LM head cut to the tokens that matter.

A 0.5B draft of a 152k-token family spends a quarter of each call in its LM head (136M of its
494M parameters; measured 24% of a Qwen2.5-Coder-0.5B int4 draft call). Proposals only need the
tokens a target is likely to emit, so the draft's LM head keeps ``n`` of them, as EAGLE-3's
reduced draft vocabulary (its ``d2t`` map) does. Verification still runs over the target's full
vocabulary: a token outside the kept set is never proposed but is still emitted by the target
(as its correction or bonus token), so greedy output stays the target's and sampled output its
distribution (the draft's q is simply zero outside the set).

Which tokens: byte-level BPE numbers its tokens in merge order, and earlier merges are the more
frequent pairs of the tokenizer's training corpus, so the ``n`` lowest ids are a data-free
frequency ranking; every added / special token (chat markers, EOS) is kept on top of them.
"""
from __future__ import annotations

import numpy as np

from specdec_rt.errors import ExportError

MIN_DRAFT_VOCAB = 8  # a sanity floor: useful cuts keep thousands (16k-64k of a 152k vocabulary)
OUTPUT_IDS_FILE = "output_ids.npy"


def draft_vocab_ids(tokenizer, vocab_size: int, n: int, eos_ids: list[int] | None = None) -> np.ndarray:
    """Sorted int64 ids: the ``n`` lowest base-vocabulary ids plus every added token and EOS id."""
    if n < MIN_DRAFT_VOCAB:
        raise ExportError(f"--draft-vocab must be at least {MIN_DRAFT_VOCAB}, not {n}")
    added = [int(i) for i in tokenizer.get_added_tokens_decoder()] if hasattr(tokenizer, "get_added_tokens_decoder") else []
    keep = set(range(min(n, vocab_size))) | {i for i in added if 0 <= i < vocab_size}
    keep |= {int(i) for i in (eos_ids or []) if 0 <= int(i) < vocab_size}
    return np.array(sorted(keep), dtype=np.int64)


def prune_lm_head(weights, ids: np.ndarray) -> None:
    """Cut ``weights``' LM head (and bias) to the columns ``ids``, in place; the embedding table
    stays whole (the draft still reads every token the target emits) and is no longer tied."""
    from specdec_rt.export.arch import VocabMatrix

    lm = weights.lm_head
    if isinstance(lm, VocabMatrix):  # the [V, hidden] Linear weight
        import torch

        weights.lm_head = VocabMatrix(lm.weight[torch.as_tensor(ids)])
    else:  # [hidden, V] MatMul layout
        weights.lm_head = np.ascontiguousarray(lm[:, ids])
    if weights.lm_head_b is not None:
        weights.lm_head_b = weights.lm_head_b[ids]
    if weights.tied:
        weights.tied = False
