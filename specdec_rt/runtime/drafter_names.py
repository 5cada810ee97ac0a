"""The names a request may give its drafter and speculation, with what each needs: one list for
the Python API (:mod:`specdec_rt.runtime.requests`) and the server's request checks
(:mod:`specdec_rt.serving.protocol`, standard library only, hence a module of its own)."""
from __future__ import annotations

DRAFTERS = ("model", "prompt_lookup", "hybrid", "suffix", "suffix_hybrid")
# drafters whose proposals read the committed tokens: nothing to draft ahead of verification
NO_OVERLAP = ("hybrid", "suffix", "suffix_hybrid")
# drafters that run the bundle's draft model (refused on a bundle without one)
NEEDS_DRAFT_MODEL = ("model", "hybrid", "suffix_hybrid")
SPECULATIONS = ("chain", "tree")
