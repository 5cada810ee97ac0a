"""specdec-rt: speculative decoding on ONNX Runtime.

The top-level package re-exports the runtime API lazily, so ``import specdec_rt`` never pulls in
torch: a deployment needs numpy, onnxruntime, tokenizers and jinja2 (chat templates) and nothing else.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["load", "Generator", "GenerationResult", "GenerationStats", "SuffixPool"]


def __getattr__(name: str):
    if name in __all__:
        from specdec_rt.runtime.api import generator

        return getattr(generator, name)
    raise AttributeError(f"module 'specdec_rt' has no attribute {name!r}")
