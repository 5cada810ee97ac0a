"""Scheduling generations onto an engine: a bounded queue in front of one :class:`Generator`.

Two schedulers share one interface: :class:`BatchScheduler` runs the requests as rows of one
batched generation (continuous batching, up to ``max_batch`` rows; the default where the generator
holds several sequences, i.e. the CPU provider) and :class:`SerialScheduler` runs one at a time
(:func:`make_scheduler` picks). Both keep a bounded FIFO of waiting requests and one worker thread;
request handlers (asyncio) submit a :class:`GenSpec` and read :class:`Event` objects from the
returned :class:`Job`. The interface is small on purpose (``submit`` -> job, ``job.events()``,
``job.cancel()``, ``queue_depth`` / ``running`` / ``capacity``, ``begin_drain`` / ``close``), so
the HTTP layer does not know which one runs.

* Over capacity (``max_queue`` requests already waiting and no free row) ``submit`` raises
  :class:`QueueFull`.
* ``job.cancel()`` (a client disconnected) drops a waiting job from the queue, or stops a running
  generation at its next step: the serial worker iterates ``Generator.stream(..., every_step=True)``,
  which yields once per target call, the batch worker sees every row after every step; both check
  the flag there.
* A job's deadline is enforced by the worker between steps (the slot is freed) and by the
  reader while it waits (queued jobs time out too): the reader gets a ``deadline`` error event.
* ``begin_drain()`` refuses new jobs (:class:`Draining`) and lets accepted ones finish;
  ``close()`` waits for the worker to empty the queue, then stops it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from specdec_rt.errors import USER_ERRORS

log = logging.getLogger("specdec_rt.serving")


class QueueFull(RuntimeError):
    """Every queue slot is taken; the caller should answer 429."""


class Draining(RuntimeError):
    """The server is shutting down and accepts no new requests (503)."""


@dataclass
class GenSpec:
    """One generation: the prompt's token ids and keyword arguments for ``Generator.stream``."""

    prompt_ids: list[int]
    kwargs: dict[str, Any]
    timeout: float | None = None  # seconds from submission; None: no deadline


@dataclass
class Event:
    """What a job reports: ``piece`` (text committed by one step, possibly ""), then exactly one of
    ``done`` (``result`` holds ids, text, stats, finish_reason), ``error`` or ``cancelled``."""

    kind: str  # "piece" | "done" | "error" | "cancelled"
    text: str = ""
    tokens: int = 0  # tokens committed by this step
    result: Any = None  # GenerationResult on "done"
    status: int = 0  # HTTP status for "error" (400 user error, 504 deadline, 500 internal)
    message: str = ""
    code: str | None = None


