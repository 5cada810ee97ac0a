"""Scale-out on Ray Serve: N replicas of the same ASGI app behind Ray's HTTP proxy (``[ray]`` extra).

Each replica is a process with its own :class:`~specdec_rt.runtime.api.generator.Generator` (its own
KV cache, its own queue) running :func:`specdec_rt.serving.create_app`, so the routes, request
fields, errors and streaming are those of ``specdec-serve``; Ray's proxy spreads requests over the
replicas and streams the answers back.

    python -m specdec_rt.serve_ray --bundle DIR --replicas 2 --host 127.0.0.1 --port 8000

or from Python, on a running Ray cluster::

    from ray import serve
    from specdec_rt.serve_ray import build_app
    serve.run(build_app("bundle", num_replicas=2), route_prefix="/")

Each replica applies its own queue limit (429 beyond it) and metrics: ``GET /metrics`` through the
proxy answers for whichever replica it reaches, so scrape replicas directly or use Ray's
``ray_serve_*`` metrics for the fleet (docs/serving.md).

API keys (``--api-key``, ``--api-key-file``, ``SPECDEC_API_KEY``, ``--metrics-requires-key``) are
checked in each replica, as in ``specdec-serve`` (``ServerConfig.api_keys`` holds digests only, so
no key travels to the replicas); TLS (``--ssl-keyfile`` / ``--ssl-certfile``) is terminated by Ray's
HTTP proxy (``serve.start(http_options=...)``), the replicas behind it speak plain HTTP inside the
cluster.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def _build_asgi(settings: dict[str, Any]):
    """Run in each replica: load the bundle and build the app."""
    import specdec_rt
    from specdec_rt.runtime.engines.sessions import enable_shared_thread_pool
    from specdec_rt.serving.app import create_app
    from specdec_rt.serving.cli import limit_malloc_arenas

    limit_malloc_arenas(settings["malloc_arenas"])
    enable_shared_thread_pool(settings["threads"])
    gen = specdec_rt.load(settings["bundle"], provider=settings["provider"],
                          draft_provider=settings["draft_provider"], threads=settings["threads"],
                          max_context=settings["max_context"], shared_thread_pool=True)
    return create_app(gen, settings["config"])


def build_app(bundle: str | Path, num_replicas: int = 2, config=None, provider: str = "cpu",
              draft_provider: str | None = None, threads: int | None = 1, max_context: int | None = None,
              replica_cpus: float | None = None, name: str = "specdec", malloc_arenas: int = 1):
    """A Ray Serve application (``serve.run(build_app(...))``) of ``num_replicas`` replicas.

    ``config``: a :class:`~specdec_rt.serving.app.ServerConfig` (default: the server's defaults,
    model named after the bundle directory). ``replica_cpus``: CPUs Ray reserves per replica
    (default ``threads`` or 1). Each replica accepts ``config.max_queue + 1`` requests at a time;
    further requests wait in Ray's router.
    """
    from ray import serve

    from specdec_rt.serving.app import ServerConfig

    bundle = str(Path(bundle).resolve())
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    config = config or ServerConfig(model_name=Path(bundle).name)
    settings = {"bundle": bundle, "provider": provider, "draft_provider": draft_provider, "threads": threads,
                "max_context": max_context, "config": config, "malloc_arenas": malloc_arenas}

    def build():
        return _build_asgi(settings)

    deployment = serve.deployment(
        serve.ingress(build)(), name=name, num_replicas=num_replicas,
        max_ongoing_requests=config.max_queue + 1,
        ray_actor_options={"num_cpus": replica_cpus if replica_cpus is not None else (threads or 1)})
    return deployment.bind()


def main(argv: list[str] | None = None) -> int:
    from specdec_rt.errors import ServerConfigError
    from specdec_rt.serving.cli import build_parser, config_from_args, security_options, warn_if_open

    ap = build_parser("python -m specdec_rt.serve_ray")
    ap.description = "Serve a bundle with N replicas on Ray Serve (same routes as specdec-serve)."
    g = ap.add_argument_group("ray")
    g.add_argument("--replicas", type=int, default=2, help="replicas (processes), each with its own engine")
    g.add_argument("--replica-cpus", type=float, default=None, help="CPUs Ray reserves per replica "
                   "(default: --threads or 1)")
    g.add_argument("--ray-address", default=None, help="an existing cluster (e.g. auto); default: start a "
                   "local Ray instance")
    args = ap.parse_args(argv)
    try:
        api_keys = security_options(args, ap)
    except ServerConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    warn_if_open(args.host, api_keys)
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        print(f"error: Ray Serve is not installed (pip install 'specdec-rt[ray]'): {exc}", file=sys.stderr)
        return 1
    bundle = Path(args.bundle)
    if not (bundle / "manifest.json").is_file():
        print(f"error: {bundle} is not a bundle (no manifest.json)", file=sys.stderr)
        return 1
    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        ray.init(include_dashboard=False, _node_ip_address=args.host if args.host != "0.0.0.0" else None)
    tls = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile} if args.ssl_certfile else {}
    serve.start(http_options={"host": args.host, "port": args.port, **tls})
    app = build_app(bundle, args.replicas, config_from_args(args, bundle, api_keys), args.provider,
                    args.draft_provider, args.threads or 1, args.max_context, args.replica_cpus,
                    malloc_arenas=args.malloc_arenas)
    print(f"specdec-rt on Ray Serve: {args.replicas} replicas of {bundle} on {'https' if tls else 'http'}://"
          f"{args.host}:{args.port} ({len(api_keys) if api_keys else 'no'} API key(s))", flush=True)
    try:
        serve.run(app, name="specdec", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
