#!/usr/bin/env bash
# Install specdec-rt, export the shipped reference pair and generate speculatively,
# printing the acceptance rate and the speedup over target-only decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh
python -m pip install -q "torch==2.13.0" -e ".[export]"
specdec-run --demo "$@"