@dataclass(eq=False)  # identity: jobs are dict keys and removed from the queue by identity
class Job:
    spec: GenSpec
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.monotonic)
    started: float | None = None
    first_token: float | None = None

    def __post_init__(self) -> None:
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancel = threading.Event()
        self._finished = False  # the worker (or the queue) has posted the terminal event
        self.deadline = None if self.spec.timeout is None else self.arrival + self.spec.timeout
        # set by the scheduler that queues the job: called as on_cancel(job, reason) on cancel (it
        # removes a waiting job from its queue)
        self.on_cancel: Callable[[Job, str], None] | None = None
        self.cancel_reason: str | None = None

    def timed_out(self, now: float) -> bool:
        """The deadline passed at ``now``, or the reader already gave up on it: asyncio's timer may
        fire a clock tick before the worker's clock reaches the deadline, and the job must then
        still end as a deadline, not as a client's cancellation."""
        return self.deadline is not None and (now >= self.deadline or self.cancel_reason == "deadline")

    def cancelled_outcome(self) -> Event:
        """The terminal event of a job found cancelled: a deadline error if the reader cancelled it
        for its deadline (set just after the worker's own deadline check), else ``cancelled``."""
        return deadline_error(self) if self.cancel_reason == "deadline" else Event("cancelled")

    def outcome_before_start(self, now: float) -> Event | None:
        """The terminal event of a job that must not start, or None: the deadline is checked
        first, because the reader cancels a job whose deadline passed."""
        if self.timed_out(now):
            return deadline_error(self)
        if self.cancelled:
            return self.cancelled_outcome()
        return None

    # -- worker side (any thread) ----------------------------------------------------------------
    def post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is reading any more
            self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # -- reader side (the event loop) ------------------------------------------------------------
    def cancel(self, reason: str = "abort") -> None:
        """Stop this job: dropped from the queue, or stopped by the worker at its next step.
        ``reason`` labels a job dropped from the queue in the metrics ("abort", "deadline")."""
        if self._cancel.is_set():
            return
        self.cancel_reason = reason
        self._cancel.set()
        if self.on_cancel is not None:
            self.on_cancel(self, reason)

    async def events(self) -> AsyncIterator[Event]:
        """Events until the terminal one (included). A passed deadline yields a 504 error event
        and cancels the job; so does cancellation (then ``cancelled``, with no piece after it)."""
        while True:
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            try:
                event = await asyncio.wait_for(self._events.get(), timeout)
            except asyncio.TimeoutError:
                self.cancel("deadline")
                yield deadline_error(self)
                return
            if self.cancelled and self.cancel_reason is not None and event.kind in ("piece", "done"):
                # the reader cancelled, and the worker may have run several steps (or to the end)
                # before it saw that: what it queued meanwhile is dropped, and the stream ends
                # as cancelled
                if event.kind == "piece":
                    continue
                event = self.cancelled_outcome()
            yield event
            if event.kind != "piece":
                return


def deadline_error(job: Job) -> Event:
    where = "while queued" if job.started is None else "during generation"
    return Event("error", status=504, code="deadline_exceeded",
                 message=f"the request's deadline of {job.spec.timeout:g} s passed {where}")


