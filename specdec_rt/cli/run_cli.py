"""``specdec-run``: generate from a bundle (one prompt, a batch file, a chat loop, a demo on the
shipped pair)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec_rt.cli.common import add_generation_args, fail, generation_kwargs, parse_jsonl, positive_int


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
    ap.add_argument("--batch-file",
                    help="JSONL file, one prompt per line: {\"prompt\": ...} with optional per-row "
                         "max_new_tokens, temperature, top_k, top_p, seed, stop, do_sample, ignore_eos "
                         "(or a bare JSON string); decoded as a batch, one JSON result per line in order")
    ap.add_argument("--batch-size", type=positive_int, default=None,
                    help="with --batch-file: prompts decoding at once (default: all of them, at most 8); "
                         "finished rows are replaced by waiting prompts")
    ap.add_argument("--overlap", action="store_true",
                    help="draft the next block while the target verifies this one (two threads; the models "
                         "get their own thread pools instead of one shared pool); same output")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="with --chat: prefill every turn's whole history (default: a turn keeps the K/V "
                         "of the conversation so far where that is bit-exact on this machine)")
    ap.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    ap.add_argument("--stream", action="store_true", help="print text as it is committed")
    ap.add_argument("--chat", action="store_true",
                    help="conversation on stdin: each line is a user turn, rendered with the bundle's chat "
                         "template together with the history (bundles without one: each line is a plain prompt)")
    ap.add_argument("--system", default=None, help="system prompt for --chat")
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
    if args.system is not None and not args.chat:
        print("specdec-run: --system needs --chat", file=sys.stderr)
        return 2
    return fail(lambda: _run(args))


def _run(args) -> int:
    import specdec_rt

    if args.batch_file and (args.chat or args.prompt or args.prompt_file or args.stream):
        print("specdec-run: --batch-file excludes --prompt, --prompt-file, --chat and --stream", file=sys.stderr)
        return 2
    gen = specdec_rt.load(args.bundle, provider=args.provider, draft_provider=args.draft_provider,
                          threads=args.threads, shared_thread_pool=not args.overlap,
                          max_context=args.max_context, max_batch=args.batch_size, overlap=args.overlap,
                          prefix_cache=not args.no_prefix_cache)
    kwargs = generation_kwargs(args)
    if args.batch_file:
        return _batch(gen, args, kwargs)
    if args.chat:
        return _chat(gen, args, kwargs)
    prompt = args.prompt
    if args.prompt_file:
        prompt = Path(args.prompt_file).read_text()
    if prompt is None:
        print("specdec-run: give --prompt or --prompt-file", file=sys.stderr)
        return 2
    if args.stream and not args.json:
        from specdec_rt.runtime.api.generator import GenerationResult
        from specdec_rt.runtime.core.stats import GenerationStats

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


def read_batch_file(path: str) -> list:
    """Prompts of a JSONL batch file: objects with a "prompt" (and per-row overrides), or strings."""
    from specdec_rt.errors import GenerationInputError

    rows = []
    for n, item in parse_jsonl(Path(path).read_text(), lambda n: f"{path} line {n}"):
        if not isinstance(item, (str, dict)):
            raise GenerationInputError(f"{path} line {n}: expected an object with a \"prompt\" or a string")
        rows.append(item)
    if not rows:
        raise GenerationInputError(f"{path} has no prompts")
    return rows


def _batch(gen, args, kwargs) -> int:
    """One JSON result per input line, in order; a failed row has "error" and the exit status
    is then 1 (the other rows still run and print)."""
    if kwargs.pop("speculation") != "chain":
        print("specdec-run: --batch-file decodes chains (--speculation chain)", file=sys.stderr)
        return 2
    rows = read_batch_file(args.batch_file)
    results = gen.generate_batch(rows, batch_size=args.batch_size, **kwargs)
    for i, res in enumerate(results):
        print(json.dumps({"index": i, **res.to_dict()}), flush=True)
    stats = gen.last_batch_stats
    print(f"[{stats.prompts} prompts, {stats.new_tokens} tokens, {stats.tokens_per_second:.1f} tok/s in total, "
          f"batch width {stats.mean_width:.2f} of {stats.max_rows}, {stats.errors} failed]", file=sys.stderr)
    return 1 if stats.errors else 0


def _chat(gen, args, kwargs) -> int:
    """One user turn per stdin line; the history (with the assistant's replies) is re-rendered
    with the chat template every turn. A turn that fails (e.g. the conversation no longer fits
    the context) is reported on stderr and dropped; the exit status is then 1."""
    from specdec_rt.errors import USER_ERRORS
    from specdec_rt.runtime.api.generator import GenerationResult
    from specdec_rt.runtime.core.stats import GenerationStats

    templated = gen.chat_template is not None
    if not templated:
        print("specdec-run: this bundle has no chat template; each line is completed as a plain prompt "
              "(no history)", file=sys.stderr)
    history: list[dict] = [] if args.system is None else [{"role": "system", "content": args.system}]
    status = 0
    for line in sys.stdin:
        line = line.rstrip("\r\n")
        if not line:
            continue
        result = GenerationResult("", [], GenerationStats())
        if templated:
            history.append({"role": "user", "content": line})
            pieces = gen.chat_stream(history, result=result, **kwargs)
        else:
            pieces = gen.stream(line, result=result, **kwargs)
        try:
            if args.json:
                for _ in pieces:
                    pass
                print(json.dumps(result.to_dict()), flush=True)
            else:
                for piece in pieces:
                    print(piece, end="", flush=True)
                print(flush=True)
        except USER_ERRORS as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            if templated:
                history.pop()
            status = 1
            continue
        if templated:
            history.append({"role": "assistant", "content": result.text})
    return status


def _print_stats(stats, stream) -> None:
    line = (f"[{stats.new_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.target_calls} target calls, {stats.tokens_per_target_call:.2f} tokens/call")
    if stats.proposed:
        line += f", acceptance {stats.acceptance_rate:.1%}"
    if stats.overlap and stats.target_calls:
        line += f", look-ahead kept {stats.lookahead_hits / stats.target_calls:.0%} of steps"
    if stats.peak_rss_bytes:
        line += f", peak RSS {stats.peak_rss_bytes / 2**20:.0f} MiB"
    print(line + "]", file=stream)


if __name__ == "__main__":
    sys.exit(main())
