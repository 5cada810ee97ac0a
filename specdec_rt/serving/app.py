"""The ASGI application (Starlette): OpenAI-compatible routes in front of a scheduler.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(``/v1/models/{id}``), ``GET /health``, ``GET /metrics`` and the deprecated ``POST /generate``
(the body and answers of the removed stdlib server, kept for existing clients; bodies are checked
by :mod:`.generate_route`). With ``ServerConfig.api_keys`` every route but ``/health`` (and
``/metrics`` unless ``metrics_requires_key``) answers 401 without a valid key (:mod:`.auth`).

Request flow: read the body (size-limited), validate it (:mod:`.protocol`), tokenize / render the
chat template in a worker thread, check the context, submit to the scheduler (429 when its queue
is full, 503 while draining), then wait for the first event before answering, so that an error
found when the generation starts is still a plain HTTP error. A task watches the connection
meanwhile: a client that disconnects cancels its job (dropped from the queue, or stopped by the
worker at its next step).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specdec_rt.errors import USER_ERRORS, ServerConfigError
from specdec_rt.runtime.drafters.names import NEEDS_DRAFT_MODEL, NEEDS_HEAD
from specdec_rt.serving import protocol as P
from specdec_rt.serving.auth import APIKeyMiddleware, APIKeys
from specdec_rt.serving.generate_route import RequestError, parse_request
from specdec_rt.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from specdec_rt.serving.scheduler import Draining, GenSpec, QueueFull, make_scheduler

log = logging.getLogger("specdec_rt.serving")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/generate")


@dataclass
class ServerConfig:
    """Server-wide settings; the speculative ones are defaults a request may override."""

    model_name: str = "specdec"
    num_draft_tokens: int | str = "auto"
    drafter: str | None = "auto"  # "auto": what the library picks (PolicyStore.auto_drafter)
    speculation: str = "chain"
    max_queue: int = 64
    max_batch: int | None = None  # rows decoding at once; None: the generator's max_batch (1 = serial)
    request_timeout: float | None = 600.0  # seconds; None: no deadline
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256  # when a request gives none (capped by the room left in the context)
    max_tokens_limit: int | None = None  # None: the context length
    metrics_prefix: str = "specdec"
    drain_timeout: float = 60.0
    # measure / load the cost model and run every decoding path once before /health says ready
    # (specdec-serve does; off here so that embedding apps and tests start at once)
    warm_up: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # shown by /health (provider, ...)
    # None: no key needed; else every path but /health (and /metrics, unless metrics_requires_key)
    # needs 'Authorization: Bearer <key>' (auth.py; digests only, so the repr holds no key)
    api_keys: APIKeys | None = None
    metrics_requires_key: bool = False


def error_response(err: P.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class EventStream(Response):
    """``text/event-stream`` from an async iterator of ready-made SSE bytes; ``on_close`` always runs
    (a client that went away makes ``send`` raise, which ends the stream quietly)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        self.chunks = chunks
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client disconnected
            pass
        finally:
            await self.on_close()