class SerialScheduler:
    """A bounded FIFO in front of one generator, run by one worker thread."""

    def __init__(self, generator, max_queue: int = 64, metrics=None) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.generator = generator
        self.max_queue = max_queue
        self.metrics = metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._draining = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        # run by the worker before any job (the generator's warm-up); ``ready`` is set after it
        self.warm_up: Callable[[], object] | None = None
        self.ready = threading.Event()

    # -- the interface the HTTP layer uses -------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    @property
    def capacity(self) -> int:
        """Rows that run at once (1 here; a batched engine has more)."""
        return 1

    @property
    def draining(self) -> bool:
        return self._draining

    def start(self) -> None:
        if self.warm_up is None:
            self.ready.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="specdec-worker", daemon=True)
            self._thread.start()

    def submit(self, spec: GenSpec) -> Job:
        """Queue a generation; called from the event loop that will read the job's events."""
        job = Job(spec, asyncio.get_running_loop())
        with self._cond:
            if self._draining or self._stopped:
                raise Draining("the server is shutting down and accepts no new requests")
            if len(self._waiting) >= self.max_queue and self.running + len(self._waiting) >= self.capacity:
                raise QueueFull(f"the server is at capacity ({self.capacity} running, {len(self._waiting)} "
                                f"waiting, queue limit {self.max_queue}); retry later")
            job.on_cancel = self._drop
            self._waiting.append(job)
            self._cond.notify()
        return job

    def begin_drain(self) -> None:
        """Refuse new jobs; accepted ones still run. Safe in a signal handler (no lock taken: a
        handler interrupting ``submit`` on the same thread must not wait for it)."""
        self._draining = True

    def close(self, timeout: float | None = None) -> None:
        """Drain: run what was accepted, then stop the worker (``timeout``: cancel what is left)."""
        self.begin_drain()
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                with self._cond:
                    left = list(self._waiting) + self._in_flight()
                for job in left:
                    job.cancel()
                self._thread.join(5)

    # -- worker ---------------------------------------------------------------------------------
    def _in_flight(self) -> list[Job]:
        return [self._running] if self._running is not None else []

    def _drop(self, job: Job, reason: str) -> None:
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running or finished: the worker sees the flag
        job.post(Event("cancelled"))
        if self.metrics is not None:
            self.metrics.finished(reason)

    def _work(self) -> None:
        """The worker: warm up (jobs queue meanwhile), then wait for work, take it (:meth:`_take`,
        under the lock), run it; until stopped and drained."""
        if self.warm_up is not None:
            t0 = time.monotonic()
            try:
                self.warm_up()
                log.info("warm in %.1f s", time.monotonic() - t0)
            except Exception:  # noqa: BLE001 - a failed warm-up costs speed, not service
                log.error("warm-up failed; serving cold:\n%s", traceback.format_exc())
        self.ready.set()
        while True:
            with self._cond:
                while not self._waiting and not self._stopped:
                    self._cond.wait()
                if not self._waiting:
                    return  # stopped and drained
                task = self._take()
            try:
                task()
            except BaseException:  # noqa: BLE001 - never let the worker die
                log.error("worker failed outside a generation:\n%s", traceback.format_exc())
            finally:
                with self._cond:
                    self._running = None

    def _take(self):
        """The next piece of work from a non-empty queue (called with the lock held): the head job."""
        job = self._waiting.popleft()
        self._running = job
        return lambda: self._run(job)

    def _run(self, job: Job) -> None:
        from specdec_rt.runtime.api.generator import GenerationResult, GenerationStats

        metrics = self.metrics
        job.started = time.monotonic()
        outcome = job.outcome_before_start(job.started)
        if outcome is not None:
            job.post(outcome)
            if metrics is not None:
                metrics.finished("abort" if outcome.kind == "cancelled" else "deadline")
            return
        if metrics is not None:
            metrics.queue_time(job.started - job.arrival)
        gen = self.generator
        result = GenerationResult("", [], GenerationStats())
        pieces = gen.stream(job.spec.prompt_ids, result=result, every_step=True, **job.spec.kwargs)
        committed, last, outcome = 0, job.started, None
        try:
            for piece in pieces:
                now = time.monotonic()
                n = len(result.token_ids) - committed
                committed += n
                if job.first_token is None:
                    job.first_token = now
                    if metrics is not None:
                        metrics.first_token(now - job.arrival)
                elif n and metrics is not None:
                    metrics.inter_token((now - last) / n, n)
                last = now
                job.post(Event("piece", text=piece, tokens=n))
                if job.timed_out(now):
                    outcome = deadline_error(job)
                    break
                if job.cancelled:
                    outcome = job.cancelled_outcome()
                    break
        except USER_ERRORS as exc:  # bad arguments found by the runtime (checked at the first step)
            outcome = Event("error", status=400, message=str(exc), code="invalid_request")
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            log.error("generation failed:\n%s", traceback.format_exc())
            outcome = Event("error", status=500, code="internal_error",
                            message=f"internal error during generation ({type(exc).__name__}); see the server log")
        finally:
            pieces.close()
        if outcome is None:
            outcome = Event("done", result=result)
        if metrics is not None:
            metrics.generation(job, result, outcome)
        job.post(outcome)


# keyword arguments a batch row honours on its own; the group keys are shared by a whole batch
ROW_KWARGS = frozenset({"max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "do_sample",
                        "ignore_eos", "user"})
GROUP_DEFAULTS = {"num_draft_tokens": "auto", "drafter": "auto", "speculation": "chain"}


@dataclass
class _RowState:
    job: Job
    result: Any  # GenerationResult
    srow: Any = None  # the job's SessionRow once prepared
    last: float = 0.0
    closed: bool = False


