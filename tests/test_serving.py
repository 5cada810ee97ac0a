"""The OpenAI-compatible server in this process (uvicorn on 127.0.0.1, an ephemeral port), driven by
the official ``openai`` client and by plain HTTP (httpx) for the error cases."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from helpers import make_chat_checkpoint, make_perturbed_copy  # noqa: E402

PROMPTS = ["def wrap(text, width):", "import heapq\n", "class Stack:\n    def __init__(self):"]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Write a function that adds two numbers."}]
METRIC_NAMES = [
    "num_requests_running", "num_requests_waiting", "http_requests_total", "request_success_total",
    "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos_total"]


class SlowGen:
    """A generator whose steps take at least ``delay`` seconds: the tiny models finish a whole
    generation in ~0.1 s, too fast to observe a running request (queue limit, disconnects)."""

    def __init__(self, gen, delay: float = 0.01) -> None:
        self._gen = gen
        self._delay = delay

    def __getattr__(self, name):
        return getattr(self._gen, name)

    def stream(self, *args, **kwargs):
        for piece in self._gen.stream(*args, **kwargs):
            time.sleep(self._delay)
            yield piece


SCHEDULERS = ["serial", "batch"]


@contextlib.contextmanager
def serve(bundle, step_delay: float | None = None, scheduler: str = "serial", max_batch: int = 4,
          overlap: bool = False, suffix_pool=None, **config):
    """``create_app`` on its own generator, uvicorn in a thread; yields (base URL, app).
    ``scheduler``: "serial" (SerialScheduler) or "batch" (BatchScheduler of ``max_batch`` rows)."""
    import specdec_rt
    from specdec_rt.serving import ServerConfig, create_app
    from specdec_rt.serving.scheduler import BatchScheduler

    gen = specdec_rt.load(bundle, threads=1, overlap=overlap, suffix_pool=suffix_pool)
    cfg = ServerConfig(**{"model_name": "tiny", **config})
    sched = None
    if scheduler == "batch":
        sched = BatchScheduler(gen, max_batch, cfg.max_queue, step_delay=step_delay or 0.0)
    else:
        cfg.max_batch = 1
        if step_delay:
            gen = SlowGen(gen, step_delay)
    app = create_app(gen, cfg, scheduler=sched)
    with serve_app(app) as url:
        yield url, app


@contextlib.contextmanager
def serve_app(app):
    """uvicorn serving ``app`` in a thread on a free port; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


@pytest.fixture(scope="module", params=SCHEDULERS)
def server(request, tiny_pair):
    with serve(tiny_pair["bundle"], scheduler=request.param) as (url, app):
        yield url


@pytest.fixture(scope="module")
def chat_bundle(tmp_path_factory):
    """A ChatML chat checkpoint and a noisy copy of it as draft, exported."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("serving_chat")
    target = make_chat_checkpoint(base / "target", "chatml")
    draft = make_perturbed_copy(target, base / "draft", noise=0.03)
    export_pair(target, draft, base / "bundle", ExportOptions(progress=False))
    return base / "bundle"


@pytest.fixture(scope="module", params=SCHEDULERS)
def chat_server(request, chat_bundle):
    with serve(chat_bundle, scheduler=request.param) as (url, app):
        yield url


# -- the OpenAI API through the official client -----------------------------------------------------
def test_completion_equals_library(server, tiny_gen):
    c = client(server)
    for prompt in PROMPTS:
        want = tiny_gen.generate(prompt, max_new_tokens=16, temperature=0)
        out = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert out.object == "text_completion" and out.model == "tiny" and len(out.choices) == 1
        assert out.choices[0].text == want.text
        assert out.choices[0].finish_reason == {"eos": "stop", "length": "length"}[want.finish_reason]
        assert out.usage.prompt_tokens == len(want.prompt_token_ids)
        assert out.usage.completion_tokens == len(want.token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    ids = tiny_gen.tokenizer.encode(PROMPTS[0])  # a prompt as token ids
    assert c.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0).choices[0].text == \
        tiny_gen.generate(ids, max_new_tokens=16, temperature=0).text


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_overlapped_server_equals_library(tiny_pair, tiny_gen, sched):
    """specdec-serve --overlap: concurrent requests (rows of one batch on the batch scheduler)
    get exactly the library's non-overlapped completions."""
    from concurrent.futures import ThreadPoolExecutor

    with serve(tiny_pair["bundle"], scheduler=sched, overlap=True) as (url, app):
        c = client(url)

        def one(prompt):
            return c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0).choices[0].text

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(one, PROMPTS))
    assert texts == [tiny_gen.generate(p, max_new_tokens=24, temperature=0, overlap=False).text for p in PROMPTS]


