"""Weight-only quantization into ONNX Runtime's MatMulNBits / GatherBlockQuantized layout.

The graph builder quantizes each MatMul weight as it emits it (``quantize_blockwise``), so an
fp32 copy of a quantized graph never exists, in memory or on disk. The packing is ONNX Runtime's
own (``quantize_matmul_4bits`` / ``quantize_matmul_8bits``, the kernels behind
``MatMulNBitsQuantizer``): symmetric, blocks of 32 along K, no zero points (MatMulNBits then
uses 2^(bits-1)), so the tensors are byte for byte what that quantizer writes for the same
weight (a test checks it). The same packed table serves ``GatherBlockQuantized`` (embedding
lookups), whose default zero point for uint8 data is the same 2^(bits-1).

``quantize_weights`` (the whole-model quantizer on an in-memory ModelProto) is kept for
comparison; it needs the full float model in memory and cannot load graphs over 2 GB.

W8A8 (``quantize_per_channel``; the graph quantizes activations) is the other family: 7-bit weights with
one scale per output channel, multiplied in an integer GEMM with activations the graph quantizes
per row, so no row's result depends on the call's other rows (docs/design.md, "Exactness").
"""
from __future__ import annotations

import numpy as np

QUANT_BITS = {"int4": 4, "int8": 8}  # weight-only MatMulNBits schemes
# W8A8: int7 weights per output channel, int8 activations per row, integer GEMM (MatMulIntegerToFloat)
W8A8 = "w8a8"
QUANT_SCHEMES = (*QUANT_BITS, W8A8)
W8A8_WEIGHT_LIMIT = 63  # 7-bit weights: u8 x s8 pairs cannot saturate AVX2's vpmaddubsw (2 * 255 * 63 < 2^15)
ACT_EPS = 1e-8  # W8A8: floor of an activation row's peak, so an all-zero row quantizes to zeros, not NaN
BLOCK_SIZE = 32  # ONNX Runtime's quantizer default, kept for quantize_weights (the reference)
BLOCK_SIZES = (16, 32, 64, 128)
# the exporter's default: see ExportOptions.block_size and docs/design.md ("Exactness")
DEFAULT_BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # MatMulNBits: activations quantized to int8 per block (fastest CPU kernels)


def quantize_blockwise(weight: np.ndarray, bits: int, block_size: int = BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [K, N] (MatMul layout) -> (packed uint8 [N, k_blocks, blob], scales float32 [N, k_blocks]).

    Block-wise along K, one block from a single output column; symmetric.
    """
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    rows, cols = weight.shape
    k_blocks = (rows + block_size - 1) // block_size
    w = np.ascontiguousarray(weight, dtype=np.float32)
    if k_blocks * block_size != rows:
        w = np.pad(w, ((0, k_blocks * block_size - rows), (0, 0)))
    packed = np.zeros((cols, k_blocks, block_size * bits // 8), dtype=np.uint8)
    scales = np.zeros((cols, k_blocks), dtype=np.float32)
    zero_points = np.zeros((cols, (k_blocks * bits + 7) // 8), dtype=np.uint8)  # unused (symmetric)
    (quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits)(
        packed, w, scales, zero_points, block_size, cols, rows, True)
    return packed, scales


def quantize_per_channel(weight: np.ndarray, limit: int = W8A8_WEIGHT_LIMIT) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [K, N] (MatMul layout) -> (int8 [K, N] in [-limit, limit], scales float32 [N]).

    Symmetric, one scale per output column: ``weight ~= q * scales``. The W8A8 graphs multiply
    these integers with per-row int8 activations in int32, so a row's result cannot depend on
    which other rows share the call (the property that keeps speculation exact without padding).
    """
    w = np.asarray(weight, dtype=np.float32)
    peak = np.abs(w).max(axis=0)
    scales = np.where(peak > 0, peak / limit, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scales), -limit, limit).astype(np.int8)
    return q, scales


def dequantize_blockwise(packed: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """Inverse of ``quantize_blockwise`` (tests and error estimates): float32 [K, N]."""
    n, k_blocks, blob = packed.shape
    block = blob * 8 // bits
    flat = packed.reshape(n, -1)
    if bits == 4:
        vals = np.stack([flat & 0x0F, flat >> 4], axis=-1).reshape(n, -1).astype(np.int32) - 8
    else:
        vals = flat.astype(np.int32) - 128
    out = vals.reshape(n, k_blocks, block) * scales[:, :, None].astype(np.float32)
    return out.reshape(n, -1)[:, :k].T.copy()


def quantize_weights(model, scheme: str, block_size: int = BLOCK_SIZE):
    """Return ``model`` (an in-memory ModelProto) with every constant-weight MatMul replaced by
    MatMulNBits, using ONNX Runtime's quantizer (the reference for ``quantize_blockwise``)."""
    if scheme not in QUANT_BITS:
        raise ValueError(f"unknown quantization '{scheme}'; choose one of {', '.join(QUANT_BITS)}")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quant = MatMulNBitsQuantizer(model, bits=QUANT_BITS[scheme], block_size=block_size,
                                 is_symmetric=True, accuracy_level=ACCURACY_LEVEL)
    quant.process()
    return quant.model.model
