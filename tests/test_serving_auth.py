"""API keys and TLS (issue 41): 401 on every route but /health (and /metrics) without a valid key,
the library's answers with one, the key checked before the body is read, keys never in logs or
metrics, option errors before the model loads, and HTTPS through the official client."""
from __future__ import annotations

import collections
import json
import os
import pickle
import ssl

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from helpers import make_certificate  # noqa: E402
from test_serving import MESSAGES, PROMPTS, client, serve  # noqa: E402

KEYS = ("sk-first-0123456789abcdef", "sk-second-fedcba9876543210")
ROUTES = [("POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4}),
          ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
          ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
          ("POST", "/generate", {"prompt": PROMPTS[0], "max_new_tokens": 4}), ("GET", "/v1/nothing", None)]
REFUSED = [(None, "missing_api_key"), ("Bearer wrong", "invalid_api_key"), (f"Bearer {KEYS[0]}x", "invalid_api_key"),
           (f"Bearer {KEYS[0][:-1]}", "invalid_api_key"), (f"Basic {KEYS[0]}", "invalid_api_key"),
           (KEYS[0], "invalid_api_key"), ("Bearer", "invalid_api_key"), (f"Token {KEYS[0]}", "invalid_api_key")]


def api_keys(*keys: str):
    from specdec_rt.serving.auth import APIKeys

    return APIKeys(keys)


@pytest.fixture(scope="module")
def keyed(tiny_pair):
    with serve(tiny_pair["bundle"], api_keys=api_keys(*KEYS)) as (url, app):
        yield url


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_no_or_wrong_key_is_401(keyed, method, path, body):
    for auth, code in REFUSED:
        headers = {} if auth is None else {"Authorization": auth}
        r = httpx.request(method, keyed + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (auth, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "authentication_error" and err["code"] == code, (auth, err)
        assert "Bearer" in err["message"] and KEYS[0] not in r.text


def test_fuzzed_authorization_headers_are_401(keyed):
    """Generated Authorization values (random bytes, near misses of a key: one character changed,
    cut, extended, another case, another scheme) on a keyed route: all 401, never a 5xx; the key
    itself passes."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    key = KEYS[0].encode()
    legal = st.binary(min_size=1, max_size=120).map(
        lambda b: bytes(c for c in b if c > 0x20 and c != 0x7f) or b"x")  # what a client can send
    near = st.one_of(
        st.tuples(st.integers(0, len(key) - 1), st.integers(0x21, 0x7e)).filter(lambda t: key[t[0]] != t[1])
        .map(lambda t: key[:t[0]] + bytes([t[1]]) + key[t[0] + 1:]),
        st.integers(1, len(key) - 1).map(lambda i: key[:i]), legal.map(lambda b: key + b),
        st.just(key.upper()), st.just(key + key))
    values = st.one_of(st.tuples(st.sampled_from([b"Bearer ", b"bearer ", b"BEARER  ", b"Basic ", b"Token ", b""]),
                                 st.one_of(near, legal)).map(lambda t: t[0] + t[1]), legal)
    seen = collections.Counter()
    http = httpx.Client(base_url=keyed, timeout=30)

    @settings(max_examples=200, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(values)
    def run(value):
        r = http.get("/v1/models", headers={"Authorization": value})
        seen[r.status_code] += 1
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (value, r.text)

    with http:
        run()
        assert seen == {401: 200}
        assert http.get("/v1/models", headers={"Authorization": b"Bearer " + key}).status_code == 200


def test_right_key_gets_the_library_answer(keyed, tiny_gen):
    for key in KEYS:
        c = openai.OpenAI(base_url=keyed + "/v1", api_key=key, max_retries=0, timeout=60)
        want = tiny_gen.generate(PROMPTS[1], max_new_tokens=12, temperature=0)
        out = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0)
        assert out.choices[0].text == want.text and out.usage.completion_tokens == len(want.token_ids)
        streamed = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed) == want.text
        assert [m.id for m in c.models.list().data] == ["tiny"]
    r = httpx.post(keyed + "/generate", json={"prompt": PROMPTS[1], "max_new_tokens": 12, "temperature": 0},
                   headers={"Authorization": f"bearer  {KEYS[1]}"})  # the scheme in any case, spaces before the key
    assert r.status_code == 200 and r.json()["token_ids"] == want.token_ids
    with pytest.raises(openai.AuthenticationError):
        client(keyed).completions.create(model="tiny", prompt="x", max_tokens=2)


def test_health_and_metrics_are_open_and_hold_no_key(keyed):
    assert httpx.get(keyed + "/health").status_code == 200
    r = httpx.get(keyed + "/metrics")
    assert r.status_code == 200
    assert 'route="/v1/completions",status="401"' in r.text
    assert not any(k in r.text or k[:12] in r.text for k in KEYS)


def test_metrics_requires_key(tiny_pair):
    from specdec_rt.errors import ServerConfigError
    from specdec_rt.serving import ServerConfig, create_app

    with serve(tiny_pair["bundle"], api_keys=api_keys(KEYS[0]), metrics_requires_key=True) as (url, app):
        r = httpx.get(url + "/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(ServerConfigError, match="needs API keys"):
        create_app(object(), ServerConfig(metrics_requires_key=True))


def test_the_key_is_checked_before_the_body_is_read(tiny_pair):
    """An unauthenticated body over --max-body-bytes is 401, not 413: it was never read; at the
    ASGI level the route's receive is not called at all."""
    import asyncio

    from specdec_rt.serving.auth import APIKeyMiddleware

    big = json.dumps({"prompt": "x" * 5000}).encode()
    with serve(tiny_pair["bundle"], api_keys=api_keys(KEYS[0]), max_body_bytes=1000) as (url, app):
        assert httpx.post(url + "/v1/completions", content=big).status_code == 401
        r = httpx.post(url + "/v1/completions", content=big, headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 413
    sent, reached = [], []

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    async def route(scope, receive, send):
        reached.append(scope["path"])

    mw = APIKeyMiddleware(route, api_keys(KEYS[0]), {"/health"})
    for path in ("/v1/completions", "/generate", "/anything"):
        asyncio.run(mw({"type": "http", "path": path, "headers": [(b"content-length", b"999999999")]}, receive, send))
    asyncio.run(mw({"type": "http", "path": "/health", "headers": []}, receive, send))
    asyncio.run(mw({"type": "http", "path": "/v1/completions", "headers": [(b"authorization", f"Bearer {KEYS[0]}".encode())]},
                   receive, send))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [401] * 3
    assert reached == ["/health", "/v1/completions"]


def test_key_sources_are_united(tmp_path):
    from specdec_rt.errors import ServerConfigError
    from specdec_rt.serving.auth import ENV_VAR, load_api_keys

    f = tmp_path / "keys"
    f.write_text("# ops keys\n\n  key-from-file  \n#key-commented\nsecond-file-key\n")
    keys = load_api_keys(["key-from-flag"], str(f), {ENV_VAR: " key-from-env\n"})
    assert len(keys) == 4
    for k in ("key-from-flag", "key-from-file", "second-file-key", "key-from-env"):
        assert keys.accepts(f"Bearer {k}".encode())
    for bad in ("#key-commented", "key-from", "", "key-from-file key-from-env"):
        assert not keys.accepts(f"Bearer {bad}".encode())
    assert not keys.accepts(None) and not keys.accepts(b"key-from-flag")
    assert load_api_keys([], None, {ENV_VAR: ""}) is None and load_api_keys() is None
    for k in ("key-from-flag", "key-from-file", "key-from-env"):  # digests only: no key in a repr or pickle
        assert k not in repr(keys) and k.encode() not in pickle.dumps(keys)
    f.write_text("# nothing but comments\n\n")
    with pytest.raises(ServerConfigError, match="holds no key"):
        load_api_keys(None, str(f), {})
    with pytest.raises(ServerConfigError, match="cannot read --api-key-file"):
        load_api_keys(None, str(tmp_path / "missing"), {})
    f.write_text("good-key\nsecret with spaces\n")
    with pytest.raises(ServerConfigError, match="line 2") as exc:
        load_api_keys(None, str(f), {})
    assert "secret" not in str(exc.value)
    with pytest.raises(ServerConfigError, match="empty API key"):
        load_api_keys([""], None, {})


# -- the command line: option errors before the model loads; HTTPS with keys from every source --------
@pytest.mark.parametrize("extra, status, says", [
    (["--api-key-file", "{tmp}/missing"], 1, "cannot read --api-key-file"),
    (["--api-key-file", "{tmp}/empty"], 1, "holds no key"),
    (["--api-key", "two words"], 1, "visible ASCII"),
    (["--metrics-requires-key"], 2, "--metrics-requires-key needs a key"),
    (["--ssl-keyfile", "{tmp}/key.pem"], 2, "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-certfile", "{tmp}/cert.pem", "--ssl-keyfile", "{tmp}/missing"], 1, "cannot read"),
    (["--ssl-certfile", "{tmp}/key.pem", "--ssl-keyfile", "{tmp}/key.pem"], 1, "do not load"),
])
def test_security_option_errors_come_before_the_model_loads(tmp_path, capsys, monkeypatch, extra, status, says):
    """One line on stderr; the bundle does not exist, so an error naming it would mean the model
    was being loaded first."""
    from specdec_rt.serving.cli import main

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)

    make_certificate(tmp_path)
    (tmp_path / "empty").write_text("# no key yet\n")
    argv = ["--bundle", str(tmp_path / "no-bundle"), *[a.format(tmp=tmp_path) for a in extra]]
    if status == 2:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    else:
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert says in err and "no-bundle" not in err and "two words" not in err and "Traceback" not in err
    if status == 1:
        assert err.startswith("error: ") and err.count("\n") == 1, err


def test_non_loopback_without_a_key_warns(tmp_path):
    import subprocess
    import sys

    def run(*extra, env=None):
        return subprocess.run([sys.executable, "-m", "specdec_rt.serving", "--bundle", str(tmp_path / "none"),
                               "--host", "0.0.0.0", *extra], capture_output=True, text=True, timeout=120,
                              env={**{k: v for k, v in os.environ.items() if k != "SPECDEC_API_KEY"}, **(env or {})})

    r = run()
    assert r.returncode == 1 and r.stderr.startswith("warning: serving on 0.0.0.0 without an API key"), r.stderr
    assert r.stderr.count("\n") == 2 and r.stderr.splitlines()[1].startswith("error: ")
    r = run(env={"SPECDEC_API_KEY": KEYS[0]})
    assert r.returncode == 1 and "warning" not in r.stderr and KEYS[0] not in r.stderr


def test_https_with_keys_from_every_source(tiny_pair, tiny_gen, tmp_path):
    """specdec-serve --ssl-keyfile/--ssl-certfile and keys from --api-key, --api-key-file and
    SPECDEC_API_KEY, driven over HTTPS by the official client trusting the test's certificate;
    no key reaches the logs (access log and debug level on) or /metrics."""
    from specdec_rt.serving.loadtest import server_log, start_server, stop_server

    cert, key = make_certificate(tmp_path)
    flag_key, file_key, env_key = "sk-flag-1a2b3c4d5e", "sk-file-6f7a8b9c0d", "sk-env-e1f2a3b4c5"
    (tmp_path / "keys").write_text(f"# serving keys\n{file_key}\n")
    proc, url = start_server(str(tiny_pair["bundle"]), [
        "--api-key", flag_key, "--api-key-file", str(tmp_path / "keys"), "--ssl-keyfile", str(key),
        "--ssl-certfile", str(cert), "--access-log", "--log-level", "debug", "--no-warm-up",
        "--served-model-name", "tiny", "--drafter", "model"], threads=1,
        env={**os.environ, "SPECDEC_API_KEY": env_key})
    try:
        assert url.startswith("https://127.0.0.1:")
        ca = ssl.create_default_context(cafile=str(cert))
        want = tiny_gen.generate(PROMPTS[0], max_new_tokens=12, temperature=0)
        for k in (flag_key, file_key, env_key):  # closed after use: asyncio waits up to 30 s at shutdown
            # for an idle TLS peer's close_notify
            with openai.OpenAI(base_url=url + "/v1", api_key=k, max_retries=0, timeout=60,
                               http_client=httpx.Client(verify=ca)) as c:
                assert c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0) \
                    .choices[0].text == want.text
        with httpx.Client(verify=ca, timeout=60) as h:
            r = h.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-nope"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert h.get(url + "/health").status_code == 200
            scraped = h.get(url + "/metrics").text
        with pytest.raises(httpx.ConnectError):  # the CA is required: the certificate is not a public one
            httpx.get(url + "/health", timeout=10)
        with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port
            httpx.get(url.replace("https", "http") + "/health", timeout=10)
        import urllib.request

        with urllib.request.urlopen(url + "/health", context=ca, timeout=60) as resp:
            assert resp.status == 200
    finally:
        assert stop_server(proc) == 0
    out = proc.stdout.read()
    log = server_log(proc) + out
    assert '"POST /v1/completions HTTP/1.1" 200' in log and '401' in log  # the access log is on
    for k in (flag_key, file_key, env_key, "sk-nope"):
        assert k not in log and k[:10] not in scraped
