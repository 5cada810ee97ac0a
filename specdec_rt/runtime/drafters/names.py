"""The names a request may give its drafter and speculation, with what each needs: one list for
the Python API (:mod:`specdec_rt.runtime.loop.requests`) and the server's request checks
(:mod:`specdec_rt.serving.protocol`, standard library only, hence a module of its own)."""
from __future__ import annotations

# "auto" (the default) is resolved per request to one of the others (PolicyStore.auto_drafter)
AUTO = "auto"
DRAFTERS = (AUTO, "model", "prompt_lookup", "hybrid", "suffix", "suffix_hybrid", "eagle")
# drafters whose proposals read the committed tokens (or, eagle, the target's features of them):
# nothing to draft ahead of verification
NO_OVERLAP = ("hybrid", "suffix", "suffix_hybrid", "eagle")
# drafters that run the bundle's draft model (refused on a bundle without one)
NEEDS_DRAFT_MODEL = ("model", "hybrid", "suffix_hybrid")
# drafters that run the bundle's EAGLE-3 head (specdec-export --draft-head)
NEEDS_HEAD = ("eagle",)
SPECULATIONS = ("chain", "tree")
