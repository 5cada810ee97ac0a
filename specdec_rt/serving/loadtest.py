"""Load and fault test of a running server (needs httpx): docs/serving.md's figures come from here.

    python scripts/load_test.py --bundle BUNDLE            # starts specdec-serve on loopback, then tests it
    python -m specdec_rt.serving.loadtest --url http://127.0.0.1:8000

What it does, in order:

1. **reference**: each prompt once, alone, greedy (``temperature`` 0), non-streamed: the expected
   text of every later request with that prompt (a single-request greedy run);
2. **warm-up**: the same mix, as many requests as the load (``--warmup``): from a cold start the
   server's RSS grows for about one such round (allocator arenas, buffers) and is flat after it;
   then the RSS is read (``--pid``, or the server it started);
3. **load**: ``--requests`` requests over ``--concurrency`` connections, a deterministic mix of
   streamed (``include_usage``) and non-streamed completions, clients that disconnect after their
   first streamed chunk, and malformed bodies (invalid JSON, wrong types, bad values, unknown
   model, over-long prompt, oversized body); ``/health`` is polled throughout;
4. the RSS again.

Every well-formed request must complete with text identical to its reference or get a clean
error (an HTTP status below 500 with an OpenAI error body: 429 when the queue is full); every
malformed one must get a 4xx with an OpenAI error body. The report counts outcomes by kind, TTFT
(streamed requests, client side) p50 / p99, latency, generated tokens per second over the load
phase, /health latency and failures, and RSS before / after.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "def wrap(text, width):",
    "import heapq\n",
    "class Stack:\n    def __init__(self):",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "for line in open(path):",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "    return sorted(items, key=lambda",
    "# split a shell command line into words\n",
]


def malformed_bodies(model: str, max_body_bytes: int) -> list[tuple[str, bytes]]:
    """(name, body) pairs every server must answer with a 4xx."""
    def j(obj) -> bytes:
        return json.dumps(obj).encode()

    return [
        ("truncated_json", b'{"prompt": "x", "max_tokens": '),
        ("not_an_object", b"[1, 2, 3]"),
        ("prompt_wrong_type", j({"model": model, "prompt": 5})),
        ("max_tokens_negative", j({"model": model, "prompt": "x", "max_tokens": -3})),
        ("max_tokens_huge", j({"model": model, "prompt": "x", "max_tokens": 10 ** 9})),
        ("max_tokens_string", j({"model": model, "prompt": "x", "max_tokens": "8"})),
        ("temperature_negative", j({"model": model, "prompt": "x", "temperature": -1})),
        ("top_p_zero", j({"model": model, "prompt": "x", "top_p": 0})),
        ("n_2", j({"model": model, "prompt": "x", "n": 2})),
        ("unknown_model", j({"model": "no-such-model", "prompt": "x"})),
        ("prompt_over_context", j({"model": model, "prompt": "def f(x):\n" * 4000, "max_tokens": 4})),
        ("oversized_body", j({"model": model, "prompt": "a" * (max_body_bytes + 1)})),
    ]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    idx = min(len(values) - 1, max(0, int(round(q / 100 * (len(values) - 1)))))
    return values[idx]


def _clean_error(status: int, payload: bytes) -> str | None:
    """The error's kind if it is clean (status < 500, OpenAI error body), else None."""
    if status >= 500:
        return None
    try:
        err = json.loads(payload)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or "Traceback" in err["message"]:
        return None
    return f"{status} {err.get('code') or err.get('type')}"


