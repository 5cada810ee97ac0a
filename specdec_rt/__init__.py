"""specdec-rt: speculative decoding on ONNX Runtime.

The top-level package re-exports the runtime API only, so ``import specdec_rt`` never pulls in
torch: a deployment needs numpy, onnxruntime and tokenizers and nothing else.
"""
from specdec_rt.runtime.generator import GenerationResult, Generator, load

__all__ = ["load", "Generator", "GenerationResult"]
__version__ = "0.1.0"
