"""Many sequences decoding together on one generator, as a public object: prepare a row from a
request, add it (its prefill), step all rows at once, read each row's text and result as it
grows, cancel a row. :meth:`Generator.generate_batch` / :meth:`Generator.stream_batch`
(:class:`BatchStream`) and the server's batching scheduler both run on a :class:`BatchSession`,
so a request means the same there as in a batch, and neither reaches into the generator."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np

from specdec_rt.errors import ContextOverflowError, GenerationInputError
from specdec_rt.runtime.core.memory import peak_rss_bytes, reset_peak_rss
from specdec_rt.runtime.core.rows import Row
from specdec_rt.runtime.core.sampling import SamplingParamsError
from specdec_rt.runtime.core.stats import BatchStats, GenerationStats
from specdec_rt.runtime.loop.requests import RowRequest, SpeculationConfig
from specdec_rt.runtime.loop.speculative import BatchLoop
from specdec_rt.runtime.loop.text_output import GenerationResult, TextAssembler, finish_reason
from specdec_rt.runtime.loop.tree_step import batch_tree_step



class GeneratorLike(Protocol):
    """What a session needs of a :class:`~specdec_rt.runtime.api.generator.Generator`."""

    target: object
    tokenizer: object
    generation_defaults: object
    eos_token_ids: Sequence[int]
    max_length: int
    last_batch_stats: BatchStats
    exact_trees: bool

    def encode_prompt(self, prompt) -> list[int]: ...

    def speculation_plan(self, config: SpeculationConfig, width: int = 1): ...


@dataclass
class SessionRow:
    """One request in a session: its loop row, its result so far and its text assembler."""

    index: int
    row: Row
    result: GenerationResult
    text: TextAssembler
    closed: bool = False


@dataclass
class RowUpdate:
    """What one row got from a call: ``tokens`` committed, ``piece`` of text made visible
    (with the held-back tail once it finished), and whether it ``finished`` (its
    ``result.finish_reason`` / ``result.error`` are then final)."""

    index: int
    tokens: list[int]
    piece: str
    finished: bool
    result: GenerationResult = field(repr=False, default=None)  # type: ignore[assignment]


class BatchSession:
    """Rows sharing one speculation setting decode together (at most ``max_rows`` at once).

    ``prepare`` validates a :class:`RowRequest` (raising the runtime's user errors) into a
    :class:`SessionRow`; ``add`` prefills it on a free cache sequence (``has_room``) and returns
    its first token; ``step`` runs one draft -> verify -> accept -> commit for every active row;
    ``cancel`` ends a row before the next step. ``run(source)`` does all of it for a stream of
    prepared rows (a source may yield :data:`~specdec_rt.runtime.core.rows.WAIT`: nothing to add now).
    """

    def __init__(self, gen: GeneratorLike, config: SpeculationConfig, max_rows: int,
                 stats: BatchStats | None = None) -> None:
        self.gen = gen
        self.config = config
        self.plan = gen.speculation_plan(config, max_rows)
        self.stats = stats if stats is not None else BatchStats(max_rows=max_rows)
        p = self.plan
        stepper = (batch_tree_step(gen.target, p.drafter, config, gen.exact_trees)
                   if config.speculation == "tree" else None)
        self.loop = BatchLoop(gen.target, p.drafter, max_rows, p.k, p.policy, self.stats, p.verify_thread, stepper)
        self.rows: dict[int, SessionRow] = {}  # added and not closed yet

    # -- rows in ------------------------------------------------------------------------------
    def prepare(self, request: RowRequest, index: int) -> SessionRow:
        """``request`` as a row of this session (not added yet); raises the runtime's user
        errors (a bad prompt, too long for the context, bad sampling values)."""
        gen = self.gen
        ids = gen.encode_prompt(request.prompt)
        cfg = request.loop_config(gen.generation_defaults, gen.eos_token_ids)
        stats = self.new_stats()
        stats.prompt_tokens = len(ids)
        result = GenerationResult("", [], stats, prompt_token_ids=ids)
        row = Row(ids, cfg, np.random.default_rng(request.seed), stats, index=index)
        text = TextAssembler(gen.tokenizer, request.stops, () if cfg.ignore_eos else gen.eos_token_ids)
        return SessionRow(index, row, result, text)

    def new_stats(self) -> GenerationStats:
        """A row's statistics, labelled with this session's speculation."""
        p = self.plan
        return GenerationStats(drafter=None if p.drafter is None else p.drafter.name,
                               drafter_requested=self.config.drafter, speculation=self.config.speculation,
                               num_draft_tokens=self.config.num_draft_tokens, overlap=p.overlapped)

    @property
    def has_room(self) -> bool:
        return self.loop.has_room

    @property
    def active(self) -> int:
        """Rows decoding now."""
        return len(self.loop.active)

    def add(self, srow: SessionRow) -> RowUpdate:
        """Prefill ``srow`` on a free sequence (``has_room`` must hold): its first token, or a
        finished update with ``result.error`` when its prompt cannot run."""
        self.rows[srow.index] = srow
        return self._update(srow, self.loop.admit(srow.row))

    # -- decoding -----------------------------------------------------------------------------
    def step(self) -> list[RowUpdate]:
        """One batched step of every active row."""
        return [self._update(self.rows[row.index], new) for row, new in self.loop.step()]

    def cancel(self, index: int) -> None:
        """End row ``index`` now (``finish_reason="cancelled"``, its text so far stays); the other
        rows' tokens do not change."""
        srow = self.rows.get(index)
        if srow is None or srow.closed:
            return
        srow.row.finished = "cancelled"
        self._close(srow)

    def run(self, source: Iterable[SessionRow]) -> Iterator[RowUpdate]:
        """Add rows from ``source`` whenever a sequence is free and step the active ones until
        the source is exhausted and every row finished. Yields every update (prefills first)."""
        t0 = time.perf_counter()
        reset_peak_rss()
        try:
            # a row cancelled before it started is not added
            yield from self.loop.drive(source, lambda srow: [] if srow.row.finished else [self.add(srow)], self.step)
        finally:
            self.stats.time_total = time.perf_counter() - t0
            self.stats.peak_rss_bytes = peak_rss_bytes()

    # -- results ------------------------------------------------------------------------------
    def _update(self, srow: SessionRow, new: list[int]) -> RowUpdate:
        if srow.closed:
            return RowUpdate(srow.index, [], "", True, srow.result)
        res, text, row = srow.result, srow.text, srow.row
        res.token_ids.extend(new)
        self.stats.new_tokens += len(new)
        piece = text.push(new) if new else ""
        res.text += piece
        if text.stopped and not row.finished:
            row.finished = "stop"
        if row.finished:
            piece += self._close(srow)
        return RowUpdate(srow.index, new, piece, srow.closed, res)

    def _close(self, srow: SessionRow) -> str:
        """Final text and finish reason of a finished row; returns text still to emit."""
        srow.closed = True
        self.rows.pop(srow.index, None)
        res, text, row = srow.result, srow.text, srow.row
        if row.error is not None:
            res.error, res.finish_reason = f"{type(row.error).__name__}: {row.error}", "error"
            self.stats.errors += 1
            return ""
        tail = "" if text.stopped else text.close()
        res.text += tail
        if row.finished == "cancelled":
            res.finish_reason = "cancelled"
        else:
            res.finish_reason = finish_reason(text, len(row.prompt), len(res.token_ids), row.cfg.max_new_tokens,
                                              self.gen.max_length)
        row.stats.peak_rss_bytes = peak_rss_bytes()
        return tail


class BatchStream:
    """A running batch (:meth:`Generator.stream_batch`). Iterating yields ``(index, text piece)``
    as rows commit tokens; ``results[index]`` fills in meanwhile (final once the row is done);
    ``cancel(index)`` ends one row (``finish_reason="cancelled"``) without changing any other
    row's tokens; ``stats`` holds the batch's totals."""

    def __init__(self, session: BatchSession, rows: list[SessionRow | None], results: list[GenerationResult]) -> None:
        self.session = session
        self.rows = rows
        self.results = results
        self.stats = session.stats
        self.stats.prompts = len(rows)
        self.stats.errors = sum(r is None for r in rows)
        self._events = self._run()

    @classmethod
    def from_prompts(cls, session: BatchSession, prompts: Sequence, defaults: dict) -> BatchStream:
        """A stream over ``prompts`` (text, token ids, or ``{"prompt": ..., <argument>: value}``
        dicts overriding ``defaults``); a prompt whose input is bad gets a result with
        ``finish_reason="error"`` and its message, and the others run."""
        rows: list[SessionRow | None] = []
        results: list[GenerationResult] = []
        for i, item in enumerate(prompts):
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
                srow = session.prepare(RowRequest(item, **opts), i)
            except (GenerationInputError, ContextOverflowError, SamplingParamsError) as exc:
                results.append(GenerationResult("", [], session.new_stats(), finish_reason="error",
                                                error=f"{type(exc).__name__}: {exc}"))
                rows.append(None)
                continue
            results.append(srow.result)
            rows.append(srow)
        return cls(session, rows, results)

    @property
    def texts(self) -> list[TextAssembler | None]:
        return [None if r is None else r.text for r in self.rows]

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[int, str]:
        return next(self._events)

    def cancel(self, index: int) -> None:
        """End row ``index`` now (its text so far stays); a row not started yet never starts."""
        srow = self.rows[index]
        if srow is None or srow.closed:
            return
        if srow.index in self.session.rows:
            self.session.cancel(index)
            return
        srow.row.finished = "cancelled"  # not added yet: the session skips it
        srow.closed = True
        srow.result.finish_reason = "cancelled"

    def _run(self) -> Iterator[tuple[int, str]]:
        try:
            for update in self.session.run(r for r in self.rows if r is not None):
                if update.piece:
                    yield update.index, update.piece
        finally:
            self.session.gen.last_batch_stats = self.stats
