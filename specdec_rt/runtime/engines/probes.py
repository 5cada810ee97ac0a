"""Load-time checks that speculation stays exact on the machine that runs the model.

Greedy speculative decoding equals target-only decoding only if the target computes a token's
logits bit for bit the same whatever else shares its call: a call's row count (one-row kernels)
and, for batched decoding, the other sequences in it. Kernels differ per CPU/GPU, so these
probes measure it once per engine at load and set the engine's switches (``min_rows``,
``batch_calls``); they drive the engine only through its public API, which is why they live
apart from :mod:`specdec_rt.runtime.engines.ort` (and import nothing from it).
"""
from __future__ import annotations

import numpy as np

from specdec_rt.runtime.core.masks import causal_mask
from specdec_rt.runtime.engines.base import PREFILL_CHUNK, EngineBase


class RowInvarianceWarning(RuntimeWarning):
    """The target's logits for a token depend on how many rows its call had."""


def probe_row_invariance(engine: EngineBase, widths: tuple[int, ...] = (2, 3, 5, 8, 16, 33),
                         seed: int = 0) -> int:
    """Measure from how many rows on a call's row results stop depending on the row count, and
    pad smaller calls to that (``engine.min_rows``). Returns the row count chosen.

    Greedy speculation is token-for-token target-only decoding only if the target computes a
    token's logits bit for bit the same alone (S = 1) as inside a verify call (S > 1). Kernels
    are free to pick another code path per row count: ONNX Runtime's MatMulNBits (int4 weights)
    runs a separate kernel for a single row whose results differ in the last bits from the
    multi-row kernel (measured on x86 AVX2), and int8 activation quantization turns such bits
    into flipped argmaxes. Which kernels differ depends on the CPU/GPU, so it is measured here,
    on the machine that runs the model, not assumed at export.
    """
    rng = np.random.default_rng(seed)
    prefix = 3
    usable = [w for w in widths if prefix + w <= engine.max_len]
    if not usable:
        return engine.min_rows
    tokens = rng.integers(0, engine.vocab_size, prefix + max(usable))
    sliding = engine.info.sliding_window
    saved = engine.min_rows
    engine.min_rows = 1
    try:
        engine.reset()
        engine.extend(tokens[:prefix])
        rows = {}
        for s in (1, *usable):
            pos = np.arange(prefix, prefix + s, dtype=np.int64)
            rows[s] = engine.forward(tokens[prefix:prefix + s], pos, causal_mask(prefix, pos, sliding))[0].copy()
    finally:
        engine.reset()
        engine.min_rows = saved
    multi = [rows[s] for s in usable]
    multi_agree = all(np.array_equal(multi[0], r) for r in multi[1:])
    if multi_agree and np.array_equal(rows[1], multi[0]):
        chosen = 1
    elif multi_agree:
        chosen = 2
    else:
        _warn_rows(engine, f"widths {usable} disagree on the first row")
        chosen = 1
    if multi_agree:
        drift = _chain_position_drift(engine, tokens, prefix, min(max(usable), CHAIN_PROBE_ROWS), chosen, sliding)
        if drift is not None:
            _warn_rows(engine, f"row {drift} of a verify call differs from decoding that token alone "
                               "(the kernel's result depends on a row's position in the call)")
    engine.min_rows = chosen
    return chosen


CHAIN_PROBE_ROWS = 5  # a K = 4 verify call: the rows speculation commits most


def _chain_position_drift(engine: EngineBase, tokens: np.ndarray, prefix: int, width: int, min_rows: int,
                          sliding) -> int | None:
    """The first row of a ``width``-row chain call whose logits differ from decoding its token
    one call at a time (padded to ``min_rows``), or None. The first-row check above cannot see
    a kernel whose result depends on the row's position in the call (MatMulNBits at some block
    sizes on some CPUs): that would break exactness with every row count alike."""
    saved = engine.min_rows
    engine.min_rows = min_rows
    try:
        engine.reset()
        engine.extend(tokens[:prefix])
        pos = np.arange(prefix, prefix + width, dtype=np.int64)
        chain = engine.forward(tokens[prefix:prefix + width], pos, causal_mask(prefix, pos, sliding)).copy()
        for r in range(width):  # decoding: one token per call, each committed
            if not np.array_equal(engine.step(int(tokens[prefix + r])), chain[r]):
                return r
        return None
    finally:
        engine.reset()
        engine.min_rows = saved


# the call sizes decoding makes after a prompt: a plain step (padded to min_rows), verify blocks
DECODING_CALLS = (1, 5, 2, 3, 5, 1, 4)


