"""``specdec-bench``: speedup, acceptance and cost model, side by side with the peers."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from specdec_rt.cli.common import fail


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _ints(allow_auto: bool = False):
    """An argparse type: a comma-separated list of positive integers (bad items get argparse's
    one-line usage error, not a traceback). With ``allow_auto`` (``--k``), ``auto`` may appear:
    adaptive K runs anyway unless ``--no-auto``."""
    def parse(value: str) -> list[int]:
        out = []
        for item in _csv(value):
            if allow_auto and item == "auto":
                continue
            if not item.isdigit() or int(item) == 0:
                raise argparse.ArgumentTypeError(
                    f"expected positive integers, comma separated, got {item!r}"
                    + (" (K=auto runs unless --no-auto)" if allow_auto else ""))
            out.append(int(item))
        return out
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec-bench", description=__doc__)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--prompts", default=None,
                    help="prompts file (.jsonl with a 'prompt' field, or text blocks separated by blank "
                         "lines); default: the reference pair's held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", default="1,2,4,8", type=_ints(allow_auto=True),
                    help="draft lengths to run, comma separated (K=auto also runs, unless --no-auto)")
    ap.add_argument("--drafter", default=None, help="drafters, comma separated (default model,prompt_lookup, plus eagle when the bundle "
                    "has an EAGLE-3 head; with --suite edits: model,prompt_lookup,hybrid,suffix,suffix_hybrid)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--peers", default="",
                    help="transformers,onnxruntime-genai,llama.cpp (optional extras; llama.cpp needs its tools: "
                         "scripts/build_llama_cpp.sh, and GGUF files: --gguf-target/--gguf-draft)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats per prompt")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-tree", action="store_true", help="skip tree speculation")
    ap.add_argument("--tree-budgets", default="7,10,15", type=_ints(),
                    help="tree node budgets; each also runs a chain of the same verify width")
    ap.add_argument("--no-auto", action="store_true", help="skip adaptive K")
    ap.add_argument("--overlap", action="store_true",
                    help="also run the model drafter's chains with drafting overlapped with verification "
                         "(every model K and auto); all models then use per-session thread pools")
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--compare-graphs", action="store_true",
                    help="node count and per-call latency (S=1, S=5) vs onnxruntime-genai's graphs")
    ap.add_argument("--graphs-only", action="store_true",
                    help="only the cost model (T(S), c, predicted speedups) and, with --compare-graphs, "
                         "the graph comparison: no generation runs (for large checkpoints)")
    ap.add_argument("--peer-cache", default="out/peer-models", help="where peer model exports are cached")
    ap.add_argument("--batch", default=None, type=_ints(),
                    help="batch sizes, comma separated (e.g. 1,2,4,8): measure total throughput of that many "
                         "concurrent prompts, speculative (--k, K=auto) vs target-only at each size, instead "
                         "of the single-sequence benchmark; writes batch_results.json/.md and batch_throughput.png")
    ap.add_argument("--batch-requests", type=int, default=None,
                    help="with --batch: requests per run (the prompts cycled; default twice the largest batch)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="elapsed time, or this process's CPU time (needs --threads 1; other "
                         "users of a shared machine do not distort it)")
    ap.add_argument("--suite", nargs="+", metavar=("NAME", "PATH"), default=None,
                    help="a benchmark suite instead of --prompts: 'spec-bench [question.jsonl]' runs Spec-Bench's "
                         "questions (first turns, chat template applied) and reports per category; writes "
                         "spec_bench.json/.md/.png. 'grounded [questions.jsonl]': single-turn requests whose answers "
                         "copy from the prompt (code edits, refactors, tests for given code, quoting a document; "
                         "default: the shipped set), every question, answers stopping at EOS; writes "
                         "grounded.json/.md/.png. 'edits [sessions.jsonl]': multi-turn code edits (default: "
                         "the shipped workload), every drafter at K=auto, per turn; writes edits.json/.md/.png. 'agent "
                         "[sessions.jsonl]': multi-turn tool-call loops of a coding agent sent to specdec-serve "
                         "with the OpenAI client (prefix cache per user), target-only against the server's "
                         "default (--drafter: others), per turn; writes agent.json/.md/.png")
    ap.add_argument("--sessions", type=int, default=None, help="with --suite edits / agent: the first N sessions")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="with --suite edits: prefill every turn's whole history (default: each turn keeps "
                         "the K/V of the conversation so far, as load(prefix_cache=True) does)")
    ap.add_argument("--categories", default=None, help="with --suite spec-bench: categories, comma separated (default all)")
    ap.add_argument("--questions-per-category", type=int, default=None,
                    help="with --suite spec-bench / grounded: the first N questions of each category (default: 2 "
                         "of Spec-Bench's, every grounded one)")
    ap.add_argument("--baseline-bundle", default=None, metavar="BUNDLES",
                    help="with --suite spec-bench: other bundles of the same checkpoint (comma separated), whose "
                         "target-only decoding on its one-row kernel joins the baselines: speedups are over "
                         "the fastest target-only of any of them (e.g. a w8a8 bundle against the int4 export)")
    ap.add_argument("--peer-k", default="4", type=_ints(), help="with --suite: the peers' draft lengths, comma separated")
    ap.add_argument("--gguf-target", default=None,
                    help="llama.cpp peer: the target's GGUF file (default: the bundle's source, if it was a GGUF)")
    ap.add_argument("--gguf-draft", default=None, help="llama.cpp peer: the draft's GGUF file (default: as --gguf-target)")
    ap.add_argument("--peer-omp-wait-policy", default=None, choices=["active", "passive"],
                    help="llama.cpp peer: OMP_WAIT_POLICY for its tools (default: unset, OpenMP's default, as users "
                         "run them; an OMP_WAIT_POLICY in this environment is not passed on); recorded in the results")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.drafter_given = args.drafter is not None
    args.drafter = args.drafter or "model,prompt_lookup"

    def run() -> int:
        from specdec_rt.bench import report
        from specdec_rt.bench.runner import BenchConfig, load_prompts, run_bench

        if args.suite:
            return _suite(args, argv)
        prompts = load_prompts(args.prompts)
        if args.num_prompts:
            prompts = prompts[: args.num_prompts]
        if args.batch:
            return _batch(args, prompts, argv)
        cfg = BenchConfig(
            bundle=args.bundle, prompts=prompts, max_new_tokens=args.max_new_tokens,
            ks=args.k, temperature=args.temperature,
            drafters=_csv(args.drafter) + ([] if args.drafter_given else ["eagle"]),  # eagle: skipped without a head
            peers=_csv(args.peers), repeats=args.repeats, threads=args.threads, tree=not args.no_tree,
            auto=not args.no_auto, peer_cache=args.peer_cache, progress=not args.quiet,
            compare_graphs=args.compare_graphs, graphs_only=args.graphs_only, tree_budgets=args.tree_budgets,
            overlap=args.overlap, clock=args.clock, gguf_target=args.gguf_target, gguf_draft=args.gguf_draft,
            peer_omp_wait_policy=args.peer_omp_wait_policy,
        )
        return _finish(run_bench(cfg), report.write, args.out, argv)

    return fail(run)


def _finish(results: dict, write, out: str, argv, **write_kwargs) -> int:
    """Record the command line, write the results with ``write`` (JSON, markdown, plots), print
    the table and what was written."""
    results["command"] = "specdec-bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    written = write(results, Path(out), **write_kwargs)
    print(written["markdown"])
    print(f"wrote {', '.join(written['files'])} to {out}")
    return 0


def _suite(args, argv) -> int:
    from specdec_rt.bench import spec_bench
    from specdec_rt.errors import GenerationInputError

    name, *rest = args.suite
    if name not in ("spec-bench", "grounded", "edits", "agent") or len(rest) > 1:
        raise GenerationInputError(f"--suite takes 'spec-bench [PATH]', 'grounded [PATH]', 'edits [PATH]' or "
                                   f"'agent [PATH]', got {' '.join(args.suite)!r}")
    if name == "agent":
        from specdec_rt.bench import agent

        acfg = agent.AgentConfig(bundle=args.bundle, questions=rest[0] if rest else "",
                                 max_new_tokens=args.max_new_tokens, repeats=args.repeats, threads=args.threads,
                                 sessions=args.sessions, progress=not args.quiet)
        if args.drafter_given:
            acfg.drafters = _csv(args.drafter)
        return _finish(agent.run_agent(acfg), agent.write, args.out, argv)
    if name == "edits":
        from specdec_rt.bench import edits

        ecfg = edits.EditsConfig(bundle=args.bundle, questions=rest[0] if rest else "",
                                 max_new_tokens=args.max_new_tokens, repeats=args.repeats, threads=args.threads,
                                 sessions=args.sessions, progress=not args.quiet,
                                 prefix_cache=not args.no_prefix_cache)
        if args.drafter_given:
            ecfg.drafters = _csv(args.drafter)
        return _finish(edits.run_edits(ecfg), edits.write, args.out, argv)
    grounded = name == "grounded"
    questions = rest[0] if rest else (str(spec_bench.GROUNDED_QUESTIONS) if grounded else "")
    per_category = args.questions_per_category
    if per_category is None:
        per_category = spec_bench.EVERY_QUESTION if grounded else 2
    cfg = spec_bench.SpecBenchConfig(
        bundle=args.bundle, questions=questions,
        categories=_csv(args.categories) if args.categories else None, per_category=per_category,
        max_new_tokens=args.max_new_tokens, ks=args.k, drafters=_csv(args.drafter),
        auto=not args.no_auto, tree=not args.no_tree, peers=_csv(args.peers),
        peer_ks=args.peer_k, repeats=args.repeats, threads=args.threads,
        peer_cache=args.peer_cache, gguf_target=args.gguf_target, gguf_draft=args.gguf_draft,
        progress=not args.quiet, baseline_bundles=_csv(args.baseline_bundle) if args.baseline_bundle else [],
        stop_at_eos=grounded, peer_omp_wait_policy=args.peer_omp_wait_policy,
        title=spec_bench.grounded_title(args.max_new_tokens) if grounded else None)
    return _finish(spec_bench.run_spec_bench(cfg), spec_bench.write, args.out, argv,
                   **({"stem": "grounded"} if grounded else {}))


def _batch(args, prompts: list[str], argv) -> int:
    from specdec_rt.bench import batch
    from specdec_rt.errors import GenerationInputError

    sizes = args.batch  # positive integers (checked by the parser)
    if not sizes:
        raise GenerationInputError("--batch takes batch sizes like 1,2,4,8")
    cfg = batch.BatchBenchConfig(
        bundle=args.bundle, prompts=prompts, batches=sizes, ks=args.k,
        auto=not args.no_auto, drafters=[d for d in _csv(args.drafter)], max_new_tokens=args.max_new_tokens,
        requests=args.batch_requests, repeats=args.repeats, threads=args.threads, progress=not args.quiet,
        clock=args.clock)
    return _finish(batch.run_batch_bench(cfg), batch.write, args.out, argv)


if __name__ == "__main__":
    sys.exit(main())
