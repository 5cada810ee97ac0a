"""T(S) of each bundle's target and the cost of one draft call, interleaved across bundles, as
the loop calls them (the probe's one-row padding included): how verify cost and c compare
between exports of one checkpoint (e.g. int4 against w8a8) on this machine.

    python scripts/target_curve.py BUNDLE [BUNDLE ...] [--past 128] [--sizes 1,2,3,4,5,6,8] [--rounds 3]
"""
from __future__ import annotations

import argparse

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--sizes", default="1,2,3,4,5,6,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import specdec_rt
    from specdec_rt.runtime.policies.cost_model import measure_engine

    sizes = [int(s) for s in args.sizes.split(",")]
    gens = {p: specdec_rt.load(p, threads=args.threads, shared_thread_pool=True, prefix_cache=False) for p in args.bundles}
    target = {p: [] for p in gens}
    draft = {p: [] for p in gens}
    for _ in range(args.rounds):  # round robin: drift on a shared machine hits every bundle alike
        for p, g in gens.items():
            target[p].append(measure_engine(g.target, sizes, past=args.past, reps=4))
            if g.draft_engine is not None:
                draft[p].append(measure_engine(g.draft_engine, [1], past=args.past, reps=6)[0])
    for p, g in gens.items():
        t = np.min(np.array(target[p]), axis=0) * 1000
        curve = " ".join(f"{s}:{v / t[0]:.2f}" for s, v in zip(sizes, t))
        line = f"{p}: min_rows {g.target.min_rows}, T(1) {t[0]:.1f} ms, T(S)/T(1) {curve}"
        if draft[p]:
            d = min(draft[p]) * 1000
            line += f", draft call {d:.1f} ms (c = {d / t[0]:.2f})"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
