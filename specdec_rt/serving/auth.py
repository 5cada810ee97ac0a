"""API keys: where the server's keys come from, and the check a request passes before any route.

Keys come from ``--api-key`` (repeatable), ``--api-key-file`` (one key a line; blank lines and
lines starting with ``#`` are ignored) and the ``SPECDEC_API_KEY`` environment variable: the
server accepts the union of all given. A request passes when its ``Authorization: Bearer <key>``
header carries one of them (vLLM's and llama.cpp's convention; the openai client's ``api_key``).

Only SHA-256 digests of the keys are kept, so a repr, a log line, a config pickled to a Ray
replica or a memory dump never holds a key; the digest of the presented key is compared with every
key's digest by :func:`hmac.compare_digest`, all of them every time: the time taken tells neither
how much of a key matched nor which key.

Open without a key: ``/health`` (load balancers' probes) and, unless ``metrics_requires_key``,
``/metrics``; every other path (``/v1/*``, ``/generate``, unknown paths) answers 401 with an
OpenAI-style error body and ``WWW-Authenticate: Bearer``, before its body is read.
"""
from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Collection, Iterable, Mapping

from starlette.responses import JSONResponse

from specdec_rt.errors import ServerConfigError
from specdec_rt.serving.protocol import APIError

ENV_VAR = "SPECDEC_API_KEY"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class APIKeys:
    """The accepted keys, as digests; :meth:`accepts` checks an ``Authorization`` header."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(dict.fromkeys(_digest(check_key(k, "APIKeys").encode()) for k in keys))
        if not self._digests:
            raise ServerConfigError("no API key given")

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"APIKeys({len(self)} key(s))"

    def accepts(self, authorization: bytes | None) -> bool:
        """Whether the header is ``Bearer <one of the keys>`` (scheme case-insensitive)."""
        token = bearer_token(authorization)
        presented = _digest(token or b"")
        match = False
        for digest in self._digests:  # no early exit: the same work whichever key matches
            match |= hmac.compare_digest(presented, digest)
        return match and token is not None


def bearer_token(authorization: bytes | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def check_key(key: str, where: str) -> str:
    """``key`` if it can travel in an HTTP header: visible ASCII, no spaces (the message names
    the source, never the key)."""
    if not key:
        raise ServerConfigError(f"an empty API key ({where})")
    if not all("!" <= ch <= "~" for ch in key):
        raise ServerConfigError(f"an API key holds a space or a character other than visible ASCII ({where}); "
                                "keys travel in the Authorization header")
    return key


def read_key_file(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ServerConfigError(f"cannot read --api-key-file {path}: {reason}") from None
    keys = [check_key(line.strip(), f"--api-key-file {path}, line {i}")
            for i, line in enumerate(text.splitlines(), 1) if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ServerConfigError(f"--api-key-file {path} holds no key (one key a line; blank lines and lines "
                                "starting with # are ignored)")
    return keys


def load_api_keys(flags: Iterable[str] | None = None, key_file: str | None = None,
                  env: Mapping[str, str] | None = None) -> APIKeys | None:
    """The union of the keys of ``--api-key`` flags, ``--api-key-file`` and ``SPECDEC_API_KEY`` (in
    ``env``; unset or empty: none), or None when there are none: the server is open."""
    keys = [check_key(k, "--api-key") for k in flags or ()]
    if key_file is not None:
        keys += read_key_file(key_file)
    from_env = (env or {}).get(ENV_VAR, "").strip()
    if from_env:
        keys.append(check_key(from_env, ENV_VAR))
    return APIKeys(keys) if keys else None


def route_path(scope) -> str:
    """The path the router matches: ``path`` less the ``root_path`` a proxy mounted the app under."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


class APIKeyMiddleware:
    """ASGI middleware: 401 unless the path is open or the request carries a key, answered before
    the route runs (so before the body of an unauthenticated request is read)."""

    def __init__(self, app, keys: APIKeys, open_paths: Collection[str]) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or route_path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if self.keys.accepts(header):
            await self.app(scope, receive, send)
            return
        if header is None:
            err = APIError(401, "this server needs an API key: send 'Authorization: Bearer <key>' (the openai "
                           "client's api_key)", None, "missing_api_key")
        else:
            err = APIError(401, "the API key is not valid for this server (expected 'Authorization: Bearer <key>' "
                           "with one of its keys)", None, "invalid_api_key")
        response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
