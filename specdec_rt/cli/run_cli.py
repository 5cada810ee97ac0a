"""``specdec-run``: generate from a bundle (one prompt, a chat loop, a demo on the shipped pair)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec_rt.cli.common import add_generation_args, fail, generation_kwargs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="specdec-run",
        description="Speculative generation from a specdec-rt bundle on ONNX Runtime.",
    )
    ap.add_argument("--bundle", help="bundle directory written by specdec-export")
    ap.add_argument("--prompt", help="prompt text (or use --prompt-file / stdin with --chat)")
    ap.add_argument("--prompt-file", help="read the prompt from this file")
    ap.add_argument("--provider", default="cpu", help="cpu | cuda | tensorrt (default cpu)")
    ap.add_argument("--draft-provider", default=None, help="provider for the draft (default: --provider)")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads per session")
    ap.add_argument("--max-context", type=int, default=None,
                    help="positions (prompt + generation) to preallocate K/V for "
                         "(default: the bundle's context, at most 4096)")
    ap.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    ap.add_argument("--stream", action="store_true", help="print text as it is committed")
    ap.add_argument("--chat", action="store_true", help="read prompts from stdin line by line")
    ap.add_argument("--demo", action="store_true",
                    help="export the shipped reference pair, generate speculatively and print the "
                         "speedup over target-only decoding measured in the same run")
    ap.add_argument("--demo-dir", default="out/reference-bundle", help="where --demo writes its bundle")
    add_generation_args(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.demo:
        from specdec_rt.cli.demo import run_demo

        return fail(lambda: run_demo(Path(args.demo_dir), args))
    if not args.bundle:
        print("specdec-run: --bundle is required (or use --demo)", file=sys.stderr)
        return 2
    return fail(lambda: _run(args))


def _run(args) -> int:
    import specdec_rt

    gen = specdec_rt.load(args.bundle, provider=args.provider, draft_provider=args.draft_provider,
                          threads=args.threads, shared_thread_pool=True, max_context=args.max_context)
    kwargs = generation_kwargs(args)
    if args.chat:
        for line in sys.stdin:
            line = line.rstrip("\n")
            if not line:
                continue
            for piece in gen.stream(line, **kwargs):
                print(piece, end="", flush=True)
            print()
        return 0
    prompt = args.prompt
    if args.prompt_file:
        prompt = Path(args.prompt_file).read_text()
    if prompt is None:
        print("specdec-run: give --prompt or --prompt-file", file=sys.stderr)
        return 2
    if args.stream and not args.json:
        from specdec_rt.runtime.generator import GenerationResult
        from specdec_rt.runtime.stats import GenerationStats

        result = GenerationResult("", [], GenerationStats())
        for piece in gen.stream(prompt, result=result, **kwargs):
            print(piece, end="", flush=True)
        print()
        _print_stats(result.stats, sys.stderr)
        return 0
    result = gen.generate(prompt, **kwargs)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        _print_stats(result.stats, sys.stderr)
    return 0


def _print_stats(stats, stream) -> None:
    line = (f"[{stats.new_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.target_calls} target calls, {stats.tokens_per_target_call:.2f} tokens/call")
    if stats.proposed:
        line += f", acceptance {stats.acceptance_rate:.1%}"
    if stats.peak_rss_bytes:
        line += f", peak RSS {stats.peak_rss_bytes / 2**20:.0f} MiB"
    print(line + "]", file=stream)


if __name__ == "__main__":
    sys.exit(main())
