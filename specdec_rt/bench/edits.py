"""Multi-turn code edits: a repetitive workload where drafting from what was already said pays.

Each session is a code file and a list of edit requests. Turn 1 asks for the file with the first
edit; every later turn asks for the next edit in the same conversation, the earlier answers in
its history (a chat for instruct bundles; for a bundle without a chat template, plain text:
``# Edit: ...`` / ``# Updated <path>:`` lines between versions). Answers re-emit most of the file,
so tokens repeat from the prompt and from earlier answers: what prompt lookup and the suffix
drafter exploit, and what agentic coding workloads look like (SuffixDecoding, Oliaro et al. 2024).

Per turn, every configuration decodes the same prompt greedily (outputs identical by
construction; checked); the conversation goes on with target-only's answer. The suffix drafters
run with a per-user :class:`~specdec_rt.runtime.drafters.suffix.SuffixPool`, one user per configuration and
session (so no configuration reads another's answer to the same turn), emptied at each repeat.
Reported per turn index and overall, as ``--suite spec-bench`` reports per category.
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
from specdec_rt.runtime.drafters.names import NEEDS_DRAFT_MODEL

SYSTEM_PROMPT = "You are a careful coding assistant. Reply with the whole updated file only, no explanation."


def shipped_workload() -> str:
    """The workload shipped with the package: 3 files x 4 edits (stack, config reader, timer)."""
    return str(resources.files("specdec_rt") / "data" / "workloads" / "code_edits.jsonl")


@dataclass
class EditSession:
    name: str
    path: str
    file: str
    edits: list[str]


@dataclass
class EditsConfig:
    bundle: str
    questions: str = ""  # the workload's JSONL (default: the shipped one)
    max_new_tokens: int = 192
    drafters: list[str] = field(default_factory=lambda: ["model", "prompt_lookup", "hybrid", "suffix",
                                                         "suffix_hybrid"])
    repeats: int = 1
    threads: int | None = None
    sessions: int | None = None  # the first N sessions (default all)
    progress: bool = True
    # each turn keeps the K/V of the conversation so far (the generator's prefix_cache); every
    # configuration then runs a session's turns back to back, from an empty cache
    prefix_cache: bool = True

    @property
    def per_category(self) -> int:  # what summarize() reports as questions per group
        return self.sessions or 0


def load_sessions(path: str, limit: int | None = None) -> list[EditSession]:
    def build(d: dict) -> EditSession:
        session = EditSession(str(d["session"]), str(d["path"]), str(d["file"]), [str(e) for e in d["edits"]])
        if not session.edits:
            raise GenerationInputError(f"session {session.name!r} has no edits")
        return session

    out = load_workload(Path(path or shipped_workload()), build, "edit", "session, path, file, edits")
    return out[:limit] if limit else out


class Conversation:
    """A session's prompt at each turn, chat or plain text, growing with the answers."""

    def __init__(self, gen, session: EditSession) -> None:
        self.gen, self.session = gen, session
        self.chat = gen.bundle.chat_template is not None
        first = f"Here is {session.path}:\n```python\n{session.file}```\n"
        self.messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": first}]
        self.text = f"# {session.path}\n{session.file}"

    def asking(self, turn: int) -> list[dict]:
        """The chat so far with edit ``turn`` (0-based) as the last user message (the first one
        also holds the file)."""
        msgs = [dict(m) for m in self.messages]
        msgs[-1]["content"] = (msgs[-1]["content"] + "\n" if turn == 0 else "") + self.session.edits[turn]
        return msgs

    def prompt(self, turn: int) -> tuple[list[int], str]:
        """The ids and text of turn ``turn``'s prompt (0-based), asking for edit ``turn``."""
        if self.chat:
            msgs = self.asking(turn)
            return self.gen.apply_chat_template(msgs, tokenize=True), self.gen.apply_chat_template(msgs)
        text = self.text + f"\n# Edit: {self.session.edits[turn]}\n# Updated {self.session.path}:\n"
        return self.gen.encode_prompt(text), text

    def answer(self, turn: int, prompt_text: str, answer: str) -> None:
        """Continue the conversation with ``answer`` to turn ``turn``."""
        if self.chat:
            self.messages = self.asking(turn) + [{"role": "assistant", "content": answer},
                                                 {"role": "user", "content": ""}]
        else:
            self.text = prompt_text + answer