class LoadTest:
    def __init__(self, url: str, model: str | None = None, prompts: list[str] | None = None, requests: int = 200,
                 concurrency: int = 16, max_tokens: int = 32, disconnect_share: float = 0.1,
                 malformed_share: float = 0.08, seed: int = 0, pid: int | None = None,
                 max_body_bytes: int = 1 << 20, timeout: float = 120.0, warmup: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.prompts = prompts or PROMPTS
        self.requests = requests
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.disconnect_share = disconnect_share
        self.malformed_share = malformed_share
        self.seed = seed
        self.pid = pid
        self.max_body_bytes = max_body_bytes
        self.timeout = timeout
        self.warmup = requests if warmup is None else warmup
        self.expected: dict[str, str] = {}

    def _body(self, prompt: str, stream: bool) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def plan(self, n: int, rng: random.Random) -> list[tuple[str, object]]:
        bad = malformed_bodies(self.model, self.max_body_bytes)
        out = []
        for i in range(n):
            r = rng.random()
            if r < self.malformed_share:
                out.append(("malformed", bad[i % len(bad)]))
            elif r < self.malformed_share + self.disconnect_share:
                out.append(("disconnect", self.prompts[i % len(self.prompts)]))
            else:
                out.append(("stream" if rng.random() < 0.5 else "complete", self.prompts[i % len(self.prompts)]))
        return out

    async def one(self, client, kind: str, arg) -> dict:
        t0 = time.perf_counter()
        url = self.url + "/v1/completions"
        try:
            if kind == "malformed":
                name, data = arg
                resp = await client.post(url, content=data, headers={"Content-Type": "application/json"})
                err = _clean_error(resp.status_code, resp.content)
                ok = err is not None and 400 <= resp.status_code < 500
                return {"kind": kind, "name": name, "outcome": "clean_error" if ok else "unclean",
                        "error": err or f"{resp.status_code} {resp.text[:200]}"}
            if kind == "complete":
                resp = await client.post(url, json=self._body(arg, False))
                lat = time.perf_counter() - t0
                if resp.status_code != 200:
                    err = _clean_error(resp.status_code, resp.content)
                    return {"kind": kind, "outcome": "clean_error" if err else "unclean",
                            "error": err or f"{resp.status_code} {resp.text[:200]}"}
                out = resp.json()
                text = out["choices"][0]["text"]
                return {"kind": kind, "outcome": "identical" if text == self.expected[arg] else "mismatch",
                        "prompt": arg, "text": text, "latency": lat, "tokens": out["usage"]["completion_tokens"]}
            # streamed (kind "stream" or "disconnect")
            async with client.stream("POST", url, json=self._body(arg, True)) as resp:
                if resp.status_code != 200:
                    payload = await resp.aread()
                    err = _clean_error(resp.status_code, payload)
                    return {"kind": kind, "outcome": "clean_error" if err else "unclean",
                            "error": err or f"{resp.status_code} {payload[:200]!r}"}
                ttft, text, tokens, done, error = None, [], 0, False, None
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = chunk["error"]
                        continue
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices", []):
                        if choice.get("text"):
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            text.append(choice["text"])
                    if kind == "disconnect" and text:
                        break  # leave mid-stream: closing the response drops the connection
                if kind == "disconnect":
                    return {"kind": kind, "outcome": "disconnected", "ttft": ttft}
                lat = time.perf_counter() - t0
                if error is not None:
                    clean = isinstance(error, dict) and isinstance(error.get("message"), str)
                    return {"kind": kind, "outcome": "clean_error" if clean else "unclean",
                            "error": f"in-stream {error.get('code') if clean else error}"}
                if not done:
                    return {"kind": kind, "outcome": "unclean", "error": "stream ended without [DONE]"}
                joined = "".join(text)
                return {"kind": kind, "outcome": "identical" if joined == self.expected[arg] else "mismatch",
                        "prompt": arg, "text": joined, "ttft": ttft, "latency": lat, "tokens": tokens}
        except Exception as exc:  # noqa: BLE001 - connection errors and the like are findings
            return {"kind": kind, "outcome": "unclean", "error": f"{type(exc).__name__}: {exc}"}

    async def health_poller(self, client, stop: asyncio.Event, out: dict) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                resp = await client.get(self.url + "/health")
                ok = resp.status_code == 200
            except Exception:  # noqa: BLE001
                ok = False
            lat = time.perf_counter() - t0
            out["checks"] += 1
            out["failures"] += 0 if ok else 1
            out["max_latency_s"] = max(out["max_latency_s"], lat)
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass

    async def batch(self, client, plan) -> list[dict]:
        sem = asyncio.Semaphore(self.concurrency)

        async def guarded(kind, arg):
            async with sem:
                return await self.one(client, kind, arg)

        return await asyncio.gather(*(guarded(k, a) for k, a in plan))

    async def run(self) -> dict:
        import httpx

        limits = httpx.Limits(max_connections=self.concurrency + 4, max_keepalive_connections=self.concurrency + 4)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            if self.model is None:
                self.model = (await client.get(self.url + "/v1/models")).json()["data"][0]["id"]
            for prompt in self.prompts:  # 1. single-request greedy references
                resp = await client.post(self.url + "/v1/completions", json=self._body(prompt, False))
                resp.raise_for_status()
                self.expected[prompt] = resp.json()["choices"][0]["text"]
            rng = random.Random(self.seed)
            bad = [("malformed", b) for b in malformed_bodies(self.model, self.max_body_bytes)]
            warm = await self.batch(client, bad + self.plan(self.warmup, rng))  # 2. warm-up
            rss_before = rss_bytes(self.pid) if self.pid else None
            health = {"checks": 0, "failures": 0, "max_latency_s": 0.0}
            stop = asyncio.Event()
            poller = asyncio.ensure_future(self.health_poller(client, stop, health))
            t0 = time.perf_counter()
            results = await self.batch(client, self.plan(self.requests, rng))  # 3. load
            wall = time.perf_counter() - t0
            stop.set()
            await poller
            await asyncio.sleep(0.5)  # let the server finish cancelled steps
            rss_after = rss_bytes(self.pid) if self.pid else None
        return self.report(results, warm, wall, health, rss_before, rss_after)

    def report(self, results, warm, wall, health, rss_before, rss_after) -> dict:
        outcomes: dict[str, int] = {}
        kinds: dict[str, int] = {}
        errors: dict[str, int] = {}
        for r in results:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
            if "error" in r:
                key = f"{r['kind']}: {r['error']}"
                errors[key] = errors.get(key, 0) + 1
        ttft = [r["ttft"] for r in results if r.get("ttft") is not None and r["kind"] == "stream"]
        lat = [r["latency"] for r in results if r.get("latency") is not None]
        tokens = sum(r.get("tokens", 0) for r in results)
        rep = {
            "requests": len(results), "concurrency": self.concurrency, "max_tokens": self.max_tokens,
            "by_kind": kinds, "outcomes": outcomes, "errors_by_kind": errors,
            "mismatches": [r for r in results if r["outcome"] == "mismatch"][:5],
            "unclean": [r for r in results + warm if r["outcome"] == "unclean"][:10],
            "warmup_unclean_or_mismatch": sum(r["outcome"] in ("unclean", "mismatch") for r in warm),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
            "generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
            "health": health, "rss_before": rss_before, "rss_after": rss_after,
            "rss_growth": (rss_after / rss_before - 1) if rss_before and rss_after else None,
        }
        return rep


def markdown(rep: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{1000 * x:.0f} ms"

    lines = [
        "| figure | value |", "|---|---|",
        f"| requests (concurrency) | {rep['requests']} ({rep['concurrency']}) |",
        "| mix | " + ", ".join(f"{k} {v}" for k, v in sorted(rep["by_kind"].items())) + " |",
        "| outcomes | " + ", ".join(f"{k} {v}" for k, v in sorted(rep["outcomes"].items())) + " |",
        f"| TTFT p50 / p99 (streamed, client side) | {ms(rep['ttft_p50_s'])} / {ms(rep['ttft_p99_s'])} |",
        f"| latency p50 / p99 (completed) | {ms(rep['latency_p50_s'])} / {ms(rep['latency_p99_s'])} |",
        f"| generated tokens / s (all streams) | {rep['tokens_per_s']:.0f} ({rep['generated_tokens']} tokens in "
        f"{rep['wall_s']:.1f} s) |",
        f"| /health | {rep['health']['checks']} checks, {rep['health']['failures']} failures, max "
        f"{ms(rep['health']['max_latency_s'])} |",
    ]
    if rep["rss_before"]:
        lines.append(f"| server RSS before / after | {rep['rss_before'] / 2**20:.1f} / {rep['rss_after'] / 2**20:.1f} MiB "
                     f"({100 * rep['rss_growth']:+.1f}%) |")
    if rep["errors_by_kind"]:
        lines += ["", "| errors by kind | count |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(rep["errors_by_kind"].items())]
    return "\n".join(lines)


def start_server(bundle: str, extra: list[str], threads: int | None, env=None) -> tuple[subprocess.Popen, str]:
    """``specdec-serve`` on 127.0.0.1 and a free port, as a child process; returns it and its URL.
    Its stderr goes to a temporary file (``server_log(proc)``), so a chatty server never blocks."""
    cmd = [sys.executable, "-m", "specdec_rt.serving", "--bundle", bundle, "--host", "127.0.0.1", "--port", "0",
           "--log-level", "warning", *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    proc.err_file = err
    line = proc.stdout.readline()
    if " on http" not in line:  # http:// or https://
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the server did not start: {line}{server_log(proc)[-2000:]}")
    url = line.split(" on ", 1)[1].split()[0]
    return proc, url


def server_log(proc: subprocess.Popen) -> str:
    proc.err_file.seek(0)
    return proc.err_file.read()


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="load_test", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", help="start specdec-serve on this bundle (127.0.0.1, a free port)")
    src.add_argument("--url", help="test a running server")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    ap.add_argument("--threads", type=int, default=None, help="with --bundle: the server's --threads")
    ap.add_argument("--server-arg", action="append", default=[], help="with --bundle: extra specdec-serve argument")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests before the RSS baseline "
                    "(default: --requests)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--malformed-share", type=float, default=0.08)
    ap.add_argument("--prompts", default=None, help="a .jsonl of {'prompt': ...} or a text file, one per line")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    prompts = None
    if args.prompts:
        raw = Path(args.prompts).read_text(encoding="utf-8").splitlines()
        prompts = [json.loads(x)["prompt"] if args.prompts.endswith(".jsonl") else x for x in raw if x.strip()]
    proc, url, pid = None, args.url, args.pid
    if args.bundle:
        proc, url = start_server(args.bundle, args.server_arg, args.threads)
        pid = proc.pid
    try:
        test = LoadTest(url, prompts=prompts, requests=args.requests, concurrency=args.concurrency,
                        max_tokens=args.max_tokens, disconnect_share=args.disconnect_share,
                        malformed_share=args.malformed_share, seed=args.seed, pid=pid, warmup=args.warmup)
        rep = asyncio.run(test.run())
    finally:
        code = stop_server(proc) if proc is not None else None
    if code is not None:
        rep["server_exit_status"] = code
    print(markdown(rep))
    if args.out:
        Path(args.out).write_text(json.dumps(rep, indent=2))
    bad = rep["outcomes"].get("unclean", 0) + rep["outcomes"].get("mismatch", 0) + rep["health"]["failures"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