def test_completion_streamed(server, tiny_gen):
    c = client(server)
    prompt = PROMPTS[1]
    want = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert all(ch.object == "text_completion" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    usage_chunk, last = chunks[-1], chunks[-2]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == want.usage.completion_tokens
    assert last.choices[0].finish_reason == want.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-2])
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == want.choices[0].text
    plain = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert all(ch.usage is None for ch in plain) and plain[-1].choices[0].finish_reason is not None


def test_stop_strings_and_seeded_sampling(server, tiny_gen):
    c = client(server)
    full = tiny_gen.generate(PROMPTS[0], max_new_tokens=24, temperature=0, ignore_eos=True).text
    stop = full[5:7]
    want = tiny_gen.generate(PROMPTS[0], max_new_tokens=24, temperature=0, stop=[stop])
    out = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop,
                               extra_body={"ignore_eos": True})
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "stop"
    # a fixed K: with "auto", K follows each generator's learned state, and sampled draws with it
    kw = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=11, num_draft_tokens=3, drafter="model")
    want = tiny_gen.generate(PROMPTS[2], **kw)
    for stream in (False, True):
        out = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0.9, top_p=0.95,
                                   seed=11, stream=stream,
                                   extra_body={"top_k": 40, "specdec": {"num_draft_tokens": 3, "drafter": "model"}})
        text = "".join(ch.choices[0].text for ch in out) if stream else out.choices[0].text
        assert text == want.text


def test_chat_equals_library(chat_server, chat_bundle):
    import specdec_rt

    gen = specdec_rt.load(chat_bundle, threads=1)
    c = client(chat_server)
    want = gen.chat(MESSAGES, max_new_tokens=24, temperature=0)
    out = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want.text
    assert out.choices[0].finish_reason == ("stop" if want.finish_reason == "eos" else "length")
    assert out.usage.prompt_tokens == len(gen.apply_chat_template(MESSAGES, tokenize=True))
    chunks = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == want.text
    assert chunks[-2].choices[0].finish_reason == out.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a function"},
                                          {"type": "text", "text": "that adds two numbers."}]}]
    want = gen.chat([{"role": "user", "content": "Write a function\nthat adds two numbers."}], max_new_tokens=8,
                    temperature=0)
    assert c.chat.completions.create(model="tiny", messages=parts, max_tokens=8, temperature=0) \
        .choices[0].message.content == want.text


COMPLETION_NULLS = ["model", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "user", "ignore_eos",
                    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "echo", "best_of", "suffix"]
CHAT_NULLS = ["max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
              "parallel_tool_calls", "chat_template_kwargs", "metadata", "store", "service_tier"]
SPECDEC_NULLS = {"num_draft_tokens": None, "drafter": None, "speculation": None, "timeout": None}


def test_nulls_mean_left_out(chat_server, chat_bundle):
    """null for an optional field is the field left out (OpenAI's schema marks them nullable), so a
    request of nulls gets the default answer; ``specdec.drafter`` null is the server's drafter too,
    not target-only ("none" is), which it silently was before (issue 41)."""
    import specdec_rt

    gen = specdec_rt.load(chat_bundle, threads=1)
    base = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    want = gen.generate(PROMPTS[0], max_new_tokens=12, temperature=0).text
    body = {**base, **dict.fromkeys(COMPLETION_NULLS), "specdec": SPECDEC_NULLS}
    r = httpx.post(chat_server + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    assert httpx.post(chat_server + "/v1/completions", json={**base, "specdec": None}).json()["choices"][0]["text"] == want
    body = {"messages": [{**MESSAGES[0], "name": None}, MESSAGES[1]],
            "max_tokens": 12, "temperature": 0, **dict.fromkeys(COMPLETION_NULLS[:10] + CHAT_NULLS)}
    r = httpx.post(chat_server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == gen.chat(MESSAGES, max_new_tokens=12, temperature=0).text
    from specdec_rt.serving import protocol as P

    defaults = {"num_draft_tokens": "auto", "drafter": "model", "speculation": "chain", "tree_drafter": "eagle"}
    for ext, drafter in ((SPECDEC_NULLS, "model"), ({"drafter": "none"}, None), ({"speculation": "tree"}, "eagle"),
                         ({"speculation": "tree", "drafter": None}, "eagle")):
        req = P.parse_completion({"prompt": "x", "specdec": ext}, "tiny", defaults, 100, None)
        assert req.gen_kwargs["drafter"] == drafter, ext


def test_next_chat_turn_reuses_the_conversation(chat_server, chat_bundle):
    """A chat's second turn through the server: the prompt tokens its first turn left in the
    cache are reused (usage.prompt_tokens_details.cached_tokens, prompt_tokens_cached_total)
    and the answer is the library's fresh one."""
    import specdec_rt

    fresh = specdec_rt.load(chat_bundle, threads=1, prefix_cache=False)
    c = client(chat_server)
    before = metrics(chat_server).get(("specdec:prompt_tokens_cached_total", ()), 0.0)
    first = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    history = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                          {"role": "user", "content": "Now make it subtract."}]
    out = c.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)
    assert out.choices[0].message.content == fresh.chat(history, max_new_tokens=12, temperature=0).text
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < out.usage.prompt_tokens
    assert cached >= len(fresh.apply_chat_template(MESSAGES, tokenize=True))  # at least the first prompt
    assert metrics(chat_server)[("specdec:prompt_tokens_cached_total", ())] >= before + cached


