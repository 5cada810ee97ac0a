"""Fuzzing the HTTP surface (issue 41): generated malformed requests against /v1/completions,
/v1/chat/completions and /generate on a live server (uvicorn on 127.0.0.1, the ChatML test
bundle): wrong types for every field, huge / negative / fractional numbers and NaN, nulls,
unknown fields, deep nesting, lone surrogates, long strings and stop lists, and raw bodies
(truncated JSON, invalid UTF-8, random bytes, deep arrays, wrong content types, an oversized body);
then connections that leave mid-request (a body shorter than its Content-Length, a cut chunk, cut
headers, TLS bytes).

Each field is first set to each of a list of probes (wrong types, extreme numbers, lone surrogates,
long strings and lists, nesting), then Hypothesis draws bodies with several fields changed at once.
Bounded for CI: Hypothesis with a fixed ``max_examples`` per route, ``derandomize=True`` (the
same requests every run) and no shrinking; each request has a 30 s timeout, so a hang fails.
Every answer must be a 200 or a 4xx with an error body that says something, never a 5xx; after
the run /health is 200, no 5xx was counted in /metrics, and a normal request on each route gets
exactly the library's answer. The figures (requests and statuses per route, time) are printed and
written to ``fuzz_report.json`` in the test's temporary directory.
"""
from __future__ import annotations

import collections
import json
import time

import pytest

httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_serving import MESSAGES, PROMPTS, chat_bundle, serve  # noqa: E402,F401 - chat_bundle is a fixture

EXAMPLES = 400  # structured bodies per route; RAW_EXAMPLES raw ones on top
RAW_EXAMPLES = 100
TIMEOUT = 30.0
BASES = {
    "/v1/completions": {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 4, "temperature": 0},
    "/generate": {"prompt": PROMPTS[0], "max_new_tokens": 4},
}
FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                        "stream_options", "n", "user", "ignore_eos", "specdec", "model", "logprobs", "echo",
                        "best_of", "suffix", "logit_bias", "presence_penalty"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                             "seed", "stop", "stream", "stream_options", "user", "specdec", "model", "tools",
                             "tool_choice", "response_format", "chat_template_kwargs", "metadata", "top_logprobs"],
    "/generate": ["prompt", "max_new_tokens", "temperature", "top_k", "top_p", "do_sample", "seed",
                  "num_draft_tokens", "drafter", "speculation", "stop", "ignore_eos", "stream"],
}
NESTED = {"specdec": ["num_draft_tokens", "drafter", "speculation", "timeout"],
          "stream_options": ["include_usage", "continuous_usage_stats"],
          "chat_template_kwargs": ["enable_thinking", "add_generation_prompt", "bos_token", "x"]}
# no tiny positive numbers: a specdec.timeout of 1e-300 s is a deadline the client asked to miss (504)
NUMBERS = [0, 1, -1, 2, 4, 16, 64, 65, 255, 256, 257, 320, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63,
           10 ** 30, -10 ** 30, 0.0, -0.0, 0.5, 1.5, 2.0, 1e308, -1e308, 3.7]
STRINGS = ["", "auto", "none", "tree", "chain", "model", "eagle", "tiny", "user", "system", "text", "\x00",
           "\udcff", "a\ud800", "\ud83d\ude00", "é" * 50, "x" * 50_000, "<|im_start|>", "{{ raise_exception('x') }}",
           "NaN", "-1", "null", "\n"]
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(NUMBERS), st.integers(),
                    st.sampled_from(STRINGS), st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(["type", "text", "role", "content"]),
                                                           st.text(max_size=6)), inner, max_size=4)), max_leaves=8)
