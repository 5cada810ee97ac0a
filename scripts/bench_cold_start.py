"""The first generate_batch call of a process against a warm one, with and without the warm-up.

Each configuration runs in a fresh process (a first call is only first once): load the bundle,
optionally ``gen.warm_up()``, then time ``generate_batch`` of 8 prompts x 64 tokens (K = "auto")
four times. Reports load and warm-up seconds and first call / median of the later calls. The
on-disk cost model (``~/.cache/specdec-rt``, or ``$SPECDEC_CACHE_DIR``) is used as a user's second start finds it; with
``--cold-disk`` it is moved aside for the run, as on a machine's very first start.

    python scripts/bench_cold_start.py [--bundle DIR] [--cold-disk] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
import specdec_rt
from specdec_rt.bench.runner import load_prompts

bundle, warm, threads = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
t0 = time.perf_counter()
gen = specdec_rt.load(bundle, threads=threads, shared_thread_pool=True, prefix_cache=False)
load_s = time.perf_counter() - t0
warm_parts = gen.warm_up() if warm else {}
warm_s = time.perf_counter() - t0 - load_s
prompts = load_prompts(None)[:8]
calls = []
for _ in range(4):
    t = time.perf_counter()
    gen.generate_batch(prompts, max_new_tokens=64, temperature=0, ignore_eos=True)
    calls.append(time.perf_counter() - t)
print(json.dumps({"warm_up": warm, "load_s": load_s, "warm_up_s": warm_s, "warm_up_parts": warm_parts,
                  "calls_s": calls, "first_over_warm": calls[0] / statistics.median(calls[1:])}))
"""


def run(bundle: str, warm: bool, threads: int, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, bundle, "1" if warm else "0", str(threads)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=None, help="default: the reference pair, exported to a temp dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold-disk", action="store_true", help="no on-disk cost model (a machine's first start)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = dict(os.environ)
    tmp = tempfile.mkdtemp()
    bundle = args.bundle
    if bundle is None:
        from specdec_rt.cli.demo import reference_dir
        from specdec_rt.export.pipeline import ExportOptions, export_pair

        ref = reference_dir()
        export_pair(ref / "target", ref / "draft", Path(tmp) / "ref", ExportOptions(progress=False))
        bundle = f"{tmp}/ref"
    if args.cold_disk:
        env["SPECDEC_CACHE_DIR"] = f"{tmp}/cache"  # an empty cache: the cost model is measured
    rows = []
    for warm in (False, True):
        if args.cold_disk:
            shutil.rmtree(f"{tmp}/cache", ignore_errors=True)
        rows.append(run(bundle, warm, args.threads, env))
    print("| warm-up | load s | warm-up s | first call s | later calls s (median) | first / warm |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        later = sorted(r["calls_s"][1:])[1]
        print(f"| {'yes' if r['warm_up'] else 'no'} | {r['load_s']:.2f} | {r['warm_up_s']:.2f} | "
              f"{r['calls_s'][0]:.3f} | {later:.3f} | {r['first_over_warm']:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps({"bundle": bundle, "cold_disk": args.cold_disk, "runs": rows}, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