def test_chat_without_template_is_400(server):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(server).chat.completions.create(model="tiny", messages=MESSAGES)


def test_models_and_unknown_model(server):
    c = client(server)
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "specdec-rt"
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_specdec_overrides_and_metrics(server, tiny_gen):
    c = client(server)
    want = tiny_gen.generate(PROMPTS[0], max_new_tokens=16, temperature=0, drafter=None).text
    before = metrics(server)
    for ext in ({"num_draft_tokens": 2}, {"num_draft_tokens": "auto"}, {"drafter": "prompt_lookup"},
                {"drafter": "none"}, {"speculation": "tree", "num_draft_tokens": 6}, {"drafter": "model"}):
        out = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                   extra_body={"specdec": ext})
        assert out.choices[0].text == want, ext  # greedy: identical whatever the speculation
    after = metrics(server)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("specdec:spec_decode_num_drafts_total") > 0
    assert delta("specdec:spec_decode_num_draft_tokens_total") >= delta("specdec:spec_decode_num_drafts_total")
    accepted = delta("specdec:spec_decode_num_accepted_tokens_total")
    per_pos = sum(v - before.get(k, 0) for k, v in after.items()
                  if k[0] == "specdec:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == accepted
    assert delta("specdec:generation_tokens_total") == 6 * 16
    assert delta("specdec:request_success_total", (("finished_reason", "length"),)) == 6
    assert delta("specdec:http_requests_total", (("method", "POST"), ("route", "/v1/completions"),
                                                 ("status", "200"))) == 6
    assert delta("specdec:time_to_first_token_seconds_count") == 6
    assert delta("specdec:inter_token_latency_seconds_count") == 6 * 15
    text = httpx.get(server + "/metrics").text
    for name in METRIC_NAMES:
        assert f"specdec:{name}" in text, name


def test_health(server):
    r = httpx.get(server + "/health")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok" and h["model"] == "tiny" and h["has_draft"] is True
    assert h["queue_depth"] == 0 and h["running"] == 0 and h["max_length"] == 256


# -- bad input: 4xx with an OpenAI error body, never a 500, and the server keeps serving ----------------
BAD = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, "invalid_json", None),
    ("/v1/completions", b"\xff\xfe not utf-8", 400, "invalid_json", None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "invalid_json", None),
    ("/v1/completions", b"[1, 2]", 400, "invalid_body", None),
    ("/v1/completions", {"prompt": 5}, 400, "invalid_type", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "invalid_type", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8.0}, 400, "invalid_type", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10 ** 12}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 256}, 400, "context_length_exceeded", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "invalid_value", "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 10 ** 400}, 400, "invalid_value", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": -10 ** 400}, 400, "invalid_value", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "invalid_value", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "invalid_value", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "invalid_value", "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "invalid_value", "seed"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "unsupported_parameter", "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "unsupported_parameter", "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "unsupported_parameter", "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "unsupported_parameter", "presence_penalty"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "missing_parameter", "prompt"),
    ("/v1/completions", {"prompt": "def f(x):\n" * 400}, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "invalid_type", "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "invalid_value", "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "invalid_type", "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "invalid_value",
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "unknown_parameter", "bogus"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "model_not_found", "model"),
    ("/v1/completions", {"prompt": "x", "model": 3}, 400, "invalid_type", "model"),
    ("/v1/completions", {"prompt": "x", "specdec": {"drafter": "magic"}}, 400, "invalid_value", "specdec.drafter"),
    ("/v1/completions", {"prompt": "x", "specdec": {"num_draft_tokens": 65}}, 400, "invalid_value",
     "specdec.num_draft_tokens"),
    ("/v1/completions", {"prompt": "x", "specdec": {"speculation": "tree", "drafter": "none"}}, 400,
     "invalid_value", "specdec.speculation"),
    ("/v1/completions", {"prompt": "x", "specdec": {"timeout": 0}}, 400, "invalid_value", "specdec.timeout"),
    ("/v1/completions", {"prompt": "x", "specdec": {"k": 1}}, 400, "unknown_parameter", "specdec.k"),
    ("/v1/completions", {"prompt": "x", "specdec": 4}, 400, "invalid_type", "specdec"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "invalid_type", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "invalid_type",
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "unsupported_parameter", "messages[0].content"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400,
     "unsupported_parameter", "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt": "x"}, 400, "unknown_parameter", "prompt"),
]


