#!/usr/bin/env python
"""Load and fault test of specdec-serve (docs/serving.md): see specdec_rt/serving/loadtest.py.

    python scripts/load_test.py --bundle out/reference-bundle --threads 1 --out load.json
"""
import sys

from specdec_rt.serving.loadtest import main

if __name__ == "__main__":
    sys.exit(main())
