#!/usr/bin/env bash
# Install specdec-rt with its export, bench and test extras, then run the whole test suite.
# torch is pinned to the CPU build first: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh
python -m pip install -q "torch==2.13.0" -e ".[export,test,bench]"
python -m pytest -q "$@"