class EditSystem(System):
    """One of our configurations; the suffix drafters read and feed the pool as the user
    "<configuration>/<session>" (a question's text is its session)."""

    def __init__(self, gen, name: str, drafter: str | None) -> None:
        self.gen, self.name, self.drafter = gen, name, drafter
        self.family, self.is_base = "ours", drafter is None
        self.user = name

    def run(self, question, ids, text, n) -> Outcome:
        g = self.gen
        t0 = time.perf_counter()
        out = g.generate_ids(ids, max_new_tokens=n, temperature=0.0, drafter=self.drafter, num_draft_tokens="auto",
                             user=f"{self.user}/{question.text}")
        dt = time.perf_counter() - t0
        s = g.last_stats
        return Outcome(out, dt, ttft=s.time_prefill, target_calls=s.target_calls, proposed=s.proposed,
                       accepted=s.accepted, drafter=s.drafter)


def run_edits(cfg: EditsConfig) -> dict:
    import specdec_rt
    from specdec_rt.bench import spec_bench
    from specdec_rt.runtime.drafters.suffix import SuffixPool

    sessions = load_sessions(cfg.questions, cfg.sessions)
    gen = specdec_rt.load(cfg.bundle, threads=cfg.threads, shared_thread_pool=True,
                          suffix_pool=SuffixPool(per_user=True), prefix_cache=cfg.prefix_cache)
    systems: list[System] = [EditSystem(gen, OURS_BASE, None)]
    for d in cfg.drafters:
        if d in NEEDS_DRAFT_MODEL and gen.draft_engine is None:
            continue
        systems.append(EditSystem(gen, f"{d} K=auto", d))
    turns = max(len(s.edits) for s in sessions)
    questions: list[Question] = []  # one per (session, turn): category "turn t", text: the session
    prompts: list[list[int]] = []
    runs: dict[str, dict[int, list[Outcome]]] = {s.name: defaultdict(list) for s in systems}
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.repeats * sum(len(s.edits) for s in sessions) * len(systems), desc="edits", unit="run")

    def run_turn(s: System, q: Question, ids: list[int], text: str) -> None:
        runs[s.name][q.question_id].append(s.run(q, ids, text, cfg.max_new_tokens))
        if bar is not None:
            bar.update(1)

    try:
        first = Conversation(gen, sessions[0]).prompt(0)[0]
        for s in systems:  # warm-up: loads, probes, first-call allocations
            s.run(Question(-1, "turn 0", "warmup"), first, "", 8)
        for rep in range(cfg.repeats):
            gen.suffix_pool.clear()
            qi = 0
            for sess in sessions:
                conv = Conversation(gen, sess)
                turns_of: list[tuple[Question, list[int], str]] = []
                for t in range(len(sess.edits)):
                    ids, text = conv.prompt(t)
                    if len(ids) + cfg.max_new_tokens >= gen.max_length:
                        raise GenerationInputError(
                            f"session {sess.name!r}, turn {t + 1}: {len(ids)} prompt tokens and "
                            f"{cfg.max_new_tokens} new ones exceed the context ({gen.max_length}); "
                            "lower --max-new-tokens or use fewer edits")
                    q = Question(qi, f"turn {t + 1}", sess.name)
                    if rep == 0:
                        questions.append(q)
                        prompts.append(ids)
                    turns_of.append((q, ids, text))
                    if t == 0:
                        gen.clear_prefix_cache()  # a new conversation
                    # with the prefix cache, the other configurations run this session after
                    # target-only, each on its own conversation's cache; without, turn by turn
                    for s in systems[:1] if cfg.prefix_cache else systems:
                        run_turn(s, q, ids, text)
                    conv.answer(t, text, gen.tokenizer.decode(runs[OURS_BASE][qi][-1].tokens))
                    qi += 1
                if cfg.prefix_cache:
                    for s in systems[1:]:
                        gen.clear_prefix_cache()
                        for q, ids, text in turns_of:
                            run_turn(s, q, ids, text)
    finally:
        if bar is not None:
            bar.close()
    results = spec_bench.summarize(cfg, questions, prompts, systems, runs, gen, [],
                                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    results["suite"] = "edits"
    results["group_name"] = "turn"
    results["sessions"] = [s.name for s in sessions]
    results["title"] = (f"Multi-turn code edits: {len(sessions)} sessions x up to {turns} turns, "
                        f"{cfg.max_new_tokens} new tokens at most, greedy, every drafter at K=auto")
    results["plot_title"] = "Multi-turn code edits: speedup per turn"
    results["settings"]["ignore_eos"] = False
    results["settings"]["prefix_cache"] = gen.prefix_cache
    results["settings"]["workload"] = cfg.questions or shipped_workload()
    return results


def write(results: dict, out: Path) -> dict:
    from specdec_rt.bench import spec_bench

    return spec_bench.write(results, out, stem="edits")
