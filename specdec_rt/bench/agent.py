"""Multi-turn tool-call loops through ``specdec-serve``: an agent reading, rewriting and fixing
files, served over the OpenAI API as a user's agent framework would call it.

Each session is a repository task for a coding agent whose tools are plain-text actions (``READ
<path>``, ``WRITE <path>`` + the whole file, ``TEST``): turn 1 sends the task, every later turn
sends the scripted tool result of the session's next step (the file's contents, a failing test, a
follow-up request) after the agent's previous reply, so the conversation re-sends everything said
so far and the answers rewrite the file they were just shown: what suffix drafting and the
prefix cache are for (SuffixDecoding's agentic traces). Tool results are scripted so that every
configuration sees the same conversation; it goes on with target-only's answers.

One ``specdec-serve`` process (``--prefix-cache per-user``) on 127.0.0.1 serves every
configuration; the official ``openai`` client streams each turn (TTFT: first content chunk) with
``specdec.num_draft_tokens = 0`` for target-only and the server's defaults (``drafter="auto"``)
otherwise. Each configuration runs a session's turns back to back as its own user (the prefix
cache keeps that user's conversation), configurations one after another per session. Outputs
are compared as text; token counts are the server's ``usage``.
"""
from __future__ import annotations

import resource
import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from specdec_rt.bench.common import OURS_BASE, Outcome, Question, System, load_workload
from specdec_rt.errors import GenerationInputError


def shipped_workload() -> str:
    """The shipped loops: 3 tasks (inventory, durations, TTL cache) x 4 turns."""
    return str(resources.files("specdec_rt") / "data" / "workloads" / "agent_loops.jsonl")


@dataclass
class AgentSession:
    name: str
    system: str
    task: str
    results: list[str]  # the tool results sent as turns 2.. (after each reply)

    @property
    def turns(self) -> int:
        return 1 + len(self.results)


@dataclass
class AgentConfig:
    bundle: str
    questions: str = ""  # the workload's JSONL (default: the shipped one)
    max_new_tokens: int = 384
    drafters: list[str] = field(default_factory=lambda: ["auto"])
    repeats: int = 1
    threads: int | None = None
    sessions: int | None = None
    progress: bool = True
    server_args: list[str] = field(default_factory=list)

    @property
    def per_category(self) -> int:
        return self.sessions or 0


def load_sessions(path: str, limit: int | None = None) -> list[AgentSession]:
    def build(d: dict) -> AgentSession:
        return AgentSession(str(d["session"]), str(d["system"]), str(d["task"]), [str(r) for r in d["results"]])

    out = load_workload(Path(path or shipped_workload()), build, "agent", "session, system, task, results")
    return out[:limit] if limit else out


def conversation(session: AgentSession, answers: list[str], turn: int) -> list[dict]:
    """The messages of turn ``turn`` (0-based): the task, then each earlier answer followed by
    the next scripted tool result."""
    msgs = [{"role": "system", "content": session.system}, {"role": "user", "content": session.task}]
    for t in range(turn):
        msgs += [{"role": "assistant", "content": answers[t]}, {"role": "user", "content": session.results[t]}]
    return msgs


class ServedSystem(System):
    """One configuration, as requests to the server; ``specdec``: the request's extension field."""

    def __init__(self, client, model: str, tokenizer, name: str, specdec: dict | None, is_base: bool) -> None:
        self.client, self.model, self.tokenizer = client, model, tokenizer
        self.name, self.specdec, self.is_base = name, specdec, is_base
        self.family = "ours"
        self.messages: list[dict] = []
        self.user = name

    def run(self, question: Question, ids, text, n) -> Outcome:
        extra = {"specdec": self.specdec} if self.specdec else None
        t0 = time.perf_counter()
        ttft, parts, usage = None, [], None
        stream = self.client.chat.completions.create(
            model=self.model, messages=self.messages, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, user=f"{self.user}/{question.text}", extra_body=extra)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        dt = time.perf_counter() - t0
        answer = "".join(parts)
        self.last_text = answer
        # an Outcome's tokens serve identity (equal lists: equal text, as the text's encoding) and
        # rates (their count): where re-encoding the text gives another count than the server's
        # usage (a token split at a boundary), the list is cut or filled with -1 to the server's
        tokens = self.tokenizer.encode(answer)
        if usage is not None and usage.completion_tokens != len(tokens):
            tokens = (tokens + [-1] * usage.completion_tokens)[:usage.completion_tokens] if answer else []
        return Outcome(tokens, dt, ttft=ttft if ttft is not None else dt)


