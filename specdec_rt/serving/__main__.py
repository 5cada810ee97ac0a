"""``python -m specdec_rt.serving``: the same as ``specdec-serve``."""
import sys

from specdec_rt.serving.cli import main

sys.exit(main(prog="python -m specdec_rt.serving"))
