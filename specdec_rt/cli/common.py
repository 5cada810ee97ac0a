"""Arguments and error reporting shared by the command-line tools."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from specdec_rt.runtime.drafter_names import DRAFTERS


def draft_tokens_arg(value: str) -> int | str:
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


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
    g.add_argument("--drafter", default="model", choices=[*DRAFTERS, "none"],
                   help="'none' = target-only decoding; 'eagle' = the bundle's EAGLE-3 head (--draft-head at export)")
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
