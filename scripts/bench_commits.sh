#!/usr/bin/env bash
# Old commit vs the working tree on the reference pair, interleaved in one run (issue 20: a
# refactor must keep specdec-bench's figures within noise). Usage:
#   bash scripts/bench_commits.sh OLD_COMMIT [REPEATS] [extra specdec-bench arguments]
# Needs the package installed (scripts/test.sh does it). The old commit is checked out as a
# temporary git worktree and run from there (python -m from its folder imports its own code);
# both sides run the same bundle, exported once by the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
old="${1:?usage: bench_commits.sh OLD_COMMIT [REPEATS] [specdec-bench args]}"
repeats="${2:-3}"
shift $(( $# >= 2 ? 2 : 1 ))
work="$(mktemp -d)"
trap 'git worktree remove --force "$work/old" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add -f --detach "$work/old" "$old" >/dev/null
new="$(pwd)"
specdec-export --target specdec_rt/data/reference/target --draft specdec_rt/data/reference/draft \
    --out "$work/bundle" --quiet >/dev/null
for rep in $(seq 1 "$repeats"); do
  for side in old new; do
    dir="$new"; [ "$side" = old ] && dir="$work/old"
    (cd "$dir" && python -m specdec_rt.cli.bench_cli --bundle "$work/bundle" --max-new-tokens 128 \
        --k 2,4 --drafter model,prompt_lookup --tree-budgets 8 --num-prompts 10 \
        --out "$work/$side-$rep" --quiet "$@" >/dev/null)
    echo "run $rep: $side done" >&2
  done
done
python - "$work" "$repeats" "$old" <<'PY'
import json, statistics, sys
work, repeats, old = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for side in ("old", "new"):
    for rep in range(1, repeats + 1):
        for r in json.load(open(f"{work}/{side}-{rep}/results.json"))["rows"]:
            rows.setdefault(r["name"], {}).setdefault(side, []).append((r["speedup"], r["identical_to_target_only"]))
print(f"| configuration | {old} runs | working tree runs | old median | new median | identical |")
print("|---|---|---|---|---|---|")
for name, sides in rows.items():
    o, n = [s for s, _ in sides["old"]], [s for s, _ in sides["new"]]
    same = all(i for _, i in sides["old"] + sides["new"])
    print(f"| {name} | {', '.join(f'{x:.2f}' for x in o)} | {', '.join(f'{x:.2f}' for x in n)} | "
          f"{statistics.median(o):.2f}x | {statistics.median(n):.2f}x | {'yes' if same else 'NO'} |")
PY
