"""Scheduling generations onto an engine: a bounded queue in front of one :class:`Generator`.

One ``Generator`` owns one KV cache per model, so its generations run one at a time. The
:class:`SerialScheduler` keeps a bounded FIFO of waiting requests and one worker thread that runs
them; request handlers (asyncio) submit a :class:`GenSpec` and read :class:`Event` objects from the
returned :class:`Job`. The interface is small on purpose (``submit`` -> job, ``job.events()``,
``job.cancel()``, ``queue_depth`` / ``running``, ``begin_drain`` / ``close``) so that a batched
engine (continuous batching, several rows per target call) can replace the serial worker without
touching the HTTP layer.

* Over capacity (``max_queue`` requests already waiting) ``submit`` raises :class:`QueueFull`.
* ``job.cancel()`` (a client disconnected) drops a waiting job from the queue, or stops a running
  generation at its next step: the worker iterates ``Generator.stream(..., every_step=True)``, which
  yields once per target call, and checks the flag between steps.
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
from typing import Any, AsyncIterator

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


@dataclass
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
        self._on_cancel = None  # set by the scheduler: removes a waiting job from its queue

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
        self._cancel.set()
        if self._on_cancel is not None:
            self._on_cancel(self, reason)

    async def events(self) -> AsyncIterator[Event]:
        """Events until the terminal one (included). A passed deadline yields a 504 error event
        and cancels the job; so does cancellation (then ``cancelled``)."""
        while True:
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            try:
                event = await asyncio.wait_for(self._events.get(), timeout)
            except asyncio.TimeoutError:
                self.cancel("deadline")
                yield deadline_error(self)
                return
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
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="specdec-worker", daemon=True)
            self._thread.start()

    def submit(self, spec: GenSpec) -> Job:
        """Queue a generation; called from the event loop that will read the job's events."""
        job = Job(spec, asyncio.get_running_loop())
        with self._cond:
            if self._draining or self._stopped:
                raise Draining("the server is shutting down and accepts no new requests")
            if len(self._waiting) >= self.max_queue and not (self._running is None and not self._waiting):
                raise QueueFull(f"the server is at capacity ({self.capacity} running, {len(self._waiting)} "
                                f"waiting, queue limit {self.max_queue}); retry later")
            job._on_cancel = self._drop
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
                    left = list(self._waiting) + ([self._running] if self._running else [])
                for job in left:
                    job.cancel()
                self._thread.join(5)

    # -- worker ---------------------------------------------------------------------------------
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
        while True:
            with self._cond:
                while not self._waiting and not self._stopped:
                    self._cond.wait()
                if not self._waiting:
                    return  # stopped and drained
                job = self._waiting.popleft()
                self._running = job
            try:
                self._run(job)
            except BaseException:  # noqa: BLE001 - never let the worker die
                log.error("worker failed outside a generation:\n%s", traceback.format_exc())
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        from specdec_rt.runtime.generator import GenerationResult, GenerationStats

        metrics = self.metrics
        job.started = time.monotonic()
        if job.cancelled:
            job.post(Event("cancelled"))
            return
        if job.deadline is not None and job.started >= job.deadline:
            job.post(deadline_error(job))
            if metrics is not None:
                metrics.finished("deadline")
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
                if job.deadline is not None and now >= job.deadline:
                    outcome = deadline_error(job)
                    break
                if job.cancelled:
                    outcome = Event("cancelled")
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
