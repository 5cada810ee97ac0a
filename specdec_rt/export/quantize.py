"""Weight-only quantization with ONNX Runtime's MatMulNBits quantizer (int4 / int8 blocks).

Only MatMul weights are quantized (embeddings, norms and the attention math stay in float), so
the graph contract is unchanged and the runtime needs no knowledge of it.
"""
from __future__ import annotations

import onnx

QUANT_BITS = {"int4": 4, "int8": 8}


def quantize_weights(model: onnx.ModelProto, scheme: str, block_size: int = 32) -> onnx.ModelProto:
    """Return ``model`` with every constant-weight MatMul replaced by MatMulNBits."""
    if scheme not in QUANT_BITS:
        raise ValueError(f"unknown quantization '{scheme}'; choose one of {', '.join(QUANT_BITS)}")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quant = MatMulNBitsQuantizer(model, bits=QUANT_BITS[scheme], block_size=block_size,
                                 is_symmetric=True, accuracy_level=4)
    quant.process()
    return quant.model.model
