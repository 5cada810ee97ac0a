"""The deprecated ``POST /generate`` route (the removed stdlib server's body and answers) in the
serving app (``specdec-serve``) on loopback: health, generate == library output, streaming, 400s."""
from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("starlette")

TIMEOUT = 60


@pytest.fixture(scope="module")
def server(tiny_pair):
    """(host, port) of the serving app with /generate (uvicorn in a thread)."""
    from test_serving import serve

    with serve(tiny_pair["bundle"]) as (url, app):
        host, port = url[len("http://"):].split(":")
        yield host, int(port)


def _request(srv, method: str, path: str, body: dict | bytes | None = None):
    host, port = srv
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp, payload


def test_health(server):
    resp, payload = _request(server, "GET", "/health")
    assert resp.status == 200
    info = json.loads(payload)
    assert info["status"] == "ok" and info["has_draft"] is True


def test_generate_matches_library(server, tiny_pair):
    import specdec_rt

    prompt = "def wrap(text, width):"
    expected = specdec_rt.load(tiny_pair["bundle"], threads=1).generate(
        prompt, max_new_tokens=12, num_draft_tokens=3, ignore_eos=True)
    resp, payload = _request(server, "POST", "/generate", {
        "prompt": prompt, "max_new_tokens": 12, "num_draft_tokens": 3, "ignore_eos": True})
    assert resp.status == 200, payload
    out = json.loads(payload)
    assert out["token_ids"] == expected.token_ids
    assert out["text"] == expected.text
    assert out["finish_reason"] == expected.finish_reason
    assert out["stats"]["new_tokens"] == len(expected.token_ids)


def test_generate_streamed(server, tiny_pair):
    host, port = server
    body = {"prompt": "import heapq\n", "max_new_tokens": 10, "stream": True, "ignore_eos": True}
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    conn.request("POST", "/generate", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type") == "text/event-stream"
    assert resp.getheader("Transfer-Encoding") == "chunked"
    raw = resp.read().decode()  # http.client undoes the chunking
    conn.close()
    events = [json.loads(line[len("data: "):]) for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events and events[-1]["done"] is True
    text = "".join(e.get("text", "") for e in events[:-1])
    assert text == events[-1]["text"]
    assert len(events[-1]["token_ids"]) == 10

    resp, payload = _request(server, "POST", "/generate", {k: v for k, v in body.items() if k != "stream"})
    assert json.loads(payload)["token_ids"] == events[-1]["token_ids"]


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": "5"}, "max_new_tokens"),
    ({"prompt": "x", "temperature": 10 ** 400}, "temperature"),
    ({"prompt": "x", "top_p": 10 ** 400, "temperature": 1}, "top_p"),
    ({"prompt": "x", "drafter": "nope"}, "drafter"),
    ({"prompt": ""}, "empty"),
    ({"max_new_tokens": 3}, "prompt"),
    ({"prompt": "x", "bogus": 1}, "bogus"),
    (b"{not json", "JSON"),
])
def test_bad_input_is_400(server, body, needle):
    resp, payload = _request(server, "POST", "/generate", body)
    assert resp.status == 400, payload
    assert needle in json.loads(payload)["error"]


def test_integer_sampling_values_beyond_int64(server):
    """temperature / top_p as integers beyond int64 reached the runtime as Python ints, where numpy's
    check raised TypeError: a 500 (issue 41's fuzz). They are floats now: 2**64 is a temperature."""
    resp, payload = _request(server, "POST", "/generate", {"prompt": "x", "temperature": 2 ** 64, "max_new_tokens": 2})
    assert resp.status == 200, payload


def test_bad_input_streamed_is_400(server):
    resp, payload = _request(server, "POST", "/generate", {"prompt": "x", "temperature": -1, "stream": True})
    assert resp.status == 400
    assert "temperature" in json.loads(payload)["error"]


def test_unknown_route_is_404(server):
    resp, _ = _request(server, "GET", "/nope")
    assert resp.status == 404
