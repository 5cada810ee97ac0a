"""``specdec-run --demo``: export the shipped pair, generate, and measure the speedup in one run."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def reference_dir() -> Path:
    """The shipped reference pair: package data of specdec_rt (``specdec_rt/data/reference``).

    Found through ``importlib.resources``, so it works from any directory after a plain
    ``pip install`` (not only in a clone). The exporter needs real files: a package imported from
    a zip archive is refused with a clear message.
    """
    from importlib.resources import files

    import specdec_rt

    res = files("specdec_rt").joinpath("data").joinpath("reference")
    # a plain install gives a Path; other loaders (e.g. some editable modes) fall back to the module's folder
    candidates = [res] if isinstance(res, Path) else []
    candidates.append(Path(specdec_rt.__file__).resolve().parent / "data" / "reference")
    for cand in candidates:
        if (cand / "target" / "config.json").is_file() and (cand / "draft" / "model.safetensors").is_file():
            return cand
    raise FileNotFoundError(
        f"the reference pair is not installed ({res} has no target/ and draft/ checkpoints; a package "
        "imported from an archive cannot be exported from); reinstall specdec-rt with pip")


def reference_prompts(ref: Path | None = None) -> list[dict]:
    ref = ref or reference_dir()
    lines = (ref / "eval_prompts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def run_demo(bundle_dir: Path, args) -> int:
    import specdec_rt
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    from specdec_rt.runtime.engines.sessions import enable_shared_thread_pool

    overlap = bool(getattr(args, "overlap", False))
    if not overlap:  # overlapped decoding wants the models on their own pools
        enable_shared_thread_pool(args.threads)  # before any session: export validation runs on it too
    ref = reference_dir()
    t0 = time.perf_counter()
    head = ref / "eagle"
    with_head = (head / "config.json").is_file()
    print(f"exporting the reference pair{' and its EAGLE-3 head' if with_head else ''} from {ref} to {bundle_dir} ...",
          flush=True)
    export_pair(ref / "target", ref / "draft", bundle_dir,
                ExportOptions(progress=True, draft_head=head if with_head else None))
    print(f"export took {time.perf_counter() - t0:.1f} s", flush=True)

    gen = specdec_rt.load(bundle_dir, provider=args.provider, threads=args.threads,
                          shared_thread_pool=not overlap, overlap=overlap,
                          prefix_cache=False)  # every configuration prefills the same prompt afresh
    # a typical held-out prompt (the first one makes this weak target repeat "#" lines, which the
    # draft predicts perfectly: a flattering, unrepresentative speedup)
    prompt = args.prompt or reference_prompts(ref)[2]["prompt"]
    k = args.num_draft_tokens
    n = args.max_new_tokens
    ids = gen.tokenizer.encode(prompt)
    # the draft model, and the head where the bundle has one (overlap drafts with the model only)
    drafters = ["model"] + (["eagle"] if gen.head is not None and not overlap else [])
    gen.generate_ids(ids, max_new_tokens=8, drafter=None, temperature=0.0)  # warm up every session
    for d in drafters:
        gen.generate_ids(ids, max_new_tokens=8, num_draft_tokens=4, drafter=d, temperature=0.0)

    base_t: list[float] = []
    spec_t: dict[str, list[float]] = {d: [] for d in drafters}
    out: dict[str, list[int]] = {}
    stats = {}
    for _ in range(3):  # interleaved, so drift on a shared machine hits all alike
        t = time.perf_counter()
        base_ids = gen.generate_ids(ids, max_new_tokens=n, drafter=None, ignore_eos=True, temperature=0.0)
        base_t.append(time.perf_counter() - t)
        for d in drafters:
            t = time.perf_counter()
            out[d] = gen.generate_ids(ids, max_new_tokens=n, num_draft_tokens=k, drafter=d,
                                      ignore_eos=True, temperature=0.0)
            spec_t[d].append(time.perf_counter() - t)
            stats[d] = gen.last_stats
    b = statistics.median(base_t)
    print("\n--- prompt ---")
    print(prompt)
    print("--- speculative completion ---")
    print(gen.tokenizer.decode(out["model"]))
    print("---")
    same = all(out[d] == base_ids for d in drafters)
    print(f"identical to target-only greedy: {'yes' if same else 'NO'} ({len(base_ids)} tokens, "
          f"{' and '.join(drafters)} drafter{'s' if len(drafters) > 1 else ''})")
    print(f"target-only: {len(base_ids) / b:.1f} tok/s")
    for d in drafters:
        st, s = stats[d], statistics.median(spec_t[d])
        label = "draft model" if d == "model" else "EAGLE-3 head"
        print(f"{label} (drafter={d!r}, K={k}): acceptance rate {st.acceptance_rate:.1%}; tokens per target call: "
              f"{st.tokens_per_target_call:.2f}"
              + (f"; drafting overlapped, look-ahead kept in {st.lookahead_hits / st.target_calls:.0%} of steps"
                 if st.overlap and st.target_calls else ""))
        print(f"  {len(out[d]) / s:.1f} tok/s, speedup: {b / s:.2f}x (median of 3 interleaved runs)")
    return 0 if same else 1