specials = st.sampled_from([
    ["a"] * 5000, [""], ["\udcff"], [[[[[]]]]], [{"role": "user"}], [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": 5, "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": "x" * 200_000}], [1] * 2000, [-1], [10 ** 20], {"type": "json_object"},
    {"a": {"b": {"c": {}}}}, "\udcff" * 3])
field_values = st.one_of(values, specials)
# every field (nested ones too) gets each of these in turn, besides the random combinations; NaN and
# infinities go out as json.dumps writes them (NaN, Infinity: not JSON, so 400 invalid_json)
PROBES = [None, True, False, -1, 0, 1.5, 1e308, -1e308, 2 ** 64, -2 ** 63, 10 ** 400, float("nan"), float("-inf"),
          "", "\udcff", "a\ud800b", "x" * 50_000, [], [[[[]]]], ["a"] * 5000, {}, {"a": [1, {"b": None}]}]


def probe_bodies(route: str) -> list[dict]:
    """The route's base body with one field (top level, in specdec / stream_options, or a message's
    role / content) set to each probe value: wrong types for every field, systematically."""
    base = BASES[route]
    out = [{**base, name: v} for name in FIELDS[route] for v in PROBES]
    if route != "/generate":
        for parent, names in NESTED.items():
            out += [{**base, parent: {name: v}} for name in names for v in PROBES]
    if route == "/v1/chat/completions":
        out += [{**base, "messages": [MESSAGES[0], {**MESSAGES[1], name: v}]} for name in ("role", "content")
                for v in PROBES]
    return out


def mutate(route: str, base: dict):
    """A strategy of bodies: the route's valid base with 1-4 fields replaced, removed or added
    (nested ones too: specdec, stream_options, chat_template_kwargs, a message)."""
    names = FIELDS[route] + ["bogus", "\udcff", ""] + list(NESTED)

    @st.composite
    def body(draw):
        out = json.loads(json.dumps(base))
        for _ in range(draw(st.integers(1, 4))):
            name = draw(st.sampled_from(names))
            action = draw(st.sampled_from(["set", "set", "set", "drop", "nest"]))
            if action == "drop":
                out.pop(name, None)
            elif action == "nest" and name in NESTED:
                out[name] = draw(st.dictionaries(st.sampled_from(NESTED[name] + ["bogus"]), field_values, max_size=3))
            elif action == "nest" and name == "messages" and route == "/v1/chat/completions":
                msgs = list(out.get("messages") or MESSAGES)
                msgs[draw(st.integers(0, len(msgs) - 1))] = draw(st.dictionaries(
                    st.sampled_from(["role", "content", "name", "tool_calls", "bogus"]), field_values, max_size=3))
                out["messages"] = msgs
            else:
                out[name] = draw(field_values)
        return out

    return body()


def raw_bodies(route: str):
    """(bytes, content type) strategies below the JSON level."""
    valid = json.dumps(BASES[route]).encode()
    deep = [b"[" * n + b"]" * n for n in (64, 950, 2_000, 200_000)]  # 950: decodes, but deep for repr()
    return st.one_of(
        st.integers(0, len(valid) - 1).map(lambda i: (valid[:i], "application/json")),  # truncated
        st.tuples(st.integers(0, len(valid)), st.sampled_from([b"\xff", b"\xc3", b"\xed\xb3\xbf", b"\x00", b"\x80\x80"]))
        .map(lambda t: (valid[:t[0]] + t[1] + valid[t[0]:], "application/json")),  # invalid UTF-8
        st.binary(max_size=300).map(lambda b: (b, "application/json")),  # random bytes
        st.sampled_from(deep).map(lambda d: (d, "application/json")),
        st.sampled_from(deep + [b"[" * 100_000, b"{\"a\":" * 50_000]).map(
            lambda d: (valid[:-1] + b', "bogus": ' + d + b"}", "application/json")),  # deep value, unbalanced too
        st.tuples(st.sampled_from(FIELDS[route]), st.sampled_from(deep[:2] + [b"{\"a\":" * 900 + b"1" + b"}" * 900]))
        .map(lambda t: (b'{"' + t[0].encode() + b'": ' + t[1] + b"}", "application/json")),  # a deep field
        st.sampled_from([b'{"prompt": NaN}', b'{"max_tokens": Infinity}', b'{"a": 1e999999}', b"", b"null", b"[]",
                         b'"just a string"', b"{}", b"{" * 10, valid + b"garbage", valid * 2, b"\xef\xbb\xbf" + valid,
                         valid.replace(b"4", b"1" * 5000)]).map(lambda b: (b, "application/json")),
        st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "application/json; charset=latin-1", "application/xml", "", "*/*"])
        .map(lambda ct: (valid, ct)),  # content types (the body decides: see docs/serving.md)
        st.just((b'{"prompt": "' + b"x" * (2 << 20) + b'"}', "application/json")),  # over --max-body-bytes: 413
    )


