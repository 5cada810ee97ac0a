"""The body of the deprecated ``POST /generate`` route (standard library only).

The route of the old stdlib server (``python -m specdec_rt.server``, removed), kept in
``specdec-serve`` with the same body and answers for existing clients:

* JSON ``{prompt, max_new_tokens, temperature, top_k, top_p, do_sample, seed, num_draft_tokens,
  drafter, speculation, stop, ignore_eos, stream}`` -> ``{text, token_ids, stats, finish_reason}``;
  sampling fields left out take the bundle's ``generation_config.json`` defaults (greedy if none);
  ``drafter`` left out (``"default"``) is the server's default drafter;
* with ``"stream": true``: ``text/event-stream`` events ``data: {"text": piece}``, then
  ``data: {"done": true, text, token_ids, stats, finish_reason}``;
* bad input -> 400 ``{"error": message}``.

The route itself is :meth:`specdec_rt.serving.app.SpecdecAPI.generate`; this module checks bodies.
"""
from __future__ import annotations

from typing import Any

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


def parse_request(req: Any, max_new_tokens_limit: int) -> dict:
    """Validate a decoded /generate body into keyword arguments for ``Generator.stream`` (with
    ``prompt`` and ``stream``); the runtime checks the values when the generation starts."""
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
    for name in ("temperature", "top_p"):  # floats, checked here as the OpenAI routes' get_float does:
        if out[name] is not None:          # an integer beyond float's range is a 400 before it is queued
            try:
                out[name] = float(out[name])
            except OverflowError:
                raise RequestError(f"'{name}' must be a finite number") from None
    if out["max_new_tokens"] > max_new_tokens_limit:
        raise RequestError(f"'max_new_tokens' is limited to {max_new_tokens_limit} by this server")
    return out
