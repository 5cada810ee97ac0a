"""``specdec-head-data``: the target's own responses to a prompt set, the data EAGLE-3 heads train on.

A feature head learns to predict what *its* target says next, so EAGLE-3 trains on responses the
target generated itself (ShareGPT / UltraChat questions with the answers regenerated), not on
human-written text: measured on the reference pair, a head trained on corpus text alone trailed
the draft model (acceptance at K=4 0.63 against 0.72) until a stage on the target's own
continuations. This command produces that data with the runtime itself (speculative, so greedy
responses are exactly the target's, at the bundle's speculative speed), on the machine that will
run the bundle, without torch; ``specdec-train-head --data OUT.jsonl`` reads it.

Input: JSONL files, one conversation per line (or .json files holding a list of them, as
ShareGPT's dumps are), in any of the common layouts: ``{"messages":
[{"role", "content"}...]}`` (OpenAI; assistant turns are dropped and regenerated),
``{"conversations": [{"from": "human"|"gpt"|"system", "value"}...]}`` (ShareGPT), ``{"turns":
[...]}`` (MT-Bench / Spec-Bench), ``{"prompt": "..."}`` or a bare JSON string. Every user turn is
answered in order, each answer joining the history of the next. Output: one line per
conversation, ``{"id", "messages": [...], "finish_reasons", "new_tokens"}`` (bundles with a chat
template), or ``{"id", "text": prompt + response}`` (bundles without one: single-turn prompts).
An interrupted run continues where it stopped (conversations already in ``--out`` are skipped).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from specdec_rt.cli.common import draft_tokens_arg, fail, parse_jsonl, positive_int
from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.drafters.names import DRAFTERS

USER_ROLES = ("user", "human")
ASSISTANT_ROLES = ("assistant", "gpt", "bot", "model", "chatgpt")


@dataclass
class Conversation:
    """The user turns of one input record (assistant turns are regenerated), with its system
    prompt and a stable id (the record's ``id`` / ``question_id``, else ``file:line``)."""

    id: str
    turns: list[str]
    system: str | None = None


def _turns_of(rec, where: str) -> tuple[list[str], str | None]:
    if isinstance(rec, str):
        return [rec], None
    if not isinstance(rec, dict):
        raise GenerationInputError(f"{where}: expected an object or a string, got {type(rec).__name__}")
    if "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list):
            raise GenerationInputError(f"{where}: \"turns\" must be a list of strings")
        return list(turns), rec.get("system")
    if "prompt" in rec:
        return [rec["prompt"]], rec.get("system")
    for key, role_key, text_key in (("messages", "role", "content"), ("conversations", "from", "value")):
        if key in rec:
            msgs = rec[key]
            if not isinstance(msgs, list):
                raise GenerationInputError(f"{where}: \"{key}\" must be a list")
            system, turns = None, []
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or role_key not in m or text_key not in m:
                    raise GenerationInputError(f"{where}: {key}[{i}] needs \"{role_key}\" and \"{text_key}\"")
                role = str(m[role_key]).lower()
                if role == "system":
                    system = m[text_key]
                elif role in USER_ROLES:
                    turns.append(m[text_key])
                elif role not in ASSISTANT_ROLES:
                    raise GenerationInputError(f"{where}: {key}[{i}] has role {m[role_key]!r} "
                                               f"(user, assistant or system)")
            return turns, system
    raise GenerationInputError(f"{where}: a record needs \"messages\", \"conversations\", \"turns\" or \"prompt\"")


def _records(path: Path) -> Iterator[tuple[str, object]]:
    """(place, record) of a JSONL file (place ``:line``), or of a .json file holding one list
    (ShareGPT's dumps; place ``[index]``)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise GenerationInputError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(items, list):
            raise GenerationInputError(f"{path}: a .json prompt file must hold a list of records (else use JSONL)")
        for i, rec in enumerate(items):
            yield f"[{i}]", rec
        return
    for n, rec in parse_jsonl(text, lambda n: f"{path}:{n}"):
        yield f":{n}", rec


def read_conversations(paths: Sequence[str | Path], strict: bool = True) -> tuple[list[Conversation], int]:
    """Every conversation of the input files, in order, and how many were left out. Records that
    are not JSON or not one of the layouts are errors naming the file and line (or index).
    ``strict``: so are records without a non-empty user turn and repeated ids; otherwise (the
    CLI's default, for large scraped dumps) such records are left out and a repeated id gets
    ``#2``, ``#3``... in input order, so a resumed run names them alike."""
    out: list[Conversation] = []
    seen: dict[str, int] = {}
    left_out = 0
    for path in map(Path, paths):
        if not path.is_file():
            raise GenerationInputError(f"prompt file '{path}' does not exist")
        for place, rec in _records(path):
            where = f"{path}{place}"
            turns, system = _turns_of(rec, where)
            if system is not None and not isinstance(system, str):
                raise GenerationInputError(f"{where}: the system prompt must be a string")
            if not turns or any(not isinstance(t, str) or not t.strip() for t in turns):
                if strict:
                    raise GenerationInputError(f"{where}: every user turn must be a non-empty string "
                                               f"(and there must be at least one)")
                left_out += 1
                continue
            rid = rec.get("id", rec.get("question_id")) if isinstance(rec, dict) else None
            cid = str(rid) if rid is not None else f"{path.name}{place}"
            if cid in seen:
                if strict:
                    raise GenerationInputError(f"{where}: conversation id {cid!r} appears twice")
                seen[cid] += 1
                cid = f"{cid}#{seen[cid]}"
            seen.setdefault(cid, 1)
            out.append(Conversation(cid, turns, system))
    if not out:
        raise GenerationInputError("the prompt files hold no conversations")
    return out, left_out


def done_ids(out: Path) -> set[str]:
    """Ids already written to ``out`` (a run to continue); a torn last line is dropped."""
    if not out.is_file():
        return set()
    ids, lines = set(), out.read_text(encoding="utf-8").splitlines()
    good: list[str] = []
    for n, line in enumerate(lines, start=1):
        try:
            ids.add(str(json.loads(line)["id"]))
            good.append(line)
        except (ValueError, KeyError, TypeError):
            if n < len(lines):
                raise GenerationInputError(f"{out}:{n} is not a record of this tool; "
                                           f"choose another --out or remove the file") from None
    if len(good) < len(lines):  # killed mid-write: rewrite without the partial line
        out.write_text("".join(g + "\n" for g in good), encoding="utf-8")
    return ids


def respond(gen, convs: list[Conversation], seeds: Sequence[int] | None = None,
            **kwargs) -> Iterator[tuple[Conversation, dict | None, str | None]]:
    """Answer every user turn of ``convs`` (turn by turn, all conversations of a turn in one
    batch; ``kwargs`` go to ``generate_batch``); per conversation: (it, its output record or
    None, the error that stopped it). A conversation whose later turn fails (its history no
    longer fits the context) keeps the turns answered before it, with ``"truncated"`` saying
    why; one whose first turn fails has no record. ``seeds``: per conversation, sampled turn t
    draws with seed + t (with a fixed ``num_draft_tokens``, the same draws whatever it is batched
    with; "auto" chooses K per batch, so its draws differ, from the same distribution)."""
    chat = gen.chat_template is not None
    if not chat and any(len(c.turns) > 1 or c.system for c in convs):
        raise GenerationInputError("multi-turn conversations and system prompts need a bundle with a chat "
                                   "template (this target has none: give single prompts)")
    history = [([{"role": "system", "content": c.system}] if c.system else []) for c in convs]
    reasons: list[list[str]] = [[] for _ in convs]
    new_tokens = [0] * len(convs)
    errors: list[str | None] = [None] * len(convs)
    for turn in range(max(len(c.turns) for c in convs)):
        live = [i for i, c in enumerate(convs) if turn < len(c.turns) and errors[i] is None]
        if not live:
            break
        rows = []
        for i in live:
            history[i].append({"role": "user", "content": convs[i].turns[turn]})
            prompt = (gen.apply_chat_template(history[i], add_generation_prompt=True, tokenize=True)
                      if chat else convs[i].turns[turn])
            row = {"prompt": prompt}
            if seeds is not None:
                row["seed"] = seeds[i] + turn
            rows.append(row)
        for i, res in zip(live, gen.generate_batch(rows, **kwargs)):
            if res.finish_reason == "error":
                errors[i] = res.error
                history[i].pop()  # the turn that could not be answered
                continue
            history[i].append({"role": "assistant", "content": res.text})
            reasons[i].append(res.finish_reason)
            new_tokens[i] += len(res.token_ids)
    for i, c in enumerate(convs):
        if not reasons[i]:
            yield c, None, errors[i]
            continue
        rec = ({"id": c.id, "messages": history[i]} if chat
               else {"id": c.id, "text": c.turns[0] + history[i][-1]["content"]})  # one turn: its answer last
        rec.update(finish_reasons=reasons[i], new_tokens=new_tokens[i])
        if errors[i] is not None:
            rec["truncated"] = f"after turn {len(reasons[i])} of {len(c.turns)}: {errors[i]}"
        yield c, rec, errors[i]


def default_drafter(gen) -> str:
    """What drafts when ``--drafter`` is not given: the bundle's draft model, else its head (a
    head being retrained drafts for its successor's data), else suffix lookup (free; any bundle)."""
    if gen.draft_engine is not None:
        return "model"
    return "eagle" if gen.head is not None else "suffix"


class _NoBar:
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def _progress(total: int, disabled: bool):
    """A tqdm bar over conversations; none where tqdm is not installed (a bare runtime install)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="responses", unit="conv", disable=disabled)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="specdec-head-data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True, help="the target's bundle (specdec-export)")
    ap.add_argument("--prompts", required=True, nargs="+",
                    help="JSONL files of conversations, or .json files holding a list of them (ShareGPT dumps)")
    ap.add_argument("--out", required=True, help="JSONL file to write (appended to when it exists: a resumed run)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=512, help="per answer (default 512)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (default: the target's most likely answers); > 0 samples")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0, help="sampled runs: per-conversation seeds derive from it")
    ap.add_argument("--drafter", default=None, choices=[*DRAFTERS, "none"],
                    help="default: the bundle's draft model, else its EAGLE-3 head, else suffix lookup")
    ap.add_argument("--num-draft-tokens", "-k", type=draft_tokens_arg, default="auto")
    ap.add_argument("--batch-size", type=positive_int, default=1,
                    help="conversations decoding at once (default 1: on 2 CPU cores a 1.5B target's batched "
                         "calls are compute-bound, measured 2.3x slower at 3 than one at a time; raise it on GPUs)")
    ap.add_argument("--chunk", type=positive_int, default=None,
                    help="conversations per written block (default max(4, 2 x --batch-size)): what an "
                         "interruption loses")
    ap.add_argument("--limit", type=positive_int, default=None, help="answer at most this many conversations")
    ap.add_argument("--threads", type=positive_int, default=None)
    ap.add_argument("--max-context", type=positive_int, default=None,
                    help="positions per conversation (default: the bundle's context, at most 4096); "
                         "later turns that do not fit end the conversation there")
    ap.add_argument("--provider", default="cpu", help="cpu | cuda | tensorrt")
    ap.add_argument("--strict", action="store_true",
                    help="records without a user turn and repeated ids are errors (default: left out / "
                         "numbered id#2, id#3..., as scraped dumps need)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    import specdec_rt

    convs, left_out = read_conversations(args.prompts, strict=args.strict)
    if args.limit:
        convs = convs[:args.limit]
    out = Path(args.out)
    done = done_ids(out)
    todo = [(i, c) for i, c in enumerate(convs) if c.id not in done]
    gen = specdec_rt.load(args.bundle, provider=args.provider, threads=args.threads, shared_thread_pool=True,
                          max_batch=args.batch_size, max_context=args.max_context, prefix_cache=False)
    drafter = args.drafter or default_drafter(gen)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, num_draft_tokens=args.num_draft_tokens,
                  drafter=None if drafter == "none" else drafter, batch_size=args.batch_size)
    chunk = args.chunk or max(4, 2 * args.batch_size)
    print(f"{len(convs)} conversations" + (f" ({left_out} without a user turn left out)" if left_out else "")
          + f", {len(convs) - len(todo)} already in {out}; drafter {drafter}", file=sys.stderr)
    bar = _progress(len(todo), disabled=args.no_progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    failed, truncated, tokens, t0 = 0, 0, 0, time.perf_counter()
    with out.open("a", encoding="utf-8") as f:
        for start in range(0, len(todo), chunk):
            block = todo[start:start + chunk]
            # seeds follow the input order, so a resumed run draws what an uninterrupted one would
            seeds = [args.seed + 1000 * i for i, _ in block] if args.temperature else None
            for conv, rec, err in respond(gen, [c for _, c in block], seeds, **kwargs):
                if rec is None:
                    failed += 1
                    print(f"skipped {conv.id}: {err}", file=sys.stderr)
                    continue
                truncated += err is not None
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                tokens += rec["new_tokens"]
            f.flush()
            bar.update(len(block))
    bar.close()
    secs = time.perf_counter() - t0
    print(f"wrote {len(todo) - failed} conversations ({tokens} new tokens, {tokens / max(secs, 1e-9):.1f} tok/s) "
          f"to {out}" + (f", {truncated} cut short (later turns beyond the context)" if truncated else "")
          + (f"; {failed} skipped" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return fail(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
