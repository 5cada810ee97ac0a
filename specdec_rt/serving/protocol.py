"""The OpenAI wire format: request validation and response / chunk bodies (standard library only).

Requests are checked field by field before anything is queued, so a bad body is answered at
once with a 4xx and an OpenAI-style error body ``{"error": {"message", "type", "param",
"code"}}`` naming the field. Fields the server cannot honour are refused, not ignored (``n`` other
than 1, ``logprobs``, penalties, tools...); a few that change nothing here (``metadata``,
``store``, ``service_tier``, ``parallel_tool_calls``) are accepted and ignored. ``user`` selects
the request's suffix pool (``--suffix-pool per-user``) and changes nothing else.

Extensions (vLLM's names where vLLM has them): ``top_k`` (0 or -1: off), ``ignore_eos``,
``chat_template_kwargs`` (chat), and ``specdec``: ``{"num_draft_tokens": 0..64 | "auto",
"drafter": "model" | "prompt_lookup" | "hybrid" | "suffix" | "suffix_hybrid" | "eagle" | "none", "speculation": "chain" | "tree", "timeout": s}``
overriding the server's defaults for one request.

``null`` for an optional field, ``specdec``'s included, means the field was left out, as in
OpenAI's API (its schema marks them nullable): the default applies. Target-only decoding is
``"drafter": "none"``, never ``null``.
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdec_rt.runtime.drafters import names as drafter_names

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "internal_error", 503: "service_unavailable_error", 504: "timeout_error"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
DRAFTERS = (*drafter_names.DRAFTERS, "none")
SPECULATION = drafter_names.SPECULATIONS
MAX_STOP = 16
MAX_SEED = 2 ** 63


class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        """The error object; message and param may echo request text, so they are made encodable
        here, once for every renderer (JSON responses, in-band stream errors, /generate)."""
        return {"error": {"message": encodable(self.message), "type": self.type,
                          "param": None if self.param is None else encodable(self.param), "code": self.code}}


def encodable(text: str) -> str:
    """``text`` with every character UTF-8 cannot encode (a lone surrogate such as ``"\\udcff"``,
    which JSON escapes may carry into a decoded string) written as its escape, so that rendering
    an error that echoes the request can never fail."""
    return text if _is_unicode(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


JSON = json.JSONDecoder(parse_constant=reject_constant)  # NaN / Infinity refused; one decoder for all bodies
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode_body(raw: bytes) -> Any:
    """A request body as Python objects (every route's one decoder): 400 unless it is UTF-8 JSON
    whose strings are Unicode text. JSON's ``\\uXXXX`` escapes can spell a lone UTF-16
    surrogate, which decodes to a str nothing downstream can encode (the tokenizer raised a
    TypeError: a 500), so such a string is refused here, naming where it is."""
    try:
        body = JSON.decode(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    if SURROGATE_ESCAPE.search(raw):  # only escapes can make one: skip the walk otherwise
        where = lone_surrogate(body)
        if where is not None:
            where = where[:200]
            raise bad(f"the string at {where} holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape "
                      "not part of a pair): not Unicode text", where, "invalid_value")
    return body


def lone_surrogate(obj: Any) -> str | None:
    """Where the first string (key or value) holding a lone surrogate is in a decoded JSON value
    (``"prompt"``, ``"messages[0].content"``, ``"(body)"``), or None; iterative, for any depth."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return path or "(body)"
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{path}.{key}" if path else key
                if not _is_unicode(key):
                    return encodable(name)
                stack.append((item, name))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# -- field checks ------------------------------------------------------------------------------
def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def get_int(body: dict, name: str, lo: int | None = None, hi: int | None = None, param: str | None = None,
            hint: str = "") -> int | None:
    value = body.get(name)
    param = param or name
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{param}' must be an integer, got {_type_name(value)} {value!r:.40}", param, "invalid_type")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}" if lo is not None else f"<= {hi}"
        raise bad(f"'{param}' must be {rng}, got {value}{hint}", param, "invalid_value")
    return value


def get_float(body: dict, name: str, param: str | None = None) -> float | None:
    value = body.get(name)
    param = param or name
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{param}' must be a number, got {_type_name(value)} {value!r:.40}", param, "invalid_type")
    try:  # a JSON integer beyond float's range made math.isfinite raise OverflowError: a 500
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise bad(f"'{param}' must be finite", param, "invalid_value")
    return value


def get_bool(body: dict, name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(f"'{param or name}' must be a boolean, got {_type_name(value)}", param or name, "invalid_type")
    return value


# -- parsed request ----------------------------------------------------------------------------
@dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    template_kwargs: dict | None = None
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    gen_kwargs: dict[str, Any] = field(default_factory=dict)  # for Generator.stream (no prompt)
    timeout: float | None = None
    stop_given: bool = False


COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "n", "user", "ignore_eos", "specdec", "presence_penalty", "frequency_penalty",
          "logit_bias", "logprobs"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "response_format", "parallel_tool_calls", "chat_template_kwargs", "metadata", "store",
                        "service_tier"}


def _refuse_unless(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise bad(message, param, "unsupported_parameter")


def server_drafter(defaults: dict, speculation: str | None) -> str | None:
    """The drafter of a request that names none: the server's, or for trees its tree drafter
    (``--drafter auto`` may pick a chain drafter, e.g. suffix_hybrid, that cannot draft trees)."""
    if speculation == "tree":
        return defaults.get("tree_drafter", defaults.get("drafter"))
    return defaults.get("drafter")


def _common(body: dict, kind: str, accepted: set[str], served_model: str, defaults: dict,
            max_tokens_limit: int, max_timeout: float | None) -> ParsedRequest:
    unknown = sorted(set(body) - accepted)
    if unknown:
        raise bad(f"unrecognized request argument(s): {', '.join(unknown)} (accepted: "
                  f"{', '.join(sorted(accepted))})", unknown[0], "unknown_parameter")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad(f"'model' must be a string, got {_type_name(model)}", "model", "invalid_type")
        if model != served_model:
            raise APIError(404, f"the model '{model:.100}' does not exist; this server serves '{served_model}' "
                           "(GET /v1/models)", "model", "model_not_found")
    n = get_int(body, "n")
    _refuse_unless(n in (None, 1), "n", f"'n' must be 1 (one choice per request), got {n}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = get_float(body, name)
        _refuse_unless(v in (None, 0.0), name, f"'{name}' is not supported (only 0)")
    _refuse_unless(body.get("logit_bias") in (None, {}), "logit_bias", "'logit_bias' is not supported")
    _refuse_unless(body.get("logprobs") in (None, False), "logprobs", "'logprobs' is not supported")

    req = ParsedRequest(kind)
    req.max_tokens = get_int(body, "max_tokens", 1, max_tokens_limit,
                             hint=f" (this server's limit is {max_tokens_limit})")
    temperature = get_float(body, "temperature")
    if temperature is not None and temperature < 0:
        raise bad(f"'temperature' must be >= 0 (0 is greedy), got {temperature:g}", "temperature", "invalid_value")
    top_p = get_float(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p:g}", "top_p", "invalid_value")
    top_k = get_int(body, "top_k", -1)
    seed = get_int(body, "seed", 0, MAX_SEED - 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("'stop' must be a string or an array of strings", "stop", "invalid_type")
        if len(stop) > MAX_STOP or not all(stop):
            raise bad(f"'stop' takes at most {MAX_STOP} non-empty strings", "stop", "invalid_value")
    ignore_eos = get_bool(body, "ignore_eos")
    req.stream = bool(get_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise bad("'stream_options' is only allowed with 'stream': true", "stream_options", "invalid_value")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad("'stream_options' must be an object with 'include_usage'", "stream_options", "invalid_value")
        req.include_usage = bool(get_bool(opts, "include_usage", "stream_options.include_usage"))
    for name in ("user", "service_tier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad(f"'{name}' must be a string", name, "invalid_type")

    spec = dict(defaults)
    spec.pop("tree_drafter", None)
    ext = body.get("specdec")
    if ext is not None:
        if not isinstance(ext, dict):
            raise bad("'specdec' must be an object with num_draft_tokens, drafter, speculation, timeout",
                      "specdec", "invalid_type")
        extra = sorted(set(ext) - {"num_draft_tokens", "drafter", "speculation", "timeout"})
        if extra:
            raise bad(f"unrecognized 'specdec' field(s): {', '.join(extra)} (accepted: num_draft_tokens, "
                      "drafter, speculation, timeout)", f"specdec.{extra[0]}", "unknown_parameter")
        if "num_draft_tokens" in ext:
            k = ext["num_draft_tokens"]
            if k != "auto":
                k = get_int(ext, "num_draft_tokens", 0, 64, "specdec.num_draft_tokens")
            if k is not None:
                spec["num_draft_tokens"] = k
        d = ext.get("drafter")
        if d is not None:
            if d not in DRAFTERS:
                raise bad(f"'specdec.drafter' must be one of {', '.join(DRAFTERS)}, got {d!r:.40}",
                          "specdec.drafter", "invalid_value")
            spec["drafter"] = None if d == "none" else d
        if ext.get("speculation") is not None:
            if ext["speculation"] not in SPECULATION:
                raise bad(f"'specdec.speculation' must be 'chain' or 'tree', got {ext['speculation']!r:.40}",
                          "specdec.speculation", "invalid_value")
            spec["speculation"] = ext["speculation"]
        t = get_float(ext, "timeout", "specdec.timeout")
        if t is not None:
            if t <= 0:
                raise bad("'specdec.timeout' must be > 0 seconds", "specdec.timeout", "invalid_value")
            req.timeout = t
    if not (isinstance(ext, dict) and ext.get("drafter") is not None):
        spec["drafter"] = server_drafter(defaults, spec.get("speculation"))
    if max_timeout is not None:
        req.timeout = max_timeout if req.timeout is None else min(req.timeout, max_timeout)
    req.stop_given = bool(stop)
    req.gen_kwargs = {"temperature": temperature, "top_p": top_p,
                      "top_k": None if top_k is None else max(top_k, 0), "seed": seed, "stop": stop or None,
                      "ignore_eos": bool(ignore_eos), **spec}
    if body.get("user") is not None:  # selects the request's suffix pool (--suffix-pool per-user)
        req.gen_kwargs["user"] = body["user"]
    return req


def parse_completion(body: dict, served_model: str, defaults: dict, max_tokens_limit: int,
                     max_timeout: float | None) -> ParsedRequest:
    req = _common(body, "completion", COMPLETION_FIELDS, served_model, defaults, max_tokens_limit, max_timeout)
    _refuse_unless(body.get("echo") in (None, False), "echo", "'echo' is not supported")
    _refuse_unless(body.get("suffix") is None, "suffix", "'suffix' is not supported")
    best_of = get_int(body, "best_of")
    _refuse_unless(best_of in (None, 1), "best_of", f"'best_of' must be 1, got {best_of}")
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required (a string or an array of token ids)", "prompt", "missing_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise bad(f"one prompt per request (got {len(prompt)}); send several requests", "prompt",
                      "unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("'prompt' must be a string, an array of token ids or an array holding one of these",
                      "prompt", "invalid_type")
    elif not isinstance(prompt, str):
        raise bad(f"'prompt' must be a string or an array of token ids, got {_type_name(prompt)}", "prompt",
                  "invalid_type")
    if not prompt:
        raise bad("'prompt' is empty", "prompt", "invalid_value")
    req.prompt = prompt
    return req


def _content(content: Any, i: int) -> Any:
    """Text content parts (``[{"type": "text", "text": ...}]``) joined with newlines, as vLLM does
    for text-only models; other parts are refused."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else _type_name(part)
            raise bad(f"messages[{i}].content: only text parts are supported, got {kind!r:.40}",
                      f"messages[{i}].content", "unsupported_parameter")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_chat(body: dict, served_model: str, defaults: dict, max_tokens_limit: int,
               max_timeout: float | None) -> ParsedRequest:
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    req = _common(body, "chat", CHAT_FIELDS, served_model, defaults, max_tokens_limit, max_timeout)
    _refuse_unless(body.get("top_logprobs") in (None, 0), "top_logprobs", "'top_logprobs' is not supported")
    _refuse_unless(body.get("tools") in (None, []), "tools", "tool calling is not supported by this server")
    _refuse_unless(body.get("tool_choice") in (None, "none", "auto"), "tool_choice",
                   "tool calling is not supported by this server")
    fmt = body.get("response_format")
    _refuse_unless(fmt is None or fmt == {"type": "text"}, "response_format",
                   "'response_format' other than {\"type\": \"text\"} is not supported")
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required (an array of {role, content} objects)", "messages", "missing_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {role, content} objects", "messages", "invalid_value")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]", "invalid_type")
        if not isinstance(msg.get("role"), str):
            raise bad(f"messages[{i}].role must be a string", f"messages[{i}].role", "invalid_type")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad(f"messages[{i}].content must be a string or an array of text parts",
                      f"messages[{i}].content", "invalid_type")
        out.append({**msg, "content": _content(content, i)} if "content" in msg else dict(msg))
    req.messages = out
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
    if kwargs and {"messages", "tools", "documents", "add_generation_prompt", "chat_template"} & set(kwargs):
        raise bad("'chat_template_kwargs' cannot set messages, tools, documents, add_generation_prompt or "
                  "chat_template", "chat_template_kwargs", "invalid_value")
    req.template_kwargs = kwargs or None
    return req


def resolve_max_tokens(req: ParsedRequest, prompt_len: int, context: int, default_max_tokens: int) -> int:
    """The generation budget: the request's ``max_tokens`` (refused if the prompt plus it exceed
    the context, as OpenAI and vLLM do) or ``min(default, room left)``."""
    room = context - prompt_len
    if room < 1:
        raise bad(f"this model's context is {context} tokens and the prompt has {prompt_len}; shorten the "
                  "prompt (at least one position must remain for generation)",
                  "messages" if req.kind == "chat" else "prompt", "context_length_exceeded")
    if req.max_tokens is None:
        return min(default_max_tokens, room)
    if req.max_tokens > room:
        raise bad(f"this model's context is {context} tokens; the prompt has {prompt_len} and max_tokens asks "
                  f"for {req.max_tokens} more ({prompt_len + req.max_tokens} in all); lower max_tokens to at "
                  f"most {room} or shorten the prompt", "max_tokens", "context_length_exceeded")
    return req.max_tokens


# -- responses -----------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose K/V
    the server already held (its prefix cache)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(runtime_reason: str) -> str:
    return FINISH.get(runtime_reason, runtime_reason)


def response_body(kind: str, rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use,
            "system_fingerprint": None}


class ChunkWriter:
    """Server-sent events in OpenAI's chunk format (``chat.completion.chunk`` / ``text_completion``)."""

    def __init__(self, kind: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.id = new_id(kind)
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.started = False

    def _chunk(self, choices: list, use: dict | None = None) -> bytes:
        import json

        obj = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, "system_fingerprint": None}
        if self.include_usage:
            obj["usage"] = use
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def piece(self, text: str) -> bytes:
        out = b""
        if not self.started and self.kind == "chat":
            out = self._chunk([self._choice("", None, role=True)])
        self.started = True
        return out + (self._chunk([self._choice(text, None)]) if text else b"")

    def finish(self, finish: str, use: dict) -> bytes:
        out = self.piece("") if not self.started else b""
        out += self._chunk([self._choice(None if self.kind == "chat" else "", finish)])
        if self.include_usage:
            out += self._chunk([], use)
        return out + b"data: [DONE]\n\n"

    @staticmethod
    def error(err: APIError) -> bytes:
        import json

        return b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
