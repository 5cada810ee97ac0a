"""Chat templates rendered with jinja2 the way transformers' ``apply_chat_template`` renders them.

No transformers at run time: the exporter copies the tokenizer's chat template(s) and its special
token strings into the bundle, and this module renders them in the same jinja2 environment
transformers builds (``transformers.utils.chat_template_utils._cached_compile_jinja_template``):

* ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension and a ``{% generation %}`` tag (rendered as its body);
* ``tojson`` overridden to ``json.dumps(x, ensure_ascii=False, ...)`` (no HTML escaping);
* globals ``raise_exception`` (raises ``TemplateError``), ``strftime_now``, a restricted ``dict``
  and a ``namespace`` that refuses underscore-prefixed attributes;
* variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's
  special tokens (``bos_token``, ``eos_token``, ...) and any extra template keyword arguments.

Messages are normalized as transformers does (keys whose value is ``None`` dropped, reasoning
aliases ``reasoning_content`` / ``thinking`` filled in). The rendered text is tokenized without
the tokenizer's post-processor (``add_special_tokens=False``), as ``apply_chat_template(...,
tokenize=True)`` does, so a template that writes ``bos_token`` itself gets exactly one BOS.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from specdec_rt.errors import ChatTemplateError

NO_TEMPLATE = ("this bundle has no chat template (the target's tokenizer had none, or the bundle was "
               "exported by an older specdec-rt); use generate() with a plain prompt")

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@lru_cache(maxsize=16)
def compile_template(source: str):
    """Compile ``source`` in transformers' chat-template environment (cached per template)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.utils
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from None

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
        transformers; rendering only needs its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):  # noqa: A002 - the name templates call it with
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # same signature trick as jinja2's Namespace
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the bundle's chat template does not compile: {exc}") from None


def _plain(value: Any, where: str) -> Any:
    """JSON-like data only reaches the sandbox (transformers rebuilds template data the same way)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, where) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _plain(value.item(), where)  # numpy scalars, as transformers converts them
    raise ChatTemplateError(f"{where}: {type(value).__name__} values cannot be passed to a chat template "
                            "(use str, int, float, bool, None, lists and dicts)")


def check_messages(messages: Any) -> list[dict]:
    """Validate a conversation; return it normalized as transformers normalizes it."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                                f"got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: give at least one {'role': 'user', 'content': ...} message")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(msg).__name__}")
        msg = {k: v for k, v in msg.items() if v is not None}
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}] has no 'role' (a non-empty string such as 'user')")
        content = msg.get("content")
        if content is None and not msg.get("tool_calls"):
            raise ChatTemplateError(f"messages[{i}] ({role}) has no 'content'")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatTemplateError(f"messages[{i}] ({role}): 'content' must be a string (or a list of content "
                                    f"blocks), got {type(content).__name__}")
        msg = _plain(msg, f"messages[{i}]")
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class ChatTemplate:
    """The bundle's chat template(s) and the special-token strings they may refer to.

    ``templates`` is one template string, or a dict of named templates (``tokenizer_config.json``
    with a list of ``{"name", "template"}``, or ``additional_chat_templates/``), as transformers
    keeps ``tokenizer.chat_template``.
    """

    def __init__(self, templates: str | Mapping[str, str], special_tokens: Mapping[str, Any] | None = None) -> None:
        self.templates = templates if isinstance(templates, str) else dict(templates)
        self.special_tokens = dict(special_tokens or {})

    @property
    def names(self) -> list[str]:
        return [] if isinstance(self.templates, str) else sorted(self.templates)

    def select(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template source to use: ``tokenizer.get_chat_template`` of transformers."""
        if isinstance(self.templates, dict):
            if chat_template is not None and chat_template in self.templates:
                return self.templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in self.templates:
                    return self.templates["tool_use"]
                if "default" in self.templates:
                    return self.templates["default"]
                raise ChatTemplateError(
                    "this bundle has several chat templates and none is named 'default'; pass "
                    f"chat_template= one of {self.names}")
            return chat_template  # a template string given by the caller
        return self.templates if chat_template is None else chat_template

    def render(self, messages: Any, add_generation_prompt: bool = True, chat_template: str | None = None,
               tools: list | None = None, documents: list | None = None, **kwargs: Any) -> str:
        """The conversation as text, as ``apply_chat_template(..., tokenize=False)`` returns it."""
        import jinja2

        msgs = check_messages(messages)
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("tools must be a list of JSON-schema dicts")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise ChatTemplateError("documents must be a list of dicts (e.g. with 'title' and 'text')")
        template = compile_template(self.select(chat_template, tools))
        variables = _plain({**self.special_tokens, **kwargs}, "template_kwargs")
        try:
            return template.render(messages=msgs, tools=_plain(tools, "tools"),
                                   documents=_plain(documents, "documents"),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused this conversation: {exc}") from None
