#!/usr/bin/env bash
# Scale benchmark of the exporter (docs/benchmarks.md, "Scale"); not part of CI. Builds
# random-weight Qwen2.5-0.5B / 1.5B checkpoints (published configs) under $SPECDEC_CACHE/ckpt
# (default /work/cache, outside the repo; reused when present) and exports each in its own process.
# Peak memory 6.3 GiB (1.5B fp32 validation); `--runs all` adds int8/fp16 and the 3B config
# (7 GiB to build its checkpoint and to export it, 13 GB of disk for its fp32 bundle).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh
python -m pip install -q "torch==2.13.0" -e ".[export]"
python scripts/bench_scale.py "$@"