def probe_prefix_reuse(engine: EngineBase, seed: int = 0) -> bool:
    """Measure whether the K/V a prompt's prefill writes equal, bit for bit, what decoding the
    same tokens writes (plain steps and verify blocks), at every layer; sets and returns
    ``engine.prefix_reuse``.

    A conversation's next turn may then keep the K/V its sequence holds for the turns before
    (computed while they were decoded) instead of prefilling them again: its logits, and so its
    output, are those of a fresh prefill. Prefills run in chunks of ``PREFILL_CHUNK`` rows, a
    width the row probe above does not reach, so this compares one such call with decoding
    calls at its first rows and one verify block at its last ones. Where the bits differ (the
    unpadded one-row int4 kernel, ``min_rows`` 1 on AVX2) prompts are always prefilled whole.
    """
    prefix = 3
    width = min(PREFILL_CHUNK, engine.max_len - prefix - 1)
    head = sum(DECODING_CALLS)
    if width < head + 5:
        engine.prefix_reuse = False
        return False
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, engine.vocab_size, prefix + width)
    sliding = engine.info.sliding_window
    layers = range(engine.info.num_layers)

    def run(start: int, n: int) -> None:
        pos = np.arange(start, start + n, dtype=np.int64)
        engine.forward(tokens[start:start + n], pos, causal_mask(start, pos, sliding))
        engine.commit(n)

    def kv(start: int, stop: int) -> list:
        return [x for layer in layers for x in engine.cache.read(layer, start, stop)]

    try:
        engine.reset()
        engine.extend(tokens[:prefix])
        at = prefix
        for n in DECODING_CALLS:
            run(at, n)
            at += n
        decoded = kv(prefix, at)
        engine.reset()
        engine.extend(tokens[:prefix])
        engine.extend(tokens[prefix:])  # one prompt chunk (the last rows' logits only, as prompts run)
        prompt = kv(prefix, prefix + width)
        same = all(np.array_equal(a[:head], b) for a, b in zip(prompt, decoded))
        tail = prefix + width - 5
        engine.rollback(tail)
        run(tail, 5)  # a verify block at the chunk's last rows
        same &= all(np.array_equal(a[-5:], b) for a, b in zip(prompt, kv(tail, tail + 5)))
    finally:
        engine.reset()
    engine.prefix_reuse, engine.prefix_rows = bool(same), engine.min_rows
    return engine.prefix_reuse


def _warn_rows(engine: EngineBase, what: str) -> None:
    import warnings

    warnings.warn(
        f"the {engine.info.role} graph's logits for a token change with the rows of its call ({what}) on "
        f"the {engine.provider} provider: greedy speculation may differ from target-only decoding on "
        "near-ties", RowInvarianceWarning, stacklevel=3)


def probe_batch_invariance(engine: EngineBase, seed: int = 0, warn: bool = True) -> bool:
    """Measure whether a sequence's logits and K/V in a batched call equal, bit for bit, what it
    gets alone (``engine.forward_batch`` against ``engine.forward``); if not, warn and make
    ``engine.forward_rows`` run sequences one at a time (``engine.batch_calls = False``: exact,
    without the batching gain). Returns the answer.

    Batched calls pad: rows are at different lengths (masked past columns) and propose different
    numbers of tokens (pad rows), and the call has more rows than any of its sequences. Measured
    on x86 AVX2 with the fp32 and int4 graphs: no effect beyond the one-row kernel that
    ``min_rows`` already pads (every batched call has several rows). Kernels differ per machine,
    so this is checked where the model runs, after :func:`probe_row_invariance`.
    """
    n = min(engine.max_batch, 4)
    if n < 2:
        return True
    rng = np.random.default_rng(seed)
    lengths, widths = [3, 9, 5, 14][:n], [1, 4, 2, 3][:n]
    if max(lengths) + max(widths) > engine.max_len:
        return True
    prompts = [rng.integers(0, engine.vocab_size, p + s) for p, s in zip(lengths, widths)]
    sliding = engine.info.sliding_window
    layers = sorted({0, engine.info.num_layers - 1})
    seqs = list(range(n))

    def inputs(i):
        pos = np.arange(lengths[i], lengths[i] + widths[i], dtype=np.int64)
        return prompts[i][lengths[i]:], pos, causal_mask(lengths[i], pos, sliding)

    def new_kv(i):
        return [engine.cache.read(layer, lengths[i], lengths[i] + widths[i], i) for layer in layers]

    engine.reset()
    try:
        alone = []
        for i in seqs:
            engine.extend(prompts[i][:lengths[i]], seq=i)
            row = engine.forward(*inputs(i), seq=i).copy()
            alone.append((row, new_kv(i)))
        same = True
        for order, given in ((seqs, False), (seqs[::-1], True), (seqs[1:3], False), (seqs[::2], True)):
            if len(order) < 2:
                continue
            ids, positions, masks = map(list, zip(*[inputs(i) for i in order]))
            rows = engine.forward_batch(order, ids, positions, masks if given else None)
            for i, row in zip(order, rows):
                ref_row, ref_kv = alone[i]
                kv = new_kv(i)
                same &= np.array_equal(row, ref_row) and all(
                    np.array_equal(a, b) for x, y in zip(kv, ref_kv) for a, b in zip(x, y))
    finally:
        engine.reset()
    engine.batch_calls = same
    if not same:
        engine.batch_warning = (
            f"the {engine.info.role} graph's logits for a sequence change when it shares a call with "
            f"other sequences on the {engine.provider} provider: batched decoding runs one sequence per "
            "call (exact, without the batching gain)")
        if warn:
            engine.warn_unbatched()
    return same