def run_agent(cfg: AgentConfig) -> dict:
    from openai import OpenAI

    import specdec_rt
    from specdec_rt.bench import spec_bench
    from specdec_rt.serving.loadtest import server_log, start_server, stop_server

    sessions = load_sessions(cfg.questions, cfg.sessions)
    gen = specdec_rt.load(cfg.bundle, threads=1, prefix_cache=False)  # the template and tokenizer only
    proc, url = start_server(cfg.bundle, ["--prefix-cache", "per-user", "--max-batch", "1",
                                          "--max-tokens-limit", str(max(cfg.max_new_tokens, 1)), *cfg.server_args],
                             threads=cfg.threads)
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=3600, max_retries=0)
    model = client.models.list().data[0].id
    systems: list[ServedSystem] = [ServedSystem(client, model, gen.tokenizer, OURS_BASE, {"num_draft_tokens": 0}, True)]
    for d in cfg.drafters:
        spec = None if d == "auto" else {"drafter": d}
        systems.append(ServedSystem(client, model, gen.tokenizer, f"served {d}", spec, False))
    questions: list[Question] = []
    prompts: list[list[int]] = []
    runs: dict[str, dict[int, list[Outcome]]] = {s.name: defaultdict(list) for s in systems}
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.repeats * sum(s.turns for s in sessions) * len(systems), desc="agent", unit="turn")
    try:
        for s in systems:  # warm-up: the server's first calls, per configuration
            s.messages = [{"role": "user", "content": "Say hi."}]
            s.run(Question(-1, "turn 0", "warmup"), None, "", 8)
        for rep in range(cfg.repeats):
            qi = 0
            for sess in sessions:
                answers: list[str] = []
                first_q = qi
                for t in range(sess.turns):  # target-only drives the conversation
                    msgs = conversation(sess, answers, t)
                    ids = gen.apply_chat_template(msgs, tokenize=True)
                    if len(ids) + cfg.max_new_tokens >= gen.max_length:
                        raise GenerationInputError(
                            f"session {sess.name!r}, turn {t + 1}: {len(ids)} prompt tokens and {cfg.max_new_tokens} "
                            f"new ones exceed the context ({gen.max_length}); lower --max-new-tokens")
                    q = Question(qi, f"turn {t + 1}", f"{sess.name}#{rep}")
                    if rep == 0:
                        questions.append(q)
                        prompts.append(ids)
                    base = systems[0]
                    base.messages = msgs
                    runs[base.name][qi].append(base.run(q, ids, "", cfg.max_new_tokens))
                    answers.append(base.last_text)
                    qi += 1
                    if bar is not None:
                        bar.update(1)
                for s in systems[1:]:  # the same conversation, its own user (prefix cache)
                    for t in range(sess.turns):
                        q = Question(first_q + t, f"turn {t + 1}", f"{sess.name}#{rep}")
                        s.messages = conversation(sess, answers, t)
                        runs[s.name][first_q + t].append(s.run(q, None, "", cfg.max_new_tokens))
                        if bar is not None:
                            bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        rc = stop_server(proc)
        log = server_log(proc)
    if rc != 0 or "Traceback" in log:
        raise RuntimeError(f"specdec-serve exited with {rc}:\n{log[-3000:]}")
    results = spec_bench.summarize(cfg, questions, prompts, systems, runs, gen, [],
                                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    results["suite"] = "agent"
    results["group_name"] = "turn"
    results["sessions"] = [s.name for s in sessions]
    results["title"] = (f"Agent tool loops through specdec-serve (OpenAI client, prefix cache per user): "
                        f"{len(sessions)} sessions x up to {max(s.turns for s in sessions)} turns, "
                        f"{cfg.max_new_tokens} new tokens at most, greedy")
    results["plot_title"] = "Agent tool loops through the server: speedup per turn"
    results["settings"]["ignore_eos"] = False
    results["settings"]["served"] = True
    results["settings"]["workload"] = cfg.questions or shipped_workload()
    results["settings"].pop("target_min_rows", None)
    return results


def write(results: dict, out: Path) -> dict:
    from specdec_rt.bench import spec_bench

    return spec_bench.write(results, out, stem="agent")