@pytest.mark.parametrize("path, body, status, code, param", BAD,
                         ids=[f"{i}-{b[2]}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_is_4xx(server, path, body, status, code, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=data, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param, err
    assert err["message"] and "Traceback" not in err["message"]
    assert httpx.get(server + "/health").status_code == 200


def test_error_bodies_echoing_a_lone_surrogate_render():
    """A lone surrogate in an error's message or param (echoed request text) rendered by the
    shared error path was a UnicodeEncodeError inside it: a 500 instead of the error (issue 41)."""
    from specdec_rt.serving import protocol as P
    from specdec_rt.serving.app import error_response

    r = error_response(P.APIError(404, "the model 'a\udcffb' does not exist", "\ud800", "model_not_found"))
    err = json.loads(r.body)["error"]
    assert r.status_code == 404 and err["message"] == "the model 'a\\udcffb' does not exist"
    assert err["param"] == "\\ud800"
    assert b"\\udcff" in P.ChunkWriter.error(P.APIError(400, "x\udcff"))


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "a\\udcffb", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "\\udcff": 1}', "\\udcff"),
    ("/v1/completions", b'{"prompt": "x", "model": "a\\udcffb"}', "model"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["ok", "\\ude00\\ud83d"]}', "stop[1]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\uDBFF"}]}', "messages[0].content"),
])
def test_lone_surrogates_are_400(server, path, body, param):
    """JSON escapes can spell a lone UTF-16 surrogate, a str no encoder takes: a prompt holding one
    was a 500 (the tokenizer's TypeError), an error echoing one a 500 from the renderer; the body
    decoder refuses them, naming where (issue 41). A surrogate pair is ordinary text."""
    r = httpx.post(server + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_value" and "lone UTF-16 surrogate" in err["message"]
    r = httpx.post(server + "/generate", content=b'{"prompt": "x\\udcff"}', timeout=60)
    assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": "x\\ud83d\\ude00", "max_tokens": 2}', timeout=60)
    assert r.status_code == 200, r.text


def test_bad_input_through_the_client(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        c.completions.create(model="tiny", prompt="x", n=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="tiny", prompt="x", temperature=-1, stream=True)
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model="tiny", prompt="def f(x):\n" * 400, max_tokens=4)


def test_oversized_body_is_413(tiny_pair):
    with serve(tiny_pair["bundle"], max_body_bytes=1000) as (url, app):
        body = json.dumps({"prompt": "x" * 2000}).encode()
        r = httpx.post(url + "/v1/completions", content=body)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: counted while reading
            for i in range(0, len(body), 100):
                yield body[i:i + 100]

        r = httpx.post(url + "/v1/completions", content=chunked())
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_client_gone_mid_body_is_499_not_500(server):
    """A client that closes the connection before its body has arrived was an unhandled
    ClientDisconnect: a logged traceback and a 500 in /metrics (issue 41's fuzz); now a 499."""
    import socket

    before = metrics(server)
    host, port = server[len("http://"):].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    key = ("specdec:http_requests_total", (("method", "POST"), ("route", "/v1/completions"), ("status", "499")))
    deadline = time.monotonic() + 10
    while metrics(server).get(key, 0) == before.get(key, 0):
        assert time.monotonic() < deadline, "the disconnect was not counted as 499"
        time.sleep(0.02)
    assert not [k for k in metrics(server) if k[0] == "specdec:http_requests_total" and ("status", "500") in k[1]]


def test_unknown_route_and_method(server):
    r = httpx.get(server + "/v1/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx.get(server + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


# -- scheduling: queue limit, disconnects, deadlines ---------------------------------------------------
def _first_chunk(url: str, body: dict):
    """Open a streamed request and read until its first data line; return (client, response, lines).
    Keep ``lines`` referenced: a dropped line iterator closes the connection."""
    c = httpx.Client(timeout=60)
    resp = c.send(c.build_request("POST", url + "/v1/completions", json=body), stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            break
    return c, resp, lines


def _wait_idle(url: str, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while True:
        h = httpx.get(url + "/health").json()
        if h["running"] == 0 and h["queue_depth"] == 0:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, h
        time.sleep(0.01)


LONG = {"prompt": "def f(", "max_tokens": 240, "temperature": 0, "stream": True,
        "specdec": {"drafter": "none"}, "ignore_eos": True}


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_queue_full_is_429(tiny_pair, sched):
    with serve(tiny_pair["bundle"], step_delay=0.01, max_queue=0, scheduler=sched, max_batch=1) as (url, _app):
        c, resp, _lines = _first_chunk(url, LONG)  # occupies the only slot
        try:
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                client(url).completions.create(model="tiny", prompt="x", max_tokens=2)
        finally:
            resp.close()
            c.close()
        _wait_idle(url)
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_disconnect_frees_the_slot(tiny_pair, sched):
    with serve(tiny_pair["bundle"], step_delay=0.01, max_queue=0, scheduler=sched, max_batch=1) as (url, _app):
        before = metrics(url)
        c, resp, _lines = _first_chunk(url, LONG)
        resp.close()  # the client goes away mid-stream
        c.close()
        freed = _wait_idle(url)
        after = metrics(url)
        generated = after[("specdec:generation_tokens_total", ())] - before.get(("specdec:generation_tokens_total", ()), 0)
        assert after[("specdec:request_success_total", (("finished_reason", "abort"),))] == 1
        assert generated < LONG["max_tokens"] // 2, generated  # stopped early, not run to the end
        assert freed < 5
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200  # the slot is free again


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_disconnect_while_queued(tiny_pair, sched):
    """A waiting request whose client leaves is dropped from the queue (never generated)."""
    with serve(tiny_pair["bundle"], step_delay=0.01, max_queue=4, scheduler=sched, max_batch=1) as (url, _app):
        c1, r1, lines1 = _first_chunk(url, LONG)
        host, port = url[len("http://"):].split(":")
        body = json.dumps(LONG).encode()
        raw = socket.create_connection((host, int(port)))  # a second stream, queued behind the first
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").json()["queue_depth"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        raw.close()  # its client leaves while it waits
        while httpx.get(url + "/health").json()["queue_depth"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines1
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
        r1.close()
        c1.close()
        assert text  # the running one was not disturbed
        _wait_idle(url)
        m = metrics(url)
        assert m[("specdec:request_success_total", (("finished_reason", "abort"),))] == 1
        assert m[("specdec:request_success_total", (("finished_reason", "length"),))] == 1


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_deadline_is_a_clean_error(tiny_pair, sched):
    with serve(tiny_pair["bundle"], scheduler=sched) as (url, app):
        body = {**LONG, "stream": False, "specdec": {"drafter": "none", "timeout": 0.008}}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "deadline_exceeded" and r.json()["error"]["type"] == "timeout_error"
        _wait_idle(url)
        m = metrics(url)
        assert m[("specdec:request_success_total", (("finished_reason", "deadline"),))] == 1
        # streamed: the error arrives in-band after the first chunks (the tiny pair's context of 64
        # positions ends a generation in ~20 ms on a quiet machine: the deadline must come sooner)
        with client(url) as c:
            with pytest.raises(openai.APIError, match="deadline"):
                for _ in c.completions.create(model="tiny", prompt="def f(", max_tokens=240, stream=True,
                                              extra_body={"ignore_eos": True,
                                                          "specdec": {"drafter": "none", "timeout": 0.008}}):
                    pass
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_cli_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "specdec_rt.serving", "--bundle", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr


def test_jetson_service_runs_specdec_serve():
    """The systemd unit's command line parses with specdec-serve's own parser."""
    import shlex
    from pathlib import Path

    from specdec_rt.serving.cli import build_parser

    unit = (Path(__file__).parents[1] / "deploy" / "jetson" / "specdec.service").read_text()
    env = dict(line[len("Environment="):].split("=", 1) for line in unit.splitlines()
               if line.startswith("Environment="))
    cmd = next(line[len("ExecStart="):] for line in unit.splitlines() if line.startswith("ExecStart="))
    for key, value in env.items():
        cmd = cmd.replace("${%s}" % key, value)
    argv = shlex.split(cmd)
    assert argv[0].endswith("/specdec-serve") and "$" not in cmd
    args = build_parser().parse_args(argv[1:])
    assert args.provider == "cuda" and args.host == "127.0.0.1" and args.max_context == 1024
    assert "specdec-serve" in (Path(__file__).parents[1] / "deploy" / "jetson" / "run_server.sh").read_text()


def test_scheduler_stops_a_cancelled_job_at_the_next_step(tiny_gen):
    """SerialScheduler directly: after cancel() the worker runs at most the step in progress."""
    import asyncio

    from specdec_rt.serving.scheduler import GenSpec, SerialScheduler

    class Counting(SlowGen):
        steps = 0

        def stream(self, *args, **kwargs):
            for piece in self._gen.stream(*args, **kwargs):
                Counting.steps += 1
                time.sleep(self._delay)
                yield piece

    sched = SerialScheduler(Counting(tiny_gen, 0.005), max_queue=2)
    sched.start()

    async def run():
        ids = tiny_gen.tokenizer.encode("def f(")
        job = sched.submit(GenSpec(ids, {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True,
                                         "drafter": None}))
        queued = sched.submit(GenSpec(ids, {"max_new_tokens": 5, "drafter": None}))
        kinds = []
        async for event in job.events():
            kinds.append(event.kind)
            if len(kinds) == 3:
                queued.cancel()  # still waiting (the worker is busy with job): dropped without running
                at_cancel = Counting.steps
                job.cancel()
        assert [e.kind async for e in queued.events()] == ["cancelled"]
        return kinds, at_cancel

    try:
        kinds, at_cancel = asyncio.run(run())
    finally:
        sched.close(10)
    assert kinds[-1] == "cancelled" and kinds.count("piece") <= 4
    assert Counting.steps <= at_cancel + 1  # the step running at cancel time, no more
    assert sched.running == 0 and sched.queue_depth == 0


# -- the batch scheduler (continuous batching) ------------------------------------------------------------
def _run_jobs(sched, specs, on_event=None):
    """Submit ``specs`` (GenSpec) at once to a started scheduler; returns each job's events."""
    import asyncio

    async def run():
        jobs = [sched.submit(s) for s in specs]

        async def read(i, job):
            out = []
            async for event in job.events():
                out.append(event)
                if on_event is not None:
                    on_event(i, job, event)
            return out

        return await asyncio.gather(*(read(i, j) for i, j in enumerate(jobs)))

    return asyncio.run(run())


BATCH_CASES = [
    ("def wrap(text, width):", {"max_new_tokens": 20, "temperature": 0}),
    ("import heapq\n", {"max_new_tokens": 7, "temperature": 0, "stop": ["\n"]}),
    ("class Stack:\n    def __init__(self):", {"max_new_tokens": 25, "temperature": 0.8, "seed": 3}),
    ("def f(", {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}),
    ("x = 1", {"max_new_tokens": 12, "temperature": 1.0, "top_k": 20, "seed": 11}),
    ("for i in range(", {"max_new_tokens": 18, "temperature": 0}),
]


def test_batch_scheduler_rows_equal_single_runs(tiny_gen):
    """Six requests, four rows: each row's output is the library's single run (greedy and seeded
    sampling with a fixed K, stop strings, max_tokens per row); rows ran concurrently."""
    from specdec_rt.serving.scheduler import BatchScheduler, GenSpec

    sched = BatchScheduler(tiny_gen, 4, max_queue=8)
    sched.start()
    widths = []
    try:
        events = _run_jobs(sched, [GenSpec(tiny_gen.tokenizer.encode(p), dict(kw, num_draft_tokens=3,
                                                                               drafter="model"))
                                   for p, kw in BATCH_CASES],
                           on_event=lambda i, job, e: widths.append(sched.running))
    finally:
        sched.close(10)
    assert max(widths) > 1 and max(widths) <= 4
    for (prompt, kw), evs in zip(BATCH_CASES, events):
        want = tiny_gen.generate(prompt, num_draft_tokens=3, drafter="model", **kw)
        assert evs[-1].kind == "done", evs[-1]
        res = evs[-1].result
        assert res.token_ids == want.token_ids and res.finish_reason == want.finish_reason, prompt
        assert "".join(e.text for e in evs if e.kind == "piece") == res.text == want.text
    assert sched.running == 0 and sched.queue_depth == 0


def test_batch_scheduler_cancel_leaves_other_rows_unchanged(tiny_gen):
    """Cancelling one row (a disconnect) stops it at the next step; the other rows' tokens are those
    of their single runs, and a request with other settings (tree, no drafter) still runs exactly."""
    from specdec_rt.serving.scheduler import BatchScheduler, GenSpec

    sched = BatchScheduler(tiny_gen, 3, max_queue=8)
    sched.start()
    specs = [GenSpec(tiny_gen.tokenizer.encode("def f("), {"max_new_tokens": 200, "temperature": 0,
                                                           "ignore_eos": True, "drafter": "model"}),
             GenSpec(tiny_gen.tokenizer.encode(BATCH_CASES[0][0]), {"max_new_tokens": 40, "temperature": 0,
                                                                     "ignore_eos": True, "drafter": "model"}),
             GenSpec(tiny_gen.tokenizer.encode(BATCH_CASES[2][0]), {"max_new_tokens": 20, "temperature": 0,
                                                                     "drafter": "model", "speculation": "tree",
                                                                     "num_draft_tokens": 6}),
             GenSpec(tiny_gen.tokenizer.encode(BATCH_CASES[5][0]), {"max_new_tokens": 20, "temperature": 0,
                                                                     "drafter": None})]

    def on_event(i, job, event):
        if i == 0 and event.kind == "piece" and not job.cancelled:
            job.cancel()

    try:
        events = _run_jobs(sched, specs, on_event)
    finally:
        sched.close(10)
    assert events[0][-1].kind == "cancelled" and sum(e.kind == "piece" for e in events[0]) <= 2
    for spec, evs in zip(specs[1:], events[1:]):
        want = tiny_gen.generate(spec.prompt_ids, **spec.kwargs)
        assert evs[-1].kind == "done" and evs[-1].result.token_ids == want.token_ids
    assert sched.running == 0 and sched.queue_depth == 0


def test_batch_server_concurrent_requests_equal_library(tiny_pair, tiny_gen):
    """Concurrent HTTP requests on the batch scheduler: each answer is the library's; /health and
    /metrics report the rows running."""
    from concurrent.futures import ThreadPoolExecutor

    with serve(tiny_pair["bundle"], scheduler="batch", max_batch=4, step_delay=0.002,
               num_draft_tokens=3, drafter="model") as (url, app):  # seeded draws: the library's drafter
        c = client(url)

        def one(case):
            prompt, kw = case
            extra = {k: v for k, v in kw.items() if k in ("ignore_eos", "top_k")}
            return c.completions.create(model="tiny", prompt=prompt, max_tokens=kw["max_new_tokens"],
                                        temperature=kw["temperature"], seed=kw.get("seed"), stop=kw.get("stop"),
                                        extra_body=extra).choices[0].text

        seen = []
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                seen.append(httpx.get(url + "/health").json()["running"])
                time.sleep(0.005)

        watcher = threading.Thread(target=poll)
        watcher.start()
        try:
            with ThreadPoolExecutor(6) as ex:
                texts = list(ex.map(one, BATCH_CASES))
        finally:
            stop.set()
            watcher.join()
        for (prompt, kw), text in zip(BATCH_CASES, texts):
            assert text == tiny_gen.generate(prompt, num_draft_tokens=3, drafter="model", **kw).text, prompt
        assert max(seen) > 1 and httpx.get(url + "/health").json()["max_batch"] == 4
        m = metrics(url)
        assert m[("specdec:request_success_total", (("finished_reason", "length"),))] >= 1
        _wait_idle(url)


def test_batch_scheduler_queue_limit_counts_free_rows(tiny_gen):
    """With max_queue=0, as many requests as there are rows are accepted; the next one is QueueFull."""
    import asyncio

    from specdec_rt.serving.scheduler import BatchScheduler, GenSpec, QueueFull

    sched = BatchScheduler(tiny_gen, 2, max_queue=0)  # not started: nothing leaves the queue

    async def run():
        spec = GenSpec([1, 2, 3], {"max_new_tokens": 2})
        jobs = [sched.submit(spec), sched.submit(spec)]
        with pytest.raises(QueueFull):
            sched.submit(spec)
        for job in jobs:
            job.cancel()
        kinds = []
        for job in jobs:
            kinds.append([e.kind async for e in job.events()])
        return kinds

    assert asyncio.run(run()) == [["cancelled"], ["cancelled"]]
    assert sched.queue_depth == 0 and sched.capacity == 2


def test_batch_scheduler_forgets_finished_rows_under_steady_load(tiny_gen):
    """A batch that never empties (a long request keeps it running while short ones come and go)
    must not keep the finished rows' jobs alive: memory stays flat under continuous load."""
    import asyncio
    import gc
    import weakref

    from specdec_rt.serving.scheduler import BatchScheduler, GenSpec

    sched = BatchScheduler(tiny_gen, 2, max_queue=64, step_delay=0.002)
    sched.start()
    try:
        async def run():
            long = sched.submit(GenSpec([1, 2, 3], {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}))
            refs = []
            for i in range(12):  # short requests join the running batch one after another
                job = sched.submit(GenSpec([4, 5, i + 6], {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}))
                assert [e.kind async for e in job.events()][-1] == "done"
                refs.append(weakref.ref(job))
                del job
            await asyncio.sleep(0.3)  # a few more steps: the worker's loop variables move on
            gc.collect()
            alive = sum(r() is not None for r in refs)
            assert sched.running, "the long request should still be decoding"
            long.cancel()
            [e async for e in long.events()]
            return alive

        assert asyncio.run(run()) == 0
    finally:
        sched.close()


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_hybrid_drafter_as_the_server_default(tiny_pair, tiny_gen, sched):
    """`specdec-serve --drafter hybrid` parses, becomes the requests' default, and a greedy
    completion through it equals target-only decoding."""
    from specdec_rt.serving.cli import build_parser, config_from_args

    args = build_parser().parse_args(["--bundle", str(tiny_pair["bundle"]), "--drafter", "hybrid"])
    assert config_from_args(args, tiny_pair["bundle"]).drafter == "hybrid"
    with serve(tiny_pair["bundle"], scheduler=sched, drafter="hybrid") as (url, app):
        assert app.state.api.defaults["drafter"] == "hybrid"
        out = client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0)
        assert out.choices[0].text == tiny_gen.generate(PROMPTS[0], max_new_tokens=16, temperature=0, drafter=None).text
        m = metrics(url)
        assert m.get(("specdec:spec_decode_num_drafts_total", ()), 0) > 0  # it drafted


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_suffix_drafter_with_a_per_user_pool_through_the_server(tiny_pair, tiny_gen, sched):
    """`specdec-serve --drafter suffix --suffix-pool per-user`: requests feed their user's pool (a
    request without a user feeds none), answers stay target-only's, and /metrics splits drafts and
    acceptance by drafter."""
    from specdec_rt.runtime.drafters.suffix import SuffixPool
    from specdec_rt.serving.cli import build_parser

    args = build_parser().parse_args(["--bundle", str(tiny_pair["bundle"]), "--drafter", "suffix",
                                      "--suffix-pool", "per-user", "--suffix-pool-tokens", "5000"])
    assert (args.drafter, args.suffix_pool, args.suffix_pool_tokens) == ("suffix", "per-user", 5000)
    pool = SuffixPool(5000, per_user=True)
    want = tiny_gen.generate(PROMPTS[0], max_new_tokens=24, temperature=0, drafter=None).text
    with serve(tiny_pair["bundle"], scheduler=sched, drafter="suffix", suffix_pool=pool) as (url, app):
        c = client(url)
        for user in ("alice", "alice", None):
            extra = {} if user is None else {"user": user}
            out = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, **extra)
            assert out.choices[0].text == want
        assert pool.added == 2  # alice's two requests; the anonymous one feeds no pool
        for override in ("model", "suffix_hybrid"):  # every runtime drafter name is a request's to choose
            out = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                       extra_body={"specdec": {"drafter": override}})
            assert out.choices[0].text == want
        m = metrics(url)
    drafted = m.get(("specdec:spec_decode_drafter_draft_tokens_total", (("drafter", "suffix"),)), 0)
    accepted = m.get(("specdec:spec_decode_drafter_accepted_tokens_total", (("drafter", "suffix"),)), 0)
    assert drafted > 0 and 0 < accepted <= drafted  # alice's second request copied her first answer
    assert m.get(("specdec:spec_decode_drafter_draft_tokens_total", (("drafter", "model"),)), 0) > 0
    assert sum(v for k, v in m.items() if k[0] == "specdec:spec_decode_drafter_draft_tokens_total") == \
        m[("specdec:spec_decode_num_draft_tokens_total", ())]


def test_server_is_ready_only_when_warm(tiny_pair, tiny_gen):
    """With warm_up (specdec-serve's default), /health answers 503 "warming" until the generator's
    warm-up ran (cost model, every decoding path once); a request sent meanwhile waits in the
    queue and is answered after it, exactly."""
    from concurrent.futures import ThreadPoolExecutor

    import specdec_rt
    from specdec_rt.serving import ServerConfig, create_app

    gen = specdec_rt.load(tiny_pair["bundle"], threads=1)
    gate, spent, real = threading.Event(), {}, gen.warm_up

    def gated(max_batch=None):
        assert gate.wait(30)
        spent.update(real(max_batch))

    gen.warm_up = gated
    app = create_app(gen, ServerConfig(model_name="tiny", warm_up=True))
    want = tiny_gen.generate(PROMPTS[0], max_new_tokens=12, temperature=0, drafter=None).text
    with serve_app(app) as url, ThreadPoolExecutor(1) as pool:
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "warming"
        pending = pool.submit(lambda: client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12,
                                                                     temperature=0))
        time.sleep(0.2)
        assert not pending.done()
        gate.set()
        assert pending.result(60).choices[0].text == want
        h = httpx.get(url + "/health")
        assert h.status_code == 200 and h.json()["status"] == "ok"
    assert {"cost_model", "target_only", "chain"} <= set(spent) and gen.policies.cost_model is not None
    from specdec_rt.serving.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["--bundle", "b"]), tiny_pair["bundle"]).warm_up
    assert not config_from_args(build_parser().parse_args(["--bundle", "b", "--no-warm-up"]), tiny_pair["bundle"]).warm_up


@pytest.mark.parametrize("flag, value, says", [("--port", "-1", "an integer 0..65535"), ("--port", "70000", "an integer 0..65535"),
                                               ("--max-queue", "-3", "an integer >= 0"), ("--max-batch", "0", "an integer >= 1"),
                                               ("--num-draft-tokens", "65", "expected an integer 0..64 or 'auto'"),
                                               ("--num-draft-tokens", "x", "expected an integer 0..64 or 'auto'")])
def test_serve_flags_out_of_range_are_usage_errors(flag, value, says, capsys):
    """Out-of-range numbers are argparse's one-line error (exit 2), not an OverflowError from the
    socket or a ValueError from the scheduler once the model is loaded."""
    from specdec_rt.serving.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--bundle", "b", flag, value])
    assert exc.value.code == 2 and f"argument {flag}: {says}" in capsys.readouterr().err
