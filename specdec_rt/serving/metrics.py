"""Prometheus metrics of the server (prometheus-client), named after vLLM's.

Every name is ``<prefix>:<vLLM's suffix>`` with ``prefix`` "specdec" by default; start the server
with ``--metrics-prefix vllm`` and dashboards built for vLLM read these series unchanged. All
series carry a ``model_name`` label, as vLLM's do.

| name | type | meaning |
|---|---|---|
| ``P:num_requests_running`` | gauge | rows generating now (the batch width; 1 at most with the serial scheduler) |
| ``P:num_requests_waiting`` | gauge | requests in the queue |
| ``P:http_requests_total{method,route,status}`` | counter | HTTP responses by status |
| ``P:request_success_total{finished_reason}`` | counter | finished generations: stop, length, abort (client gone), deadline, error |
| ``P:prompt_tokens_total`` / ``P:generation_tokens_total`` | counter | prompt tokens / tokens generated |
| ``P:prompt_tokens_cached_total`` | counter | prompt tokens whose K/V the cache already held (prefix cache hits) |
| ``P:time_to_first_token_seconds`` | histogram | arrival to first token (queue wait included) |
| ``P:inter_token_latency_seconds`` | histogram | per token: a step committing n tokens after t s counts n observations of t/n |
| ``P:e2e_request_latency_seconds`` | histogram | arrival to the end of the generation |
| ``P:request_queue_time_seconds`` | histogram | arrival to the start of the generation |
| ``P:spec_decode_num_drafts_total`` | counter | draft proposals verified (steps with >= 1 draft token) |
| ``P:spec_decode_num_draft_tokens_total`` | counter | draft tokens proposed |
| ``P:spec_decode_num_accepted_tokens_total`` | counter | draft tokens accepted |
| ``P:spec_decode_num_accepted_tokens_per_pos_total{position}`` | counter | accepted at draft position 0, 1, ... |
| ``P:spec_decode_drafter_drafts_total{drafter}`` | counter | the drafts, per drafter (model, prompt_lookup, hybrid, suffix, suffix_hybrid, eagle) |
| ``P:spec_decode_drafter_draft_tokens_total{drafter}`` | counter | draft tokens proposed, per drafter |
| ``P:spec_decode_drafter_accepted_tokens_total{drafter}`` | counter | draft tokens accepted, per drafter |

The acceptance rate is ``num_accepted_tokens / num_draft_tokens``; the mean accepted length
``1 + num_accepted_tokens / num_drafts`` (vLLM's definitions). The ``drafter`` series split the
same counts by the request's drafter (vLLM's series stay as they are, for its dashboards).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the app

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class ServerMetrics:
    """The server's series in their own registry (several apps may live in one process)."""

    def __init__(self, model_name: str, prefix: str = "specdec") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        p, reg, m = prefix, self.registry, ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(f"{p}:{name}", doc, m + list(labels), registry=reg)

        def histogram(name, doc, buckets):
            return Histogram(f"{p}:{name}", doc, m, buckets=buckets, registry=reg).labels(model_name)

        self.running = Gauge(f"{p}:num_requests_running", "Requests generating now.", m, registry=reg)
        self.waiting = Gauge(f"{p}:num_requests_waiting", "Requests waiting in the queue.", m, registry=reg)
        self.http = counter("http_requests", "HTTP responses by method, route and status.",
                            ("method", "route", "status"))
        self.success = counter("request_success", "Finished generations by finish reason.", ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens.").labels(model_name)
        self.prompt_tokens_cached = counter("prompt_tokens_cached",
                                            "Prompt tokens whose K/V the prefix cache held.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Latency per generated token after the first.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the end of the generation.", E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to the start of the generation.",
                               E2E_BUCKETS)
        self.num_drafts = counter("spec_decode_num_drafts", "Draft proposals verified.").labels(model_name)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(model_name)
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted.").labels(model_name)
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft.", ("position",))
        self.drafter_drafts = counter("spec_decode_drafter_drafts", "Draft proposals verified, by drafter.",
                                      ("drafter",))
        self.drafter_draft_tokens = counter("spec_decode_drafter_draft_tokens", "Draft tokens proposed, by drafter.",
                                            ("drafter",))
        self.drafter_accepted_tokens = counter("spec_decode_drafter_accepted_tokens",
                                               "Draft tokens accepted, by drafter.", ("drafter",))

    def bind(self, scheduler) -> None:
        """Read queue depth and running rows from the scheduler at scrape time."""
        self.running.labels(self.model_name).set_function(lambda: scheduler.running)
        self.waiting.labels(self.model_name).set_function(lambda: scheduler.queue_depth)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- called by the HTTP layer --------------------------------------------------------------
    def http_response(self, method: str, route: str, status: int) -> None:
        self.http.labels(self.model_name, method, route, str(status)).inc()

    # -- called by the scheduler's worker ------------------------------------------------------
    def finished(self, reason: str) -> None:
        self.success.labels(self.model_name, reason).inc()

    def queue_time(self, seconds: float) -> None:
        self.queue.observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds_per_token: float, n: int) -> None:
        for _ in range(n):
            self.itl.observe(seconds_per_token)

    def generation(self, job, result, outcome) -> None:
        """One generation ended (``outcome``: the scheduler's terminal event)."""
        if outcome.kind == "done":
            reason = FINISH.get(result.finish_reason, result.finish_reason)
        elif outcome.kind == "cancelled":
            reason = "abort"
        else:
            reason = "deadline" if outcome.status == 504 else "error"
        self.finished(reason)
        if not result.stats.prompt_tokens:  # refused before prefill
            return
        self.e2e.observe(time.monotonic() - job.arrival)
        self.prompt_tokens.inc(result.stats.prompt_tokens)
        self.prompt_tokens_cached.inc(result.stats.cached_prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        stats = result.stats
        drafts = stats.per_position_proposed[0] if stats.per_position_proposed else 0
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(stats.proposed)
        self.num_accepted_tokens.inc(stats.accepted)
        if stats.drafter is not None:
            drafter = str(stats.drafter)
            self.drafter_drafts.labels(self.model_name, drafter).inc(drafts)
            self.drafter_draft_tokens.labels(self.model_name, drafter).inc(stats.proposed)
            self.drafter_accepted_tokens.labels(self.model_name, drafter).inc(stats.accepted)
        for pos, n in enumerate(stats.per_position_accepted):
            if n:
                self.accepted_per_pos.labels(self.model_name, str(pos)).inc(n)