class MetricsMiddleware:
    """Counts responses by method, route and status (unknown paths are one "other" route)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.http_response(scope.get("method", ""), route, status[0])


class SpecdecAPI:
    """Route handlers bound to one generator, scheduler and config."""

    def __init__(self, generator, config: ServerConfig, scheduler=None) -> None:
        self.gen = generator
        self.config = config
        self.metrics = ServerMetrics(config.model_name, config.metrics_prefix)
        self.scheduler = scheduler or make_scheduler(generator, config.max_batch, config.max_queue, self.metrics)
        if getattr(self.scheduler, "metrics", None) is None:
            self.scheduler.metrics = self.metrics
        self.metrics.bind(self.scheduler)
        if config.warm_up:
            self.scheduler.warm_up = lambda: generator.warm_up(self.scheduler.capacity)
        self.context = generator.max_length
        self.max_tokens_limit = config.max_tokens_limit or self.context
        drafter = tree_drafter = config.drafter
        if drafter == "auto":  # the library's rule (PolicyStore.auto_drafter), resolved once here
            tree_drafter = generator.policies.auto_drafter("tree")
            drafter = generator.policies.auto_drafter(config.speculation)
            log.info("--drafter auto: %s (trees: %s)", drafter, tree_drafter)
        self.defaults = {"num_draft_tokens": config.num_draft_tokens, "drafter": None if drafter == "none" else drafter,
                         "speculation": config.speculation,
                         "tree_drafter": None if tree_drafter == "none" else tree_drafter}
        self.created = int(time.time())
        # tokenization / chat templates off the event loop, on two threads (a bounded number of
        # threads keeps the process's memory flat: each new thread may get its own malloc arena)
        self.prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specdec-prep")

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    # -- helpers -----------------------------------------------------------------------------------
    async def read_json(self, request: Request) -> Any:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise P.bad("Content-Length is not a number", None, "invalid_body") from None
            if declared > limit:
                raise P.APIError(413, f"the request body has {declared} bytes; this server accepts at most "
                                 f"{limit} (--max-body-bytes)", None, "request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise P.APIError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)", None,
                                     "request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body arrived: nobody to answer; counted as 499
            raise P.APIError(499, "the client closed the connection while sending the body", None,
                             "client_closed") from None
        return P.decode_body(b"".join(chunks))

    def _validate_sampling(self, kwargs: dict) -> None:
        """The checks the runtime makes when the generation starts, made before queueing."""
        from specdec_rt.runtime.core.sampling import SamplingParams

        try:
            t, k, p = self.gen.generation_defaults.resolve(kwargs["temperature"], kwargs["top_k"], kwargs["top_p"],
                                                           None)
            SamplingParams(t, k, p)
        except USER_ERRORS as exc:
            raise P.bad(str(exc), None, "invalid_value") from None
        if kwargs.get("drafter") in NEEDS_DRAFT_MODEL and self.gen.draft_engine is None:
            raise P.bad(f"this bundle has no draft model (drafter '{kwargs['drafter']}' needs one); use "
                        "specdec.drafter 'prompt_lookup', 'suffix' or 'none'", "specdec.drafter", "invalid_value")
        if kwargs.get("drafter") in NEEDS_HEAD and self.gen.head is None:
            raise P.bad("this bundle has no EAGLE-3 head (drafter 'eagle' needs one: specdec-export --draft-head)",
                        "specdec.drafter", "invalid_value")
        if kwargs.get("speculation") == "tree" and kwargs.get("drafter") not in ("model", "eagle"):
            raise P.bad("specdec.speculation 'tree' needs drafter 'model' or 'eagle'", "specdec.speculation",
                        "invalid_value")

    def _prompt_ids(self, req: P.ParsedRequest) -> list[int]:
        """Tokenize / render (runs in a worker thread); the runtime's own prompt checks apply."""
        from specdec_rt.errors import ContextOverflowError

        try:
            if req.kind == "chat":
                ids = self.gen.apply_chat_template(req.messages, tokenize=True, **(req.template_kwargs or {}))
                if not ids:
                    raise P.bad("the chat template rendered this conversation as empty text", "messages")
                prompt = ids
            else:
                prompt = req.prompt
            return self.gen.encode_prompt(prompt)
        except ContextOverflowError as exc:
            raise P.bad(str(exc), "messages" if req.kind == "chat" else "prompt", "context_length_exceeded") from None
        except USER_ERRORS as exc:
            raise P.bad(str(exc), "messages" if req.kind == "chat" else "prompt", "invalid_value") from None

    def submit(self, spec: GenSpec):
        try:
            return self.scheduler.submit(spec)
        except QueueFull as exc:
            raise P.APIError(429, str(exc), None, "queue_full") from None
        except Draining as exc:
            raise P.APIError(503, str(exc), None, "shutting_down") from None

    @staticmethod
    def watch(request: Request, job) -> asyncio.Task:
        """Cancel ``job`` when the client disconnects."""

        async def _watch():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    job.cancel()
                    return

        return asyncio.ensure_future(_watch())

    @staticmethod
    def event_error(event) -> P.APIError:
        return P.APIError(event.status, event.message, None, event.code)

    # -- OpenAI routes -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._openai(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, "chat")

    async def _openai(self, request: Request, kind: str) -> Response:
        body = await self.read_json(request)
        if not isinstance(body, dict):
            raise P.bad("the body must be a JSON object", None, "invalid_body")
        parse = P.parse_chat if kind == "chat" else P.parse_completion
        req = parse(body, self.config.model_name, self.defaults, self.max_tokens_limit, self.config.request_timeout)
        self._validate_sampling(req.gen_kwargs)
        ids = await self.off_loop(self._prompt_ids, req)
        max_tokens = P.resolve_max_tokens(req, len(ids), self.context, self.config.default_max_tokens)
        job = self.submit(GenSpec(ids, {**req.gen_kwargs, "max_new_tokens": max_tokens}, req.timeout))
        watcher = self.watch(request, job)
        events = job.events()
        try:
            first = await events.__anext__()
        except BaseException:
            watcher.cancel()
            job.cancel()
            raise
        if first.kind != "piece":
            watcher.cancel()
            return self._final(req, first)
        if not req.stream:
            try:
                async for event in events:
                    if event.kind != "piece":
                        return self._final(req, event)
            finally:
                watcher.cancel()
                job.cancel()
            raise P.APIError(500, "the generation ended without a result", None, "internal_error")
        writer = P.ChunkWriter(kind, self.config.model_name, req.include_usage)

        async def chunks() -> AsyncIterator[bytes]:
            event = first
            while True:
                if event.kind == "piece":
                    data = writer.piece(event.text)
                    if data:
                        yield data
                elif event.kind == "done":
                    res = event.result
                    yield writer.finish(P.finish_reason(res.finish_reason),
                                        P.usage(len(res.prompt_token_ids), len(res.token_ids), res.stats.cached_prompt_tokens))
                    return
                elif event.kind == "error":
                    yield writer.error(self.event_error(event))
                    return
                else:  # cancelled: the client is gone
                    return
                event = await events.__anext__()

        async def close() -> None:
            watcher.cancel()
            job.cancel()

        return EventStream(chunks(), close)

    def _final(self, req: P.ParsedRequest, event) -> Response:
        if event.kind == "error":
            return error_response(self.event_error(event))
        if event.kind == "cancelled":
            return Response(status_code=499)  # nobody reads it; counted as 499 (client closed)
        res = event.result
        text = res.text if req.stop_given else self.gen.tokenizer.decode(res.token_ids)
        use = P.usage(len(res.prompt_token_ids), len(res.token_ids), res.stats.cached_prompt_tokens)
        finish = P.finish_reason(res.finish_reason)
        if req.stream:  # finished within its first event (e.g. one token): still a stream
            writer = P.ChunkWriter(req.kind, self.config.model_name, req.include_usage)

            async def once():
                yield writer.piece(text) + writer.finish(finish, use)

            async def nothing():
                return None

            return EventStream(once(), nothing)
        return JSONResponse(P.response_body(req.kind, P.new_id(req.kind), int(time.time()), self.config.model_name,
                                            text, finish, use))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.config.model_name:
            return error_response(P.APIError(404, f"the model '{name:.100}' does not exist; this server serves "
                                             f"'{self.config.model_name}'", "model", "model_not_found"))
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "specdec-rt",
                "max_model_len": self.context}

    # -- operations --------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        s = self.scheduler
        draining, warming = s.draining, not s.ready.is_set()
        body = {"status": "draining" if draining else "warming" if warming else "ok", "model": self.config.model_name,
                "queue_depth": s.queue_depth, "running": s.running, "max_queue": self.config.max_queue,
                "max_batch": s.capacity,
                "max_length": self.context, "has_draft": self.gen.draft_engine is not None, "pid": os.getpid(),
                **self.config.info}
        return JSONResponse(body, status_code=503 if draining or warming else 200)

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- the deprecated /generate route (body and answers of the old stdlib server) ---------------------
    async def generate(self, request: Request) -> Response:
        def legacy_error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": P.encodable(message)}, status_code=status)

        try:
            body = await self.read_json(request)
            args = parse_request(body, self.max_tokens_limit)
        except P.APIError as exc:
            return legacy_error(exc.status, exc.message)
        except RequestError as exc:
            return legacy_error(400, str(exc))
        stream = args.pop("stream")
        prompt = args.pop("prompt")
        if args["drafter"] == "default":
            args["drafter"] = P.server_drafter(self.defaults, args.get("speculation"))
        try:
            ids = await self.off_loop(self.gen.encode_prompt, prompt)
            job = self.submit(GenSpec(ids, args, self.config.request_timeout))
        except USER_ERRORS as exc:
            return legacy_error(400, str(exc))
        except P.APIError as exc:
            return legacy_error(exc.status, exc.message)
        watcher = self.watch(request, job)
        events = job.events()
        pieces: list[str] = []

        def final(event) -> Response | bytes:
            if event.kind == "error":
                return legacy_error(event.status, event.message)
            if event.kind == "cancelled":
                return Response(status_code=499)
            res = event.result
            if not stream and not args.get("stop"):
                res.text = self.gen.tokenizer.decode(res.token_ids)
            return JSONResponse(res.to_dict())

        try:
            first = await events.__anext__()
        except BaseException:
            watcher.cancel()
            job.cancel()
            raise
        if first.kind != "piece" or not stream:
            try:
                event = first
                while event.kind == "piece":
                    event = await events.__anext__()
                return final(event)
            finally:
                watcher.cancel()
                job.cancel()

        def sse(obj: dict) -> bytes:
            return f"data: {json.dumps(obj)}\n\n".encode()

        async def chunks() -> AsyncIterator[bytes]:
            event = first
            while True:
                if event.kind == "piece":
                    if event.text:
                        pieces.append(event.text)
                        yield sse({"text": event.text})
                elif event.kind == "done":
                    yield sse({"done": True, **event.result.to_dict()})
                    return
                elif event.kind == "error":
                    yield sse({"error": event.message})
                    return
                else:
                    return
                event = await events.__anext__()

        async def close() -> None:
            watcher.cancel()
            job.cancel()

        return EventStream(chunks(), close)


