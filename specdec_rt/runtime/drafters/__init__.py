"""Everything that proposes tokens for the target to verify, one proposer per module behind the
``Drafter`` interface of :mod:`.base`: the draft model and prompt lookup (:mod:`.base`), suffix
trees (:mod:`.suffix`, :mod:`.suffix_trie`), their hybrids (:mod:`.hybrid`), EAGLE-3 heads
(:mod:`.eagle`), tree drafters (:mod:`.tree`), and the names a request may give (:mod:`.names`,
standard library only: the server's request checks read it).

May import ``policies``, ``engines`` and ``core``; never ``loop`` or ``api``.
"""
from __future__ import annotations

import importlib

# the flat layout's ``specdec_rt.runtime.drafters`` module is this package now: its names still
# resolve here (lazily, so the server's import of :mod:`.names` loads no ONNX Runtime)
FROM_BASE = ("Drafter", "ModelDrafter", "PromptLookupDrafter", "DRAFT_CONTEXT", "RESYNC_CONTEXT",
             "BATCH_CATCH_UP")


def __getattr__(name: str):
    if name in FROM_BASE:
        return getattr(importlib.import_module(f"{__name__}.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
