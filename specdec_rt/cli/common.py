"""Arguments and error reporting shared by the command-line tools."""
from __future__ import annotations

import argparse
import sys
import json
from typing import Callable, Iterator

from specdec_rt.errors import GenerationInputError
from specdec_rt.runtime.drafters.names import DRAFTERS


def parse_jsonl(text: str, where: Callable[[int], str]) -> Iterator[tuple[int, object]]:
    """(line number, record) of every non-blank line of JSONL ``text``; a line that is not JSON is
    a GenerationInputError placed by ``where(line)`` (specdec-run's batch files, specdec-head-data)."""
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except ValueError as exc:
            raise GenerationInputError(f"{where(n)}: not valid JSON ({exc})") from None


def bounded_int(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (a port, a batch size, a queue length), so a
    bad value is argparse's one-line usage error, not a traceback from deep inside."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"an integer >= {low}" if high is None else f"an integer {low}..{high}")
        return n
    return parse


positive_int = bounded_int(1)


def draft_tokens_arg(value: str) -> int | str:
    """An argparse type: K as ``auto`` or 0..64 (the runtime's ``MAX_DRAFT_TOKENS``)."""
    from specdec_rt.runtime.loop.requests import MAX_DRAFT_TOKENS

    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        k = None
    if k is None or not 0 <= k <= MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"expected an integer 0..{MAX_DRAFT_TOKENS} or 'auto', got {value!r}")
    return k


def add_generation_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; > 0 samples (default: the bundle's generation_config.json, "
                        "greedy when it has none or does not set do_sample)")
    g.add_argument("--top-k", type=int, default=None, help="0 = off (default: the bundle's)")
    g.add_argument("--top-p", type=float, default=None, help="1 = off (default: the bundle's)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--num-draft-tokens", "-k", type=draft_tokens_arg, default="auto",
                   help="draft length K, or 'auto' (default: the cost-model policy, which decodes "
                        "target-only where drafting does not pay; pass an integer for seed-reproducible sampling)")
    g.add_argument("--drafter", default="auto", choices=[*DRAFTERS, "none"],
                   help="auto (default): the drafter this bundle drafts best with on this machine (the draft "
                        "model or EAGLE-3 head where cheap, else suffix matching, with the draft model where it "
                        "has no match unless the draft is dear; docs/design.md 'Choosing the drafter'); 'none' = "
                        "target-only decoding; "
                        "'eagle' = the bundle's EAGLE-3 head (--draft-head at export)")
    g.add_argument("--speculation", default="chain", choices=["chain", "tree"])
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def generation_kwargs(args) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, num_draft_tokens=args.num_draft_tokens,
        drafter=None if args.drafter == "none" else args.drafter, speculation=args.speculation,
        stop=args.stop, ignore_eos=args.ignore_eos,
    )


def fail(fn: Callable[[], int]) -> int:
    """Run ``fn``; print expected errors as one line instead of a traceback."""
    from specdec_rt.errors import USER_ERRORS

    try:
        return fn()
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
