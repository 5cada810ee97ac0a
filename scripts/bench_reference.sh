#!/usr/bin/env bash
# Reproduce docs/benchmarks.md: export the shipped pair and benchmark it against target-only
# decoding and the peers (transformers, onnxruntime-genai), greedy, CPU execution provider.
# Then the same pair exported with --target-attention fused (the fastest chains; trees refused)
# against onnxruntime-genai: docs/bench-fused.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh
python -m pip install -q "torch==2.13.0" -e ".[export,bench]"
out="${1:-docs/bench}"
specdec-export --target specdec_rt/data/reference/target --draft specdec_rt/data/reference/draft --out out/reference-bundle --quiet
specdec-bench --bundle out/reference-bundle --max-new-tokens 128 --k 1,2,3,4,6,8 \
    --drafter model,prompt_lookup --peers transformers,onnxruntime-genai --compare-graphs --overlap \
    --repeats 2 --out "$out" "${@:2}"
specdec-export --target specdec_rt/data/reference/target --draft specdec_rt/data/reference/draft \
    --out out/reference-bundle-fused --target-attention fused --quiet
specdec-bench --bundle out/reference-bundle-fused --max-new-tokens 128 --k 2,3,4,6,8 --drafter model \
    --peers onnxruntime-genai --compare-graphs --no-tree --repeats 2 --out "${out%/}-fused" "${@:2}"
