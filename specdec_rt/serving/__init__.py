"""The OpenAI-compatible server (``specdec-serve``; needs the ``[server]`` extra).

* :mod:`.scheduler`: the bounded queue and the worker in front of one generator (stdlib only);
* :mod:`.protocol`: OpenAI request validation and response / chunk bodies (stdlib only);
* :mod:`.metrics`: Prometheus series named after vLLM's (prometheus-client);
* :mod:`.auth`: API keys (sources, digests, the 401 middleware);
* :mod:`.app`: the Starlette application, :func:`create_app`;
* :mod:`.cli`: ``specdec-serve`` on uvicorn (TLS, keys), draining on SIGTERM;
* :mod:`.loadtest`: the load / fault test behind docs/serving.md's figures.

Scale-out over several processes or machines: :mod:`specdec_rt.serve_ray`.
"""
from __future__ import annotations

__all__ = ["create_app", "ServerConfig"]


def __getattr__(name: str):
    if name in __all__:
        from specdec_rt.serving import app

        return getattr(app, name)
    raise AttributeError(f"module 'specdec_rt.serving' has no attribute {name!r}")
