"""Drafters: whatever proposes tokens for the target to verify, behind one interface."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from specdec_rt.runtime.core.rows import DraftReport, StepReport
from specdec_rt.runtime.core.sampling import draft_token
from specdec_rt.runtime.engines.ort import OrtEngine

if TYPE_CHECKING:
    from specdec_rt.runtime.core.rows import Row

__all__ = ["Drafter", "DraftReport", "StepReport", "ModelDrafter", "PromptLookupDrafter", "DRAFT_CONTEXT",
           "RESYNC_CONTEXT", "BATCH_CATCH_UP"]

# A catch-up longer than this runs as the sequence's own call before a batched draft step, so a
# long one does not widen every row of the batch (the first one is the prompt: start() is lazy;
# later ones are 1 or 2 tokens).
BATCH_CATCH_UP = 4
# The most tokens a draft runs to catch up before proposing: a longer gap (a long prompt at the
# first proposal, or many steps decoded without drafting) restarts the draft's sequence on its
# last DRAFT_CONTEXT tokens instead. The draft's context only shapes its proposals, never the
# output, and catching up is prefill work: a 0.5B int4 draft catches up 64 tokens in 0.19 s and
# 256 in 0.7-1.5 s on 2 cores (one step of its 1.5B target: 0.04 s). Measured on Spec-Bench with
# the Qwen2.5-Coder int4 pair at K = 2 (first question of summarization, rag, coding, math):
# acceptance 0.15 / 0.47 / 0.83 / 0.88 with 64 tokens of context against 0.16 / 0.50 / 0.83 /
# 0.90 with 256, and decode 0.69 / 1.04 / 1.25 / 1.28x target-only against 0.60 / 0.92 / 1.25 /
# 1.27x (32 tokens: math's acceptance fell to 0.71).
DRAFT_CONTEXT = 64
# A draft that re-enters after a stretch of decoding without it ("auto" at K = 0 probing, or the
# hybrid drafter back from prompt lookup) restarts on its last RESYNC_CONTEXT tokens when its gap
# is longer: a probe must be cheap to be worth making. Measured on the Qwen2.5-Coder 0.5B int4
# draft (2 cores): 32 tokens of catch-up 0.08 s, 64 tokens 0.19 s, 256 tokens 0.7-1.5 s, while one
# target step is ~0.04 s; a probe that caught up 256 tokens cost "auto" 13% of a 700-token-prompt
# generation.
RESYNC_CONTEXT = 32


class Drafter(Protocol):
    """Whatever proposes tokens for the target to verify (transformers' candidate generators,
    llama.cpp's common_speculative): ``begin`` a sequence, ``propose`` up to ``ks[i]`` tokens
    after ``rows[i].tokens`` for every row of a batch, ``observe`` what verification kept,
    ``end`` the sequence. ``report`` describes the last proposal.

    ``propose`` returns one (draft tokens, q) per row: q holds the draft's processed
    probabilities [len, V] when the draft sampled from a distribution, or None for deterministic
    proposals (greedy decoding, or prompt lookup). Each row samples with its own parameters and
    random generator. ``seq`` names the row's sequence (its cache) in a stateful drafter.
    """

    name: str
    report: DraftReport

    def begin(self, prompt: list[int], seq: int = 0) -> None: ...

    def propose(self, rows: list[Row], ks: list[int]) -> list[tuple[list[int], np.ndarray | None]]: ...

    def observe(self, step: StepReport) -> None: ...

    def end(self, seq: int = 0) -> None: ...


class ModelDrafter:
    """A small causal LM on its own engine and cache; catches up on tokens it has not seen.

    The rows of a batch draft together: each draft step is one call over every row still
    drafting (rows at different lengths, padded by the engine).
    """

    name = "model"

    def __init__(self, engine: OrtEngine, target_vocab: int, context: int | None = DRAFT_CONTEXT,
                 resync: int | None = RESYNC_CONTEXT) -> None:
        self.engine = engine
        self.target_vocab = target_vocab
        self.context = context  # catch-ups longer than this restart on the last ``context`` tokens
        # ... and re-entries (see RESYNC_CONTEXT) on the last ``resync`` (at most ``context``)
        self.resync = None if context is None else min(context, resync or context)
        # per sequence: tokens whose K/V are committed in the draft cache, and where in the
        # sequence's tokens they start (0 unless a restart cut the history: see unseen())
        self._seen: list[list[int]] = [[] for _ in range(getattr(engine, "max_batch", 1))]
        self._base: list[int] = [0] * len(self._seen)
        self._prompt_len: list[int] = [0] * len(self._seen)
        self.calls = 0
        self.time = 0.0
        # stop drafting once the product of the draft's top probabilities falls below this
        # (0 = always draft k tokens); set by the adaptive policy
        self.confidence_floor = 0.0
        # the last proposal: its first call's share of the time (the catch-up, on caches the
        # target's verify call just evicted: the policy prices that call apart, as a cost per
        # drafting step, from the later ones, a cost per drafted token), and whether it caught up
        # more than a step's tokens (a prompt: begin() is lazy; or a re-entry after a stretch
        # without drafting). Learned from, a probe's catch-up after a K = 0 stretch had inflated
        # the draft's scales and kept K at 0.
        self.report = DraftReport()

    def seen(self, seq: int = 0) -> list[int]:
        return self._seen[seq]

    def begin(self, prompt: list[int], seq: int = 0) -> None:
        """A fresh sequence; the prompt enters the draft cache lazily, at the first
        :meth:`propose` (in the sequence's own call(s), as the catch-up of its unseen tokens).

        Lazily because drafting may never come: where "auto" settles at K = 0 (a costly or
        weak draft) an eager prefill was pure loss, ~3% of a 96-token generation on a draft
        at c = 0.2 (measured: scripts/policy_pairs.py, layer-skip pair); it also takes the
        draft's prefill off the time to the first token."""
        self.engine.reset(seq)
        self._seen[seq] = []
        self._base[seq] = 0
        self._prompt_len[seq] = len(prompt)

    def unseen(self, tokens: list[int], seq: int = 0) -> list[int]:
        """The tokens the draft must run before it can propose after ``tokens``: those past what
        its cache holds, or, where that gap exceeds the limit, the last ``limit`` tokens on a
        fresh draft sequence (positions from 0: the draft sees a shorter history). The limit is
        ``context`` when drafting starts with the sequence (its prompt), ``resync`` when the
        draft re-enters after tokens decoded without it."""
        base, seen = self._base[seq], self._seen[seq]
        todo = tokens[base + len(seen):]
        re_entry = bool(seen) or len(tokens) - self._prompt_len[seq] > BATCH_CATCH_UP
        limit = self.resync if re_entry else self.context
        if limit and len(todo) > max(limit, BATCH_CATCH_UP):
            self.engine.reset(seq)
            self._seen[seq] = []
            self._base[seq] = len(tokens) - limit
            todo = tokens[self._base[seq]:]
        return todo

    def advance(self, pending: list[int], seq: int = 0) -> np.ndarray:
        """Run tokens of one sequence (from :meth:`unseen`, or drafted ones) into the draft
        cache; returns the last one's logits row."""
        return self._step(pending, seq)

    def tree_root(self, tokens: list[int], seq: int = 0) -> tuple[np.ndarray, None, int, int]:
        """A dynamic tree's start (:class:`~specdec_rt.runtime.drafters.tree.TreeSource`): catch
        up; the root's row, no state, the committed prefix (the root included) and the root's
        own position in the draft (its history may be cut: :meth:`unseen`)."""
        row = self.advance(self.unseen(tokens, seq), seq)
        base = self.engine.lengths[seq]
        return row, None, base, base - 1

    def tree_level(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, states: list,
                   seq: int = 0) -> tuple[np.ndarray, list]:
        """One tree level in one call, committed to the tree region (rolled back by the tree)."""
        logits = self.engine.forward(ids, positions, mask, seq)
        self.engine.commit(len(ids), seq)
        self.calls += 1
        return logits, [None] * len(ids)

    def _step(self, pending: list[int], seq: int = 0) -> np.ndarray:
        """Run one sequence's unseen tokens; return the last one's logits row."""
        eng = self.engine
        row = eng.step(pending[0], seq) if len(pending) == 1 else eng.extend(pending, seq=seq)
        self._seen[seq].extend(pending)
        self.calls += 1
        return row

    def _step_rows(self, seqs: list[int], pending: list[list[int]]) -> list[np.ndarray]:
        """:meth:`_step` for several sequences in one call."""
        if len(seqs) == 1:
            return [self._step(pending[0], seqs[0])]
        eng = self.engine
        logits = eng.forward_rows(seqs, pending)
        for q, t in zip(seqs, pending):
            eng.commit(len(t), q)
            self._seen[q].extend(t)
        self.calls += 1
        return [x[-1] for x in logits]

    def propose(self, rows: list[Row], ks: list[int]) -> list[tuple[list[int], np.ndarray | None]]:
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in rows]
        qs: list[list[np.ndarray]] = [[] for _ in rows]
        confidence = [1.0] * len(rows)
        floor = self.confidence_floor
        pending = []
        long_catch_up = False
        for row in rows:
            todo = self.unseen(row.tokens, row.seq)
            # a fresh (or restarted, see unseen) sequence or a long gap: its first call is prefill
            long_catch_up |= not self._seen[row.seq] or len(todo) > BATCH_CATCH_UP
            if len(rows) > 1 and len(todo) > BATCH_CATCH_UP:
                self._step(todo[:-1], row.seq)
                todo = todo[-1:]
            pending.append(todo)
        # draft tokens must fit the draft's context
        live = [i for i, (row, k) in enumerate(zip(rows, ks)) if min(k, self.engine.max_len - len(row.tokens)) > 0]
        first = 0.0
        while live:
            logits = self._step_rows([rows[i].seq for i in live], [pending[i] for i in live])
            if not first:
                first = time.perf_counter() - t0
            still = []
            for i, x in zip(live, logits):
                row = rows[i]
                params = row.cfg.params
                tok, q = draft_token(x, params, row.rng)
                if q is not None:
                    qs[i].append(q)
                    confidence[i] *= float(q.max())
                elif floor:
                    confidence[i] /= float(np.exp(x - x[tok]).sum())
                drafts[i].append(tok)
                pending[i] = [tok]
                k = min(ks[i], self.engine.max_len - len(row.tokens))
                if len(drafts[i]) < k and not (floor and confidence[i] < floor):
                    still.append(i)
            live = still
        spent = time.perf_counter() - t0
        self.time += spent
        self.report = DraftReport(spent, first / spent if first and spent > 0 else None, long_catch_up)
        out = []
        for row, d, q in zip(rows, drafts, qs):
            if row.cfg.params.greedy or not d:
                out.append((d, None))
                continue
            q = np.stack(q)
            if q.shape[1] < self.target_vocab:  # a draft with a smaller (unpadded) vocab
                q = np.pad(q, ((0, 0), (0, self.target_vocab - q.shape[1])))
            out.append((d, q))
        return out

    def observe(self, step: StepReport) -> None:
        """Roll the draft cache back to the longest prefix it shares with ``step.tokens``."""
        self.rollback_to(step.tokens, step.seq)

    def end(self, seq: int = 0) -> None:
        """The sequence left the batch; its cache sequence is reset at the next :meth:`begin`."""

    def rollback_to(self, tokens: list[int], seq: int = 0) -> None:
        """Roll the draft cache back to the longest prefix it shares with ``tokens``."""
        seen, base = self._seen[seq], self._base[seq]
        n = min(len(seen), len(tokens) - base)
        start = max(0, n - 64)
        keep = start
        while keep < n and seen[keep] == tokens[base + keep]:
            keep += 1
        if keep < len(seen):
            del seen[keep:]
            self.engine.rollback(keep, seq)


class PromptLookupDrafter:
    """N-gram lookup over the prompt and the output so far; no second model.

    Finds the most recent earlier occurrence of the longest suffix n-gram (``max_ngram`` down to
    ``min_ngram``) and proposes the tokens that followed it.
    """

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.calls = 0
        self.time = 0.0
        self.report = DraftReport()

    def begin(self, prompt: list[int], seq: int = 0) -> None:
        pass

    def propose(self, rows: list[Row], ks: list[int]) -> list[tuple[list[int], np.ndarray | None]]:
        t0 = time.perf_counter()
        out = [(self.lookup(row.tokens, k) if k > 0 else [], None) for row, k in zip(rows, ks)]
        spent = time.perf_counter() - t0
        self.time += spent
        self.report = DraftReport(spent)
        return out

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        arr = np.asarray(tokens, dtype=np.int64)
        n_tok = len(arr)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            pattern = arr[n_tok - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tok - 1], n)
            hits = np.nonzero((windows == pattern).all(axis=1))[0]
            hits = hits[hits + n < n_tok]
            if len(hits):
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def observe(self, step: StepReport) -> None:
        pass  # stateless: it reads the row's tokens at every proposal

    def end(self, seq: int = 0) -> None:
        pass
