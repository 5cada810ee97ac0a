#!/usr/bin/env bash
# Install specdec-rt, export the shipped reference pair and generate speculatively,
# printing the acceptance rate and the speedup over target-only decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install "torch==2.13.0" -e ".[export]"
specdec-run --demo "$@"