def create_app(generator, config: ServerConfig | None = None, scheduler=None) -> Starlette:
    """The ASGI app serving ``generator``. ``app.state.api`` holds the handlers, the scheduler and the
    metrics; the lifespan starts the scheduler's worker and drains it on shutdown."""
    config = config or ServerConfig()
    if config.metrics_requires_key and config.api_keys is None:
        raise ServerConfigError("metrics_requires_key needs API keys (ServerConfig.api_keys)")
    api = SpecdecAPI(generator, config, scheduler)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        api.scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(api.scheduler.close, config.drain_timeout)
            api.prep.shutdown(wait=False)

    async def on_api_error(request: Request, exc: P.APIError) -> Response:
        return error_response(exc)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}; routes: {', '.join(ROUTES)}"
        elif exc.status_code == 405:
            msg = f"{request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return error_response(P.APIError(exc.status_code, msg, None, None))

    async def on_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(P.APIError(500, f"internal error ({type(exc).__name__}); see the server log",
                                         None, "internal_error"))

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_route, methods=["GET"]),
        Route("/generate", api.generate, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={P.APIError: on_api_error, HTTPException: on_http_error, Exception: on_error})
    if config.api_keys is not None:  # inside the metrics middleware: 401s are counted too
        open_paths = {"/health"} if config.metrics_requires_key else {"/health", "/metrics"}
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys, open_paths=open_paths)
    app.add_middleware(MetricsMiddleware, metrics=api.metrics)
    app.state.api = api
    return app