@pytest.fixture(scope="module")
def fuzz_server(chat_bundle):
    with serve(chat_bundle, request_timeout=30.0) as (url, app):
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            yield url, http


REPORT: dict[str, dict] = {}


def check(http, route: str, content: bytes, content_type: str | None, what) -> None:
    """Send one request; its answer must be a 200 or a 4xx with an error that says something."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    t0 = time.monotonic()
    try:
        with http.stream("POST", route, content=content, headers=headers) as r:
            data = r.read()
    except httpx.TimeoutException:
        pytest.fail(f"{route}: no answer within {TIMEOUT} s (a hang) for {what!r:.300}")
    rep = REPORT.setdefault(route, {"requests": 0, "statuses": collections.Counter(), "seconds": 0.0})
    rep["requests"] += 1
    rep["statuses"][r.status_code] += 1
    rep["seconds"] += time.monotonic() - t0
    assert r.status_code == 200 or 400 <= r.status_code < 500, f"{route} {r.status_code} {data[:300]!r} for {what!r:.300}"
    if r.status_code == 200:
        return
    err = json.loads(data)["error"]
    message = err if route == "/generate" else err["message"]
    assert isinstance(message, str) and len(message) > 10 and "Traceback" not in message, (route, err)


def fuzz_settings(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("route", list(BASES))
def test_fuzz_bodies(fuzz_server, route):
    http = fuzz_server[1]

    @fuzz_settings(EXAMPLES)
    @given(mutate(route, BASES[route]))
    def run(body):
        check(http, route, json.dumps(body).encode(), "application/json", body)

    @fuzz_settings(RAW_EXAMPLES)
    @given(raw_bodies(route))
    def run_raw(raw):
        check(http, route, raw[0], raw[1] or None, raw)

    for body in probe_bodies(route):
        check(http, route, json.dumps(body).encode(), "application/json", body)
    run()
    run_raw()


def test_after_fuzzing_the_server_is_healthy_and_exact(fuzz_server, chat_bundle, tmp_path):
    """Runs after the fuzz (file order): /health, no 5xx counted, and each route's normal answer
    is the library's, token for token."""
    import specdec_rt

    import socket

    url, http = fuzz_server
    assert set(REPORT) == set(BASES), "the fuzz tests did not run first"
    host, port = url[len("http://"):].split(":")
    for raw in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ",
                b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pro",
                b"POST /v1/chat/completions HTTP/1.1\r\nContent-Le", b"\x16\x03\x01\x00\xa5garbage\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # the client goes away mid-request
            sock.sendall(raw)
    assert http.get("/health").status_code == 200
    metrics = http.get("/metrics").text
    assert not [line for line in metrics.splitlines() if line.startswith("specdec:http_requests_total")
                and 'status="5' in line]
    gen = specdec_rt.load(chat_bundle, threads=1)
    want = gen.generate(PROMPTS[0], max_new_tokens=16, temperature=0)
    r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0})
    assert r.json()["choices"][0]["text"] == want.text
    assert r.json()["usage"]["completion_tokens"] == len(want.token_ids)
    r = http.post("/generate", json={"prompt": PROMPTS[0], "max_new_tokens": 16, "temperature": 0})
    assert r.json()["token_ids"] == want.token_ids
    want = gen.chat(MESSAGES, max_new_tokens=16, temperature=0)
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 16, "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == want.text
    report = {route: {"requests": rep["requests"], "statuses": dict(sorted(rep["statuses"].items())),
                      "seconds": round(rep["seconds"], 1)} for route, rep in REPORT.items()}
    (tmp_path / "fuzz_report.json").write_text(json.dumps(report, indent=1))
    print("fuzz:", json.dumps(report))
