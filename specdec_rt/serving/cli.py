"""``specdec-serve``: the OpenAI-compatible server on uvicorn (``python -m specdec_rt.serving``).

SIGTERM / SIGINT drain: the app starts answering 503 to new requests and ``/health`` (so a load
balancer stops sending), uvicorn stops accepting connections, running and queued requests finish
(at most ``--drain-timeout`` seconds, then they are cancelled), and the process exits with status 0.
A second SIGINT forces the exit.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import ssl
import sys
from pathlib import Path

from specdec_rt.cli.common import bounded_int, draft_tokens_arg, positive_int
from specdec_rt.errors import USER_ERRORS, ServerConfigError


def _timeout(value: str) -> float | None:
    t = float(value)
    return None if t <= 0 else t


def limit_malloc_arenas(n: int) -> bool:
    """glibc's ``mallopt(M_ARENA_MAX, n)``: cap the malloc arenas the process's threads spread over.

    With glibc's default (8 per core) the server's RSS creeps up under load (the event loop thread,
    the generation worker and the tokenizer threads each fragment their own arenas): measured on
    the tiny test pair, 200-request rounds took RSS 114 -> 121 MiB over 6 rounds with the default,
    and 103 -> 106 MiB, flat from the third round, with one arena, at the same tokens/s (the
    threads allocate mostly under the GIL). Linux / glibc only; elsewhere nothing happens.
    """
    if n <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL(None).mallopt(-8, n))  # -8: M_ARENA_MAX
    except (OSError, AttributeError):
        return False


def build_parser(prog: str = "specdec-serve") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Serve a specdec-rt bundle with the OpenAI API "
                                 "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).")
    ap.add_argument("--bundle", required=True, help="bundle directory (specdec-export --out)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    ap.add_argument("--port", type=bounded_int(0, 65535), default=8000, help="0 picks a free port")
    ap.add_argument("--served-model-name", default=None, help="the 'model' clients send (default: the bundle's "
                    "directory name)")
    g = ap.add_argument_group("engine")
    g.add_argument("--provider", default="cpu", help="cpu | cuda | tensorrt | trt")
    g.add_argument("--draft-provider", default=None, help="provider for the draft (default: --provider)")
    g.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    g.add_argument("--max-context", "--max-length", dest="max_context", type=int, default=None,
                   help="positions to preallocate K/V for (default: the bundle's context, at most 4096)")
    g = ap.add_argument_group("speculation defaults (a request overrides them in its 'specdec' field)")
    g.add_argument("--num-draft-tokens", type=draft_tokens_arg, default="auto", help="0..64 or auto (default auto)")
    g.add_argument("--drafter", default="auto",
                   choices=("auto", "model", "prompt_lookup", "hybrid", "suffix", "suffix_hybrid", "eagle", "none"),
                   help="auto (default): what the library picks, resolved at start on this machine: the draft "
                        "model or EAGLE-3 head, whichever drafts a token for less, where that is cheap against a "
                        "target step; else suffix matching with the draft model where it has no match "
                        "(suffix_hybrid), or suffix matching alone beside a dear draft or none (docs/design.md "
                        "'Choosing the drafter'); eagle: the head (specdec-export --draft-head); hybrid: prompt lookup where it "
                        "matches, else the draft model; suffix: suffix-tree drafting over the request (and the "
                        "--suffix-pool); suffix_hybrid: suffix where its match is strong, else the draft model")
    g.add_argument("--prefix-cache", default="shared", choices=("off", "per-user", "shared"),
                   help="a request whose prompt starts with what a cache sequence still holds (a chat's "
                        "earlier turns) keeps that K/V and prefills the rest, where a load-time probe finds it "
                        "bit-exact. per-user: only between requests of the same 'user' (a hit shows in the "
                        "time to first token); off: prefill every prompt whole (default shared)")
    g.add_argument("--suffix-pool", default="off", choices=("off", "per-user", "shared"),
                   help="let the suffix drafters match earlier requests' outputs: per-user (one pool per request "
                        "'user', none without one) or shared (one pool for all: a single-tenant server). "
                        "Proposals only: outputs stay exact (default off)")
    g.add_argument("--suffix-pool-tokens", type=positive_int, default=200_000,
                   help="tokens the suffix pool holds, oldest requests evicted first (default 200000)")
    g.add_argument("--speculation", default="chain", choices=("chain", "tree"))
    g.add_argument("--overlap", action="store_true", help="draft the next block while the target verifies "
                   "(chains; the models get their own thread pools instead of one shared pool); same output")
    g = ap.add_argument_group("limits")
    g.add_argument("--max-batch", type=positive_int, default=None, help="requests decoding at once as rows of one "
                   "batched generation (continuous batching); 1: one at a time (serial). Default: 8 on the CPU "
                   "provider, serial on GPU providers (batched calls are CPU-only)")
    g.add_argument("--max-queue", type=bounded_int(0), default=64, help="requests waiting beyond the running ones; more "
                   "are answered 429 (default 64)")
    g.add_argument("--request-timeout", type=_timeout, default=600.0, help="per-request deadline in seconds, "
                   "queue wait included (0: none; default 600); a request may ask for less")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413 (default 1 MiB)")
    g.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens when a request gives none (capped by the room left in the context)")
    g.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted "
                   "(default: the context)")
    g.add_argument("--drain-timeout", type=float, default=60.0, help="seconds SIGTERM waits for running and "
                   "queued requests before cancelling them (default 60)")
    g = ap.add_argument_group("operations")
    g.add_argument("--metrics-prefix", default="specdec", help="prefix of the Prometheus series (vllm: "
                   "dashboards built for vLLM read them unchanged)")
    g.add_argument("--malloc-arenas", type=int, default=1, help="cap glibc malloc arenas (keeps RSS flat under "
                   "load; 0: glibc's default)")
    g.add_argument("--no-warm-up", action="store_true", help="answer /health with 200 at once instead of "
                   "after the warm-up (cost model of 'auto' for every batch width, first call of every "
                   "decoding path; ~0.3 s on the reference pair once the cost model is cached on disk)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    g.add_argument("--access-log", action="store_true", help="log every request (method, path, status: "
                   "never headers, so never a key)")
    g = ap.add_argument_group("security (docs/serving.md, 'Exposing the server')")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (the openai client's api_key) on every route but "
                        "/health and /metrics; repeatable. The process list shows it to other users of the "
                        "machine: prefer --api-key-file or the SPECDEC_API_KEY environment variable. Keys of "
                        "the flags, the file and the variable all count")
    g.add_argument("--api-key-file", metavar="FILE", help="keys, one a line (blank lines and lines starting with "
                   "# ignored); a missing or empty file is an error")
    g.add_argument("--metrics-requires-key", action="store_true", help="/metrics needs a key too (default: open "
                   "like /health, for scrapers on a trusted network; Prometheus can send one: "
                   "authorization.credentials_file)")
    g.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS: the private key (PEM, unencrypted); "
                   "with --ssl-certfile")
    g.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS: the certificate chain (PEM); "
                   "with --ssl-keyfile")
    return ap


def security_options(args, ap: argparse.ArgumentParser, env=os.environ):
    """The API keys (or None) from the flags, the key file and ``SPECDEC_API_KEY``, after checking
    the key and TLS options: called before the model loads, so a typo costs no load time.
    Combinations are usage errors (exit 2); unusable files raise ServerConfigError."""
    from specdec_rt.serving.auth import load_api_keys

    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        ap.error("--ssl-keyfile and --ssl-certfile go together")
    keys = load_api_keys(args.api_key, args.api_key_file, env)
    if args.metrics_requires_key and keys is None:
        ap.error("--metrics-requires-key needs a key (--api-key, --api-key-file or SPECDEC_API_KEY)")
    if args.ssl_certfile:
        check_tls_files(args.ssl_certfile, args.ssl_keyfile)
    return keys


def check_tls_files(certfile: str, keyfile: str) -> None:
    """Load the pair the way uvicorn will, so that an unreadable file, a key that does not match
    the certificate or an encrypted key (OpenSSL would prompt on the terminal) is one line now."""
    def no_password():
        raise ServerConfigError(f"--ssl-keyfile {keyfile} is encrypted; give an unencrypted key "
                                "(readable only by the server's user)")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile, password=no_password)
    except OSError as exc:
        if isinstance(exc, ssl.SSLError):
            raise ServerConfigError(f"--ssl-certfile {certfile} and --ssl-keyfile {keyfile} do not load as a "
                                    f"PEM certificate chain and its private key ({exc.reason or exc})") from None
        raise ServerConfigError(f"cannot read {exc.filename or 'the TLS files'}: {exc.strerror}") from None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def config_from_args(args, bundle: Path, api_keys=None):
    from specdec_rt.serving.app import ServerConfig

    return ServerConfig(
        model_name=args.served_model_name or bundle.resolve().name, num_draft_tokens=args.num_draft_tokens,
        drafter=args.drafter, speculation=args.speculation, max_queue=args.max_queue, max_batch=args.max_batch,
        request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens, max_tokens_limit=args.max_tokens_limit,
        metrics_prefix=args.metrics_prefix, drain_timeout=args.drain_timeout, warm_up=not args.no_warm_up,
        info={"provider": args.provider, "draft_provider": args.draft_provider or args.provider},
        api_keys=api_keys, metrics_requires_key=args.metrics_requires_key)


def main(argv: list[str] | None = None, prog: str = "specdec-serve") -> int:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    try:
        import uvicorn

        from specdec_rt.serving.app import create_app
    except ImportError as exc:
        print(f"error: the server needs the [server] extra (pip install 'specdec-rt[server]'): {exc}",
              file=sys.stderr)
        return 1
    try:
        api_keys = security_options(args, ap)
    except ServerConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    warn_if_open(args.host, api_keys)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    limit_malloc_arenas(args.malloc_arenas)  # before ONNX Runtime and the server start threads
    bundle = Path(args.bundle)
    try:
        import specdec_rt
        from specdec_rt.runtime.engines.sessions import enable_shared_thread_pool

        if not args.overlap:  # overlapped decoding wants the models on their own pools
            enable_shared_thread_pool(args.threads)  # a dedicated process: share one ORT thread pool
        gen = specdec_rt.load(bundle, provider=args.provider, draft_provider=args.draft_provider,
                              threads=args.threads, max_context=args.max_context,
                              shared_thread_pool=not args.overlap, overlap=args.overlap,
                              max_batch=args.max_batch if args.max_batch and args.max_batch > 1 else None,
                              suffix_pool=None if args.suffix_pool == "off" else specdec_rt.SuffixPool(
                                  args.suffix_pool_tokens, per_user=args.suffix_pool == "per-user"),
                              prefix_cache={"off": False, "shared": True}.get(args.prefix_cache, args.prefix_cache))
        config = config_from_args(args, bundle, api_keys)
        app = create_app(gen, config)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:  # bind first: the printed address is the real one (port 0 picks a free port)
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them (not refused)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    uv_config = uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log,
                               timeout_graceful_shutdown=args.drain_timeout, lifespan="on",
                               ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    server = draining_server_class()(uv_config, on_drain=app.state.api.scheduler.begin_drain)
    rows = app.state.api.scheduler.capacity
    keys = f"{len(api_keys)} API key(s)" if api_keys else "no API key"
    print(f"specdec-rt serving {bundle} as '{config.model_name}' on {'https' if args.ssl_certfile else 'http'}://"
          f"{host}:{port} ({args.provider}, {f'batches of up to {rows} rows' if rows > 1 else 'serial'}, {keys}); "
          "OpenAI base URL: /v1", flush=True)
    server.run(sockets=[sock])
    return 0


def warn_if_open(host: str, api_keys) -> None:
    """One line on stderr when a non-loopback address is served without a key."""
    if api_keys is None and not is_loopback(host):
        print(f"warning: serving on {host} without an API key: anyone who can reach this port can generate; "
              "set --api-key-file or SPECDEC_API_KEY (docs/serving.md, 'Exposing the server')", file=sys.stderr,
              flush=True)


def draining_server_class():
    """uvicorn.Server with drain-on-signal (built lazily: uvicorn is the [server] extra)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, telling the app to refuse new work as soon as a signal arrives; it exits
        with status 0 after draining instead of re-raising the signal."""

        def __init__(self, config, on_drain=None) -> None:
            super().__init__(config)
            self.on_drain = on_drain

        def handle_exit(self, sig, frame) -> None:
            if self.on_drain is not None:
                self.on_drain()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    return DrainingServer


if __name__ == "__main__":
    sys.exit(main())
