"""A small stdlib-only HTTP server around one loaded bundle (``python -m specdec_rt.server``).

**Deprecated**: use ``specdec-serve`` (:mod:`specdec_rt.serving`, the ``[server]`` extra): the OpenAI
API, streaming, metrics, a bounded queue, cancellation and graceful shutdown. It serves this
module's ``POST /generate`` too (same body and answers), so existing clients keep working. This
module stays for installs without the extra.

Why stdlib: a Jetson deployment installs numpy, onnxruntime, tokenizers and jinja2 and nothing else.
One :class:`Generator` owns one KV cache per model, so generations are serialized by a lock;
requests queue on it (``ThreadingHTTPServer`` keeps /health answering meanwhile).

* ``GET /health`` -> ``{"status": "ok", "provider", "draft_provider", "max_length", "has_draft"}``
* ``POST /generate`` JSON ``{prompt, max_new_tokens, temperature, top_k, top_p, do_sample, seed,
  num_draft_tokens, drafter, stop, stream}`` -> ``{text, token_ids, stats, finish_reason}``;
  sampling fields left out take the bundle's ``generation_config.json`` defaults (greedy if none);
  with ``"stream": true`` a chunked ``text/event-stream``: ``data: {"text": piece}`` events, then
  ``data: {"done": true, token_ids, stats, finish_reason}``.
* Bad input -> 400 ``{"error": message}`` (the runtime's user errors and the checks below).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from specdec_rt.errors import USER_ERRORS

MAX_BODY = 1 << 20

# field -> (accepted types, default); None means "use the generator's default"
FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "prompt": ((str, list), None),
    "max_new_tokens": ((int,), 128),
    "temperature": ((int, float, type(None)), None),  # None: the bundle's generation_config default
    "top_k": ((int, type(None)), None),
    "top_p": ((int, float, type(None)), None),
    "do_sample": ((bool, type(None)), None),
    "seed": ((int, type(None)), None),
    "num_draft_tokens": ((int, str), 4),
    "drafter": ((str, type(None)), "default"),
    "speculation": ((str,), "chain"),
    "stop": ((str, list, type(None)), None),
    "ignore_eos": ((bool,), False),
    "stream": ((bool,), False),
}


class RequestError(ValueError):
    """The request body is malformed; answered with 400."""


def parse_request(body: bytes, max_new_tokens_limit: int) -> dict:
    """Validate a /generate body into keyword arguments for ``Generator.stream``."""
    try:
        req = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"body is not valid JSON: {exc}") from None
    if not isinstance(req, dict):
        raise RequestError("body must be a JSON object")
    unknown = sorted(set(req) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s): {', '.join(unknown)}; accepted: {', '.join(FIELDS)}")
    if "prompt" not in req:
        raise RequestError("'prompt' is required (a string or a list of token ids)")
    out = {}
    for name, (types, default) in FIELDS.items():
        value = req.get(name, default)
        # bool is an int subclass: only accept it where bool is meant
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise RequestError(f"'{name}' has the wrong type ({type(value).__name__})")
        out[name] = value
    if isinstance(out["prompt"], list) and not all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in out["prompt"]):
        raise RequestError("'prompt' as a list must hold integer token ids")
    if isinstance(out["stop"], list) and not all(isinstance(s, str) for s in out["stop"]):
        raise RequestError("'stop' must be a string or a list of strings")
    if isinstance(out["num_draft_tokens"], str) and out["num_draft_tokens"] != "auto":
        raise RequestError("'num_draft_tokens' must be an integer or 'auto'")
    if out["max_new_tokens"] > max_new_tokens_limit:
        raise RequestError(f"'max_new_tokens' is limited to {max_new_tokens_limit} by this server")
    return out


class SpecdecServer(ThreadingHTTPServer):
    """Holds the generator and the lock that serializes generations."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], generator, max_new_tokens_limit: int = 2048,
                 info: dict | None = None) -> None:
        super().__init__(address, Handler)
        self.generator = generator
        self.lock = threading.Lock()
        self.max_new_tokens_limit = max_new_tokens_limit
        self.info = info or {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked streaming needs 1.1
    server: SpecdecServer

    def log_message(self, fmt: str, *args) -> None:  # quiet by default; errors still reach stderr
        pass

    def _json(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        if self.path.rstrip("/") == "/health":
            gen = self.server.generator
            self._json(200, {"status": "ok", "max_length": gen.max_length,
                             "has_draft": gen.draft_engine is not None, **self.server.info})
        else:
            self._json(404, {"error": f"no route GET {self.path}; try GET /health or POST /generate"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/generate":
            self._json(404, {"error": f"no route POST {self.path}; try POST /generate"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True
            self._json(413 if length > MAX_BODY else 400, {"error": f"body must be 0..{MAX_BODY} bytes with a Content-Length"})
            return
        try:
            args = parse_request(self.rfile.read(length), self.server.max_new_tokens_limit)
        except RequestError as exc:
            self._json(400, {"error": str(exc)})
            return
        stream = args.pop("stream")
        if args["drafter"] == "default":
            args["drafter"] = "model" if self.server.generator.draft_engine is not None else None
        with self.server.lock:
            self._generate(args, stream)

    def _generate(self, args: dict, stream: bool) -> None:
        from specdec_rt.runtime.generator import GenerationResult, GenerationStats

        gen = self.server.generator
        result = GenerationResult("", [], GenerationStats())
        pieces = gen.stream(result=result, **args)
        try:  # arguments are checked when the generator starts: pull the first piece before replying
            first = next(pieces, None)
        except USER_ERRORS as exc:
            self._json(400, {"error": str(exc)})
            return
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            self._json(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        if not stream:
            for _ in pieces:
                pass
            if not args.get("stop"):
                result.text = gen.tokenizer.decode(result.token_ids)
            self._json(200, result.to_dict())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if first is not None:
                self._event({"text": first})
            for piece in pieces:
                self._event({"text": piece})
            self._event({"done": True, **result.to_dict()})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        except Exception as exc:  # noqa: BLE001 - headers are out: report in-band
            self._event({"error": f"{type(exc).__name__}: {exc}"})
        self.wfile.write(b"0\r\n\r\n")

    def _event(self, obj: dict) -> None:
        data = f"data: {json.dumps(obj)}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def make_server(bundle: str, host: str = "127.0.0.1", port: int = 8000, provider: str = "cpu",
                draft_provider: str | None = None, threads: int | None = None,
                max_length: int | None = None, max_new_tokens_limit: int = 2048) -> SpecdecServer:
    """Load the bundle and bind the server (port 0 picks a free port)."""
    import specdec_rt

    gen = specdec_rt.load(bundle, provider=provider, draft_provider=draft_provider, threads=threads,
                          max_length=max_length)
    info = {"provider": provider, "draft_provider": draft_provider or provider}
    return SpecdecServer((host, port), gen, max_new_tokens_limit, info)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec_rt.server",
                                 description="Serve a specdec-rt bundle over HTTP (stdlib only; deprecated: "
                                 "use specdec-serve).")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--provider", default="cpu", help="cpu | cuda | tensorrt | trt")
    ap.add_argument("--draft-provider", default=None, help="provider for the draft (default: --provider)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-context", "--max-length", dest="max_length", type=int, default=None,
                    help="positions to preallocate K/V for (default: the bundle's context, at most 4096)")
    ap.add_argument("--max-new-tokens-limit", type=int, default=2048)
    args = ap.parse_args(argv)
    try:
        from specdec_rt.runtime.engine import enable_shared_thread_pool

        enable_shared_thread_pool(args.threads)  # a dedicated process: share one ORT thread pool
        server = make_server(args.bundle, args.host, args.port, args.provider, args.draft_provider,
                             args.threads, args.max_length, args.max_new_tokens_limit)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    print("note: python -m specdec_rt.server is deprecated; specdec-serve (pip install 'specdec-rt[server]') "
          "serves the OpenAI API and the same POST /generate", file=sys.stderr)
    print(f"specdec-rt serving {args.bundle} on http://{host}:{port} ({args.provider})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