class BatchScheduler(SerialScheduler):
    """Continuous batching: the running requests are the rows of one batched generation.

    One worker thread runs a :class:`~specdec_rt.runtime.loop.batch_session.BatchSession` over a row
    source fed by the queue: between two steps, waiting requests take free rows (up to ``max_batch``; their
    prefill runs as their own calls), and finished, cancelled or timed-out rows leave. Every row
    keeps its own sampling parameters, seed, stop strings and max_tokens; greedy rows (and sampled
    rows with a fixed K) produce what a request alone produces.

    A batch shares K, the drafter and chain speculation. Requests are taken in FIFO order and
    grouped by those settings: while the head of the queue asks for the running batch's settings
    it joins; when it asks for others, admission pauses until the batch has drained, then a batch
    with the new settings starts. A request the batched loop cannot run at all (tree speculation,
    or an argument rows do not take) runs alone through ``Generator.stream``, between batches.

    ``step_delay`` (seconds, tests only) sleeps after every row's step to make runs observable.
    """

    def __init__(self, generator, max_batch: int, max_queue: int = 64, metrics=None,
                 step_delay: float = 0.0) -> None:
        super().__init__(generator, max_queue, metrics)
        gen_max = getattr(generator, "max_batch", 1)
        if not 1 <= max_batch <= gen_max:
            raise ValueError(f"max_batch must be 1..{gen_max} (the generator's K/V caches hold {gen_max} sequences)")
        self.max_batch = max_batch
        self.step_delay = step_delay
        self._rows: dict[Job, _RowState | None] = {}
        self._next_index = 0

    @property
    def running(self) -> int:
        return len(self._rows) + (self._running is not None)

    @property
    def capacity(self) -> int:
        return self.max_batch

    def _in_flight(self) -> list[Job]:
        return list(self._rows) + super()._in_flight()

    @staticmethod
    def group_key(spec: GenSpec) -> tuple | None:
        """The batch settings of a request, or None when it must run alone."""
        kw = spec.kwargs
        if set(kw) - ROW_KWARGS - set(GROUP_DEFAULTS):
            return None
        opts = {key: kw.get(key, default) for key, default in GROUP_DEFAULTS.items()}
        if opts["speculation"] != "chain":
            return None
        k = opts["num_draft_tokens"]
        if isinstance(k, bool) or not (k == "auto" or isinstance(k, int)):
            return None  # let the serial path report it
        return (k, opts["drafter"])

    def _take(self):
        """A request that must run alone (:meth:`group_key` None) runs as in the serial scheduler;
        otherwise a batch of the head's settings starts and admits requests as it goes."""
        key = self.group_key(self._waiting[0].spec)
        if key is None:
            return super()._take()
        return lambda: self._run_group(key)

    def _session(self, key: tuple):
        """A batch session for these settings (the policies behind "auto" live in the generator,
        so what they learned carries over from one batch to the next)."""
        from specdec_rt.runtime.loop.batch_session import BatchSession
        from specdec_rt.runtime.loop.requests import SpeculationConfig

        return BatchSession(self.generator, SpeculationConfig(key[0], key[1], "chain"), self.max_batch)

    def _source(self, key: tuple, states: dict, session):
        from specdec_rt.runtime.core.rows import WAIT

        while True:
            with self._cond:
                while True:
                    if self._waiting and self.group_key(self._waiting[0].spec) == key:
                        job = self._waiting.popleft()
                        self._rows[job] = None
                        break
                    if self._rows:
                        job = None  # rows are decoding: ask again after the next step
                        break
                    if self._waiting or self._stopped:
                        return  # other settings at the head, or stopping: this batch ends
                    self._cond.wait()
            if job is None:
                yield WAIT
                continue
            srow = self._admit(job, states, session)
            if srow is not None:
                yield srow

    def _admit(self, job: Job, states: dict, session):
        """A popped job as a session row, or None when it ended before starting (posted)."""
        from specdec_rt.runtime.api.generator import GenerationResult, GenerationStats
        from specdec_rt.runtime.loop.requests import RowRequest

        metrics = self.metrics
        job.started = time.monotonic()
        outcome = job.outcome_before_start(job.started)
        if outcome is None:
            if metrics is not None:
                metrics.queue_time(job.started - job.arrival)
            kw = job.spec.kwargs
            self._next_index += 1
            try:
                request = RowRequest(job.spec.prompt_ids, **{k: v for k, v in kw.items() if k in ROW_KWARGS})
                srow = session.prepare(request, self._next_index)
            except USER_ERRORS as exc:
                outcome = Event("error", status=400, message=str(exc), code="invalid_request")
        if outcome is not None:
            self._end(_RowState(job, GenerationResult("", [], GenerationStats()), last=job.started), outcome)
            return None
        st = _RowState(job, srow.result, srow, job.started)
        states[srow.index] = st
        with self._cond:
            self._rows[job] = st
        return srow

    def _end(self, st: _RowState, outcome: Event) -> None:
        st.closed = True
        if self.metrics is not None:
            self.metrics.generation(st.job, st.result, outcome)
        with self._cond:
            self._rows.pop(st.job, None)
        st.job.post(outcome)

    def _run_group(self, key: tuple) -> None:
        metrics = self.metrics
        try:
            session = self._session(key)
        except USER_ERRORS as exc:  # e.g. drafter "model" without a draft model: refuse the head
            with self._cond:
                head = self._waiting[0] if self._waiting else None
                same = head is not None and self.group_key(head.spec) == key
                job = self._waiting.popleft() if same else None
            if job is not None:
                from specdec_rt.runtime.api.generator import GenerationResult, GenerationStats

                self._end(_RowState(job, GenerationResult("", [], GenerationStats())),
                          Event("error", status=400, message=str(exc), code="invalid_request"))
            return
        states: dict[int, _RowState] = {}
        try:
            for update in session.run(self._source(key, states, session)):
                st = states.get(update.index)
                if st is None or st.closed:
                    continue
                job, res = st.job, st.result
                error = st.srow.row.error
                if error is not None:  # its prefill failed (e.g. the prompt does not fit)
                    self._end(st, Event("error", status=400, message=str(error), code="invalid_request"))
                    del states[update.index]
                    continue
                if self.step_delay:
                    time.sleep(self.step_delay)
                now = time.monotonic()
                new = update.tokens
                if job.first_token is None:
                    job.first_token = now
                    if metrics is not None:
                        metrics.first_token(now - job.arrival)
                elif new and metrics is not None:
                    metrics.inter_token((now - st.last) / len(new), len(new))
                st.last = now
                job.post(Event("piece", text=update.piece, tokens=len(new)))
                outcome = None
                if update.finished:
                    outcome = Event("done", result=res)
                elif job.timed_out(now):
                    outcome = deadline_error(job)
                elif job.cancelled:
                    outcome = job.cancelled_outcome()
                if outcome is not None:
                    session.cancel(update.index)  # leaves before the next step (no-op when finished)
                    self._end(st, outcome)
                    del states[update.index]  # a batch under steady load never ends: forget its rows
        except Exception as exc:  # noqa: BLE001 - report to every row of the batch, keep serving
            log.error("batched generation failed:\n%s", traceback.format_exc())
            for st in list(states.values()):
                if not st.closed:
                    self._end(st, Event("error", status=500, code="internal_error",
                                        message=f"internal error during generation ({type(exc).__name__}); "
                                                "see the server log"))
        finally:
            with self._cond:  # popped but never admitted (the loop failed in between)
                left = [j for j, st in self._rows.items() if st is None]
            for job in left:
                self._rows.pop(job, None)
                job.post(Event("error", status=500, code="internal_error", message="internal error; see the server log"))


def make_scheduler(generator, max_batch: int | None, max_queue: int = 64, metrics=None):
    """``max_batch`` None: batching where the generator holds several sequences (the CPU provider),
    serial otherwise; 1: serial; N > 1: a batch of N rows (at most the generator's ``max_batch``)."""
    n = getattr(generator, "max_batch", 1) if max_batch is None else max_batch
    if n <= 1:
        return SerialScheduler(generator, max_queue, metrics)
    return BatchScheduler(generator, n, max_queue, metrics)
