"""Drafting from the target's own hidden states: an EAGLE-3 feature head (issue 22).

The bundle's target graph also outputs ``features`` (the residual streams after three of its
layers, concatenated) for every row it computes; its engine keeps them per position, at the slots
its K/V take, so that what the target committed (a chain's accepted prefix, a tree's compacted
path) is what the head reads. The head is two small graphs: ``fc`` (features -> H) and one decoder
layer with its own KV cache and a reduced-vocabulary LM head (logits over the target's vocabulary,
-inf outside the draft vocabulary).

Rows: the head's row at position ``i`` pairs the target's features of position ``i`` with the
token at ``i + 1`` and predicts the token at ``i + 2``. Before proposing, the head catches up on
every position the target committed since its last proposal (features known); each draft step
then feeds back its own output (``hidden_out``) with the token it just drafted. Drafted rows are
rolled back after the proposal: once verified, their positions get the target's features.
Proposals only shape what is verified, so greedy output stays the target's and sampled output
its distribution, whatever the head says.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.core.rows import DraftReport, StepReport
from specdec_rt.runtime.core.sampling import draft_token

if TYPE_CHECKING:
    from specdec_rt.runtime.core.bundle import Bundle
    from specdec_rt.runtime.core.rows import Row
    from specdec_rt.runtime.engines.ort import OrtEngine

# The most positions a catch-up runs: a longer gap (the prompt, or a long stretch decoded without
# drafting) restarts the head's sequence on the last HEAD_CONTEXT positions. Every catch-up row
# pays the head's layer (and, in heads exported before ``logits_to_keep``, its LM head), so a
# 2k-token prompt would cost the head more than a target step; its proposals need recent context.
HEAD_CONTEXT = 64


def head_inputs(hidden: np.ndarray, keep: int | None) -> dict[str, np.ndarray]:
    """A head call's inputs beyond the engine's contract: ``hidden_states`` [1, S, H] (from
    ``hidden`` [S, H]) and, for graphs that have it (``keep`` not None), ``logits_to_keep``: the LM
    head runs on the last ``keep`` rows only."""
    inputs = {"hidden_states": np.ascontiguousarray(hidden[None], dtype=np.float32)}
    if keep is not None:
        inputs["logits_to_keep"] = np.array([keep], dtype=np.int64)
    return inputs


def keeps_logits(engine: OrtEngine) -> bool:
    """Whether the head graph has the ``logits_to_keep`` input (exported since it exists)."""
    return "logits_to_keep" in {i.name for i in engine.session.get_inputs()}


class EagleDrafter:
    """The ``drafter="eagle"`` proposer: a head engine (``head``, one decoder layer with its own
    cache, ``hidden_states`` in and ``hidden_out`` out), the ``fc`` session, and the ``target``
    engine whose ``features`` it reads (enabled with :meth:`OrtEngine.enable_features`)."""

    name = "eagle"

    def __init__(self, head: OrtEngine, fc, target: OrtEngine, context: int | None = HEAD_CONTEXT) -> None:
        if getattr(target, "features", None) is None:
            raise GenerationInputError("drafter='eagle' needs the target's features, which this engine does not "
                                       "keep (EAGLE-3 heads run on ONNX Runtime engines, not native TensorRT)")
        self.head, self.fc, self.target = head, fc, target
        self.context = context
        if "hidden_out" not in head.extra_outputs:
            head.extra_outputs.append("hidden_out")
        self._keep = keeps_logits(head)
        n = getattr(head, "max_batch", 1)
        self._done = [0] * n  # per sequence: target positions the head has read (its cache: the last ones)
        self._last: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n  # last committed row's (logits, hidden)
        self.calls = 0
        self.time = 0.0
        self.report = DraftReport()

    @property
    def engine(self) -> OrtEngine:
        """The head's engine (the cache a tree region is drafted in)."""
        return self.head

    def begin(self, prompt: list[int], seq: int = 0) -> None:
        """A fresh sequence: the head catches up lazily, at the first proposal."""
        self.head.reset(seq)
        self._done[seq] = 0
        self._last[seq] = None

    def _inputs(self, hidden: np.ndarray, keep: int) -> dict[str, np.ndarray]:
        return head_inputs(hidden, keep if self._keep else None)

    def _rows(self, ids: list[int], positions: np.ndarray, hidden: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """Run rows at the head's next slots (causal over its cache); returns (the last row's
        logits, hidden_out of every row)."""
        head = self.head
        p = head.lengths[seq]
        mask = np.zeros((len(ids), p + len(ids)), dtype=np.float32)
        mask[:, p:] = np.triu(np.full((len(ids), len(ids)), -np.inf, dtype=np.float32), 1)
        head.call_inputs = self._inputs(hidden, 1)
        logits = head.forward(np.asarray(ids, dtype=np.int64), positions, mask, seq)
        self.calls += 1
        return logits[-1], head.outputs["hidden_out"]

    def _call(self, seqs: list[int], ids: list, positions: list[np.ndarray],
              hidden: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Rows of several sequences at their next head slots, per sequence (the last row's
        logits, hidden_out of every row): one batched call on the CPU provider, else (and for a
        single sequence, the one-sequence fast path) one call per sequence. Nothing is committed."""
        head = self.head
        if len(seqs) == 1 or getattr(head, "device", None) != "cpu":
            return [self._rows(i, p, h, q) for q, i, p, h in zip(seqs, ids, positions, hidden)]
        head.call_inputs = {"logits_to_keep": np.array([1], dtype=np.int64)} if self._keep else {}
        logits = head.forward_batch(seqs, ids, positions, None,
                                    {"hidden_states": [np.ascontiguousarray(h, dtype=np.float32) for h in hidden]})
        self.calls += 1
        return [(x[-1], h) for x, h in zip(logits, head.outputs["hidden_out"])]

    def _pending(self, tokens: list[int], seq: int) -> tuple[int, int]:
        """(first, end) of the committed positions the head has not read yet; a gap longer than
        ``context`` restarts the head's sequence on the last ``context`` of them."""
        avail = self.target.lengths[seq]  # features of positions < avail are the target's
        if avail != len(tokens) - 1:
            raise RuntimeError(f"eagle drafter: the target holds {avail} positions, the row {len(tokens)} tokens")
        done = self._done[seq]
        if self.context and avail - done > self.context:  # too far behind: restart on recent positions
            self.head.reset(seq)
            done = self._done[seq] = avail - self.context  # head slot 0 now holds this position
        return done, avail

    def _catch_up(self, rows: list[tuple[list[int], int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Feed the head every position the target committed since each sequence's last proposal
        (one fc call and one head call for all of them); per (tokens, seq), the last row's
        (logits, hidden_out): its prediction for the token after ``tokens``."""
        todo = [(tokens, seq, *self._pending(tokens, seq)) for tokens, seq in rows]
        todo = [(tokens, seq, d, a) for tokens, seq, d, a in todo if d < a]
        if todo:
            feats = np.concatenate([self.target.features[q, d:a] for _, q, d, a in todo])
            hidden = self.fc.run(["hidden_states"], {"features": feats[None]})[0][0]
            parts = np.split(hidden, np.cumsum([a - d for *_, d, a in todo])[:-1])
            outs = self._call([q for _, q, _, _ in todo], [t[d + 1:a + 1] for t, _, d, a in todo],
                              [np.arange(d, a, dtype=np.int64) for *_, d, a in todo], parts)
            for (_, q, d, a), (x, h) in zip(todo, outs):
                self.head.commit(a - d, q)
                self._done[q] = a
                self._last[q] = (x.copy(), h[-1].copy())
        last = [self._last[seq] for _, seq in rows]
        assert all(x is not None for x in last)  # the prompt leaves at least one position to catch up on
        return last

    def catch_up(self, tokens: list[int], seq: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_catch_up` for one sequence."""
        return self._catch_up([(tokens, seq)])[0]

    def propose(self, rows: list[Row], ks: list[int]) -> list[tuple[list[int], np.ndarray | None]]:
        """Each row's draft of up to its k tokens. Every head call serves all rows still drafting
        (the catch-up, then one call per draft step), batched as the target's calls are; a single
        row is the special case that runs on the one-sequence fast path."""
        t0 = time.perf_counter()
        ks = [max(0, min(k, self.head.max_len - len(row.tokens))) for row, k in zip(rows, ks)]
        live = [i for i, k in enumerate(ks) if k > 0]
        long_catch_up = any(self._done[rows[i].seq] == 0 for i in live)
        drafts: list[list[int]] = [[] for _ in rows]
        qs: list[list[np.ndarray]] = [[] for _ in rows]
        first = 0.0
        if live:
            head = self.head
            seqs = [rows[i].seq for i in live]
            state = self._catch_up([(rows[i].tokens, rows[i].seq) for i in live])  # per row: (logits, hidden_out)
            first = time.perf_counter() - t0
            bases = [head.lengths[q] for q in seqs]
            pos = [len(rows[i].tokens) - 1 for i in live]  # the next head row's: the last committed token's
            drafting = list(range(len(live)))
            while drafting:
                more = []
                for j in drafting:
                    i = live[j]
                    tok, q = draft_token(state[j][0], rows[i].cfg.params, rows[i].rng)
                    if q is not None:
                        qs[i].append(q)
                    drafts[i].append(tok)
                    if len(drafts[i]) < ks[i]:
                        more.append(j)
                if not more:
                    break
                outs = self._call([seqs[j] for j in more], [[drafts[live[j]][-1]] for j in more],
                                  [np.array([pos[j]], dtype=np.int64) for j in more], [state[j][1][None] for j in more])
                for j, (x, h) in zip(more, outs):
                    head.commit(1, seqs[j])
                    state[j] = (x, h[-1])
                    pos[j] += 1
                drafting = more
            for q, b in zip(seqs, bases):
                head.rollback(b, q)  # drafted rows: recomputed from the target's features once verified
        spent = time.perf_counter() - t0
        self.time += spent
        self.report = DraftReport(spent, first / spent if first and spent > 0 else None, long_catch_up)
        return [(d, np.stack(q) if q else None) for d, q in zip(drafts, qs)]

    def tree_root(self, tokens: list[int], seq: int = 0) -> tuple[np.ndarray, np.ndarray, int, int]:
        """A dynamic tree's start (:class:`~specdec_rt.runtime.drafters.tree.TreeSource`): the
        catch-up's last row predicts the root's children, and its hidden output is their state; a
        depth-d node's row sits at position ``len(tokens) - 2 + d``."""
        logits, hidden = self.catch_up(tokens, seq)
        return logits, hidden, self.head.lengths[seq], len(tokens) - 2

    def tree_level(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, states: list,
                   seq: int = 0) -> tuple[np.ndarray, list]:
        """One tree level: each node's row reads its parent's hidden output and its own token."""
        head = self.head
        head.call_inputs = self._inputs(np.stack(states), len(ids))
        logits = head.forward(np.asarray(ids, dtype=np.int64), positions, mask, seq)
        out = head.outputs["hidden_out"]
        head.commit(len(ids), seq)
        self.calls += 1
        return logits, list(out)

    def observe(self, step: StepReport) -> None:
        """Nothing to undo: drafted rows were rolled back when proposed."""

    def end(self, seq: int = 0) -> None:
        """The sequence left; its head sequence is reset at the next :meth:`begin`."""


class EagleHead:
    """A bundle's head, opened: its engine (own cache, ``max_batch`` sequences) and fc session,
    bound to the target engine whose features it reads (enabled here)."""

    def __init__(self, bundle: Bundle, target: OrtEngine, max_len: int, provider: str = "cpu",
                 threads: int | None = None, io_binding: bool | None = None, shared_pool: bool = False,
                 max_batch: int = 1) -> None:
        import onnxruntime as ort

        from specdec_rt.runtime.engines.factory import make_engine
        from specdec_rt.runtime.engines.providers import resolve_provider
        from specdec_rt.runtime.engines.sessions import session_options

        if not hasattr(target, "enable_features"):
            raise GenerationInputError("drafter='eagle' runs on ONNX Runtime engines: the native TensorRT engine "
                                       "does not output the target's features")
        info = bundle.head
        assert info is not None and info.fc_graph
        target.enable_features()
        self.target = target
        self.engine = make_engine(bundle.graph_path("head"), info, max_len, provider, threads, bundle.root,
                                  io_binding, shared_pool, max_batch)
        self.fc = ort.InferenceSession(str(bundle.root / info.fc_graph), session_options(threads, shared_pool),
                                       providers=list(dict.fromkeys([resolve_provider(provider), "CPUExecutionProvider"])))

    def drafter(self, context: int | None = HEAD_CONTEXT) -> EagleDrafter:
        return EagleDrafter(self.engine, self.fc, self.target, context)

    def measure_step(self, past: int = 64, reps: int = 11, clock=time.perf_counter, width: int = 1) -> float:
        """Least-disturbed time of one draft step (one row per sequence over ``past`` positions,
        ``width`` sequences in one batched call, as batches draft): the drafting cost "auto"
        prices an eagle step with (its catch-up call is learned in the loop as the first call's
        share)."""
        eng = self.engine
        h = eng.info.hidden_size
        past = max(0, min(past, eng.max_len - 2))
        width = max(1, min(width, getattr(eng, "max_batch", 1)))
        if width > 1 and getattr(eng, "device", None) != "cpu":
            width = 1  # batched head calls run on the CPU provider only (EagleDrafter drafts row by row)
        seqs = list(range(width))
        keep = 1 if keeps_logits(eng) else None
        eng.reset()
        for q in seqs:
            if past:
                eng.call_inputs = head_inputs(np.zeros((past, h), dtype=np.float32), keep)
                pos = np.arange(past, dtype=np.int64)
                eng.forward(np.zeros(past, dtype=np.int64), pos, np.zeros((past, past), dtype=np.float32), q)
                eng.commit(past, q)
        one = np.zeros((1, h), dtype=np.float32)
        eng.call_inputs = head_inputs(one, keep)  # a batched call takes hidden_states per row instead
        if width == 1:
            ids, pos, mask = np.zeros(1, dtype=np.int64), np.array([past]), np.zeros((1, past + 1), dtype=np.float32)
            call = lambda: eng.forward(ids, pos, mask)  # noqa: E731
        else:
            args = (seqs, [np.zeros(1, dtype=np.int64)] * width, [np.array([past], dtype=np.int64)] * width, None,
                    {"hidden_states": [one] * width})
            call = lambda: eng.forward_batch(*args)  # noqa: E731
        call()  # this shape's first call
        best = float("inf")
        for _ in range(reps):
            t0 = clock()
            call()
            best = min(best, clock() - t0)
        eng.reset()
        return best
