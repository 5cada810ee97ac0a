#!/usr/bin/env bash
# Reproduce docs/benchmarks.md: export the shipped pair and benchmark it against target-only
# decoding and the peers (transformers, onnxruntime-genai), greedy, CPU execution provider.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh
python -m pip install -q "torch==2.13.0" -e ".[export,bench]"
specdec-export --target specdec_rt/data/reference/target --draft specdec_rt/data/reference/draft --out out/reference-bundle --quiet
specdec-bench --bundle out/reference-bundle --max-new-tokens 128 --k 1,2,3,4,6,8 \
    --drafter model,prompt_lookup --peers transformers,onnxruntime-genai --compare-graphs --overlap \
    --repeats 2 --out "${1:-docs/bench}" "${@:2}"
