"""Build the verify graph op by op from canonical weights.

Why not ``torch.onnx.export``: a traced 2-layer Llama has ~640 nodes of shape arithmetic, mask
construction and casts, and ONNX Runtime's per-call CPU latency follows node count. Building
from the weights (as onnxruntime-genai's model builder does) gives ~15 nodes per layer, with
fused RMSNorm / skip-norm / rotary kernels, q/k/v and gate/up packed into single GEMMs, and the
attention scale folded into the query weights. Export of a small model takes seconds.

Two op sets:
- ``fused`` (default): ONNX Runtime contrib ops (``SimplifiedLayerNormalization``,
  ``SkipSimplifiedLayerNormalization``, ``SkipLayerNormalization``, ``RotaryEmbedding``,
  ``QuickGelu``, ``FastGelu``, ``Gelu``) that the CPU and CUDA execution providers implement.
- ``portable``: standard ONNX ops only, for parsers without the contrib domain (TensorRT).

The graph contract (docs/graph-contract.md) is identical for both.

Scale: with a :class:`TensorWriter` (``write_model``) every initializer of 1 KiB or more goes to
one external-data file the moment it is created, so the ModelProto holds only names and
offsets (no 2 GB protobuf limit) and at most one layer's weights exist as arrays at a time.
With ``GraphOptions.quantize`` each MatMul weight is quantized as it is emitted (MatMulNBits)
and the embedding table is stored in the same packed layout (GatherBlockQuantized).
"""
from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec_rt.export.arch import ArchSpec, ModelWeights, VocabMatrix
from specdec_rt.export.errors import ExportError
from specdec_rt.export.quantize import (ACCURACY_LEVEL, ACT_EPS, BLOCK_SIZE, QUANT_BITS, QUANT_SCHEMES, W8A8,
                                       quantize_blockwise, quantize_per_channel, W8A8_WEIGHT_LIMIT)

CONTRACT_VERSION = 1
FUSED_ATTENTION_OPSET = 23  # ONNX Attention; ONNX Runtime's CPU kernel since 1.23
BLOCKED_QUANTIZE_OPSET = 21  # QuantizeLinear with block_size: one scale per activation row
MS_DOMAIN = "com.microsoft"

_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
GRAPH_DTYPES = {"fp32": np.float32, "fp16": np.float16}
FP16_MAX = float(np.finfo(np.float16).max)
EXTERNAL_THRESHOLD = 1024  # bytes: smaller initializers stay inside the .onnx file
VOCAB_BLOCK_BYTES = 64 << 20  # vocabulary-sized matrices are converted in float32 blocks of this size


def _blocks(n: int, row_elems: int):
    """Ranges (a, b) covering 0..n whose float32 rows of ``row_elems`` fit VOCAB_BLOCK_BYTES."""
    step = max(1, VOCAB_BLOCK_BYTES // (4 * max(1, row_elems)))
    for a in range(0, n, step):
        yield a, min(n, a + step)


@dataclass
class GraphOptions:
    dtype: str = "fp32"  # "fp32" | "fp16"
    opset: int = 17
    fused: bool = True
    # "fp64": softmax and probs @ V accumulate in float64 (see GraphBuilder._attention);
    # "native": in the graph dtype (TensorRT has no float64)
    attention_accumulation: str = "fp64"
    # "int4" | "int8": weight-only (MatMulNBits); "w8a8": int7 weights per channel x int8 activations
    # per row (MatMulIntegerToFloat, row-invariant by construction); quantized while the graph is built
    quantize: str | None = None
    block_size: int = BLOCK_SIZE
    quantize_embedding: bool = True  # with ``quantize``: the embedding table too (GatherBlockQuantized)
    # one ONNX ``Attention`` node per layer instead of ~18 decomposed ops (drafts, and targets
    # exported with --target-attention fused: float32 sums, opset 23); see GraphBuilder._fused_attention
    fused_attention: bool = False
    # a draft whose LM head was cut to the tokens it may propose (specdec_rt.export.draft_vocab):
    # the kept token ids, sorted; the graph scatters their logits into a -inf row of the whole
    # vocabulary, so the contract (logits [B, S, V]) and every consumer stay as they are
    output_ids: np.ndarray | None = None
    # EAGLE-3 heads (specdec_rt.export.eagle_graph): one extra output ``features`` [B, S, len * hidden]
    # float32, the residual stream after each listed 0-based decoder layer (the layer's output, before
    # any following norm), concatenated in the given order; None: the graph is what it was
    feature_layers: tuple[int, ...] | None = None


# families whose residual stream after layer i is ``residual + pending`` at the next norm, checked
# against eagle.target_features (tests/test_eagle_export.py); gpt2 / gpt_neox keep their layers
# elsewhere than ``model.model.layers`` (the hooks' reference) and GPT-NeoX adds branches in parallel
FEATURE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite",
                    "phi3", "smollm3", "olmo2", "starcoder2")


def check_feature_layers(spec: ArchSpec, layers) -> None:
    """A ``features`` output is built only where it is verified and its layers exist."""
    if spec.family not in FEATURE_FAMILIES:
        raise ExportError(f"a features output (EAGLE-3 heads) is not verified for {spec.family} models; "
                          f"supported: {', '.join(FEATURE_FAMILIES)}")
    bad = [i for i in layers if not 0 <= i < spec.num_layers]
    if not layers or bad:
        raise ExportError(f"feature layers {list(layers)} are not layers of the {spec.num_layers}-layer target")


class TensorWriter:
    """Appends initializers to one external-data file and returns TensorProtos that point at them.

    Tensors of 1 MiB or more start at a multiple of 64 KiB (as onnx's own writer aligns them, so
    that a runtime may map them); the sha256 of the file is computed as it is written. An error
    while writing (a full disk above all) is an :class:`ExportError` naming the file.
    """

    ALIGN = 1 << 16
    ALIGN_THRESHOLD = 1 << 20
    opener = open  # tests substitute a file that fills up

    def __init__(self, data_path: str | os.PathLike) -> None:
        self.path = os.fspath(data_path)
        self.location = os.path.basename(self.path)  # relative to the .onnx file beside it
        self.offset = 0
        self.sha256 = hashlib.sha256()
        try:
            self._f = self.opener(self.path, "wb")
        except OSError as exc:
            raise ExportError(f"cannot create {self.path}: {exc.strerror or exc}") from None

    def _write(self, buf) -> None:
        try:
            self._f.write(buf)
        except OSError as exc:
            self._fail(exc)
        self.sha256.update(buf)
        self.offset += len(buf)

    def _fail(self, exc: OSError):
        if exc.errno == errno.ENOSPC:
            raise ExportError(f"no space left on the device writing {self.path} "
                              f"({self.offset / 2**20:.0f} MiB written); free space or choose another --out") from None
        raise ExportError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def add(self, arr: np.ndarray, name: str) -> onnx.TensorProto:
        arr = np.asarray(arr)
        return self.add_blocks(name, arr.dtype, arr.shape, [arr])

    def add_blocks(self, name: str, dtype, shape, blocks) -> onnx.TensorProto:
        """One tensor of ``shape`` written from consecutive blocks along its first axis."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes >= self.ALIGN_THRESHOLD and self.offset % self.ALIGN:
            self._write(bytes(self.ALIGN - self.offset % self.ALIGN))
        start = self.offset
        for block in blocks:
            block = np.ascontiguousarray(block, dtype=dtype)
            self._write(memoryview(block.reshape(-1)).cast("B"))
        if self.offset - start != nbytes:
            raise ValueError(f"{name}: wrote {self.offset - start} bytes for a {list(shape)} {dtype} tensor")
        t = onnx.TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(dtype)
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(start)), ("length", str(nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        return t

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            self._f.close()
        except OSError as exc:
            self._fail(exc)

    def abort(self) -> None:
        """Close after a failure, ignoring further errors (the caller removes the file)."""
        try:
            self._f.close()
        except OSError:
            pass


class _Graph:
    """A tiny node/initializer accumulator with unique names."""

    def __init__(self, np_dtype: np.dtype, opset: int, writer: TensorWriter | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.np_dtype = np.dtype(np_dtype)
        self.onnx_dtype = _NP_TO_ONNX[self.np_dtype]
        self.opset = opset
        self.writer = writer
        self.num_params = 0  # float weights, quantized ones counted as K x N
        self.unquantized_bytes = 0  # what every initializer would take without quantization
        self.uses_ms_domain = False
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def _float(self, arr: np.ndarray, hint: str) -> np.ndarray:
        """``arr`` in the graph dtype; a value beyond float16's range is an error, not an inf."""
        if self.np_dtype == np.float16 and arr.dtype != np.float16 and arr.size:
            peak = float(np.max(np.abs(arr)))
            if peak > FP16_MAX:
                raise ExportError(f"weight '{hint}' has values up to {peak:.4g}, beyond float16's range "
                                  f"({FP16_MAX:.0f}); export with --dtype fp32")
        return arr.astype(self.np_dtype, copy=False)

    def const(self, array: np.ndarray, hint: str, dtype: np.dtype | None = None) -> str:
        name = self.name(hint)
        arr = np.asarray(array)
        if dtype is not None:
            arr = arr.astype(dtype, copy=False)
        elif arr.dtype.kind == "f":
            arr = self._float(arr, hint)
        if arr.dtype.kind == "f":
            self.num_params += arr.size
        self.unquantized_bytes += arr.nbytes
        self._add(arr, name)
        return name

    def count_weights(self, n: int) -> None:
        """Count ``n`` weights stored in another form (blocks, quantized) as float parameters."""
        self.num_params += n
        self.unquantized_bytes += n * self.np_dtype.itemsize

    def const_blocks(self, hint: str, shape: tuple[int, ...], blocks) -> str:
        """A float weight of ``shape`` produced as consecutive blocks along axis 0 (each converted
        to the graph dtype and written before the next exists)."""
        name = self.name(hint)
        self.count_weights(int(np.prod(shape, dtype=np.int64)))
        converted = (self._float(np.asarray(b), hint) for b in blocks)
        if self.writer is None:
            self.inits.append(numpy_helper.from_array(np.concatenate(list(converted)).reshape(shape), name))
        else:
            self.inits.append(self.writer.add_blocks(name, self.np_dtype, shape, converted))
        return name

    def packed(self, array: np.ndarray, hint: str) -> str:
        """A quantized tensor (uint8 packed weights or their scales), stored as is."""
        name = self.name(hint)
        self._add(np.asarray(array), name)
        return name

    def packed_blocks(self, hint: str, dtype, shape: tuple[int, ...], blocks) -> str:
        name = self.name(hint)
        if self.writer is None:
            self.inits.append(numpy_helper.from_array(np.concatenate(list(blocks)).reshape(shape), name))
        else:
            self.inits.append(self.writer.add_blocks(name, dtype, shape, blocks))
        return name

    def _add(self, arr: np.ndarray, name: str) -> None:
        if self.writer is not None and arr.nbytes >= EXTERNAL_THRESHOLD:
            self.inits.append(self.writer.add(arr, name))
        else:
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))

    def shape(self, dims: list[int], hint: str = "shape") -> str:
        return self.const(np.array(dims, dtype=np.int64), hint, dtype=np.int64)

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, n_out: int = 1,
           domain: str = "", outputs: list[str] | None = None, **attrs) -> str | list[str]:
        self.uses_ms_domain |= domain == MS_DOMAIN
        base = self.name(hint or op_type)
        outs = outputs or ([base] if n_out == 1 else [f"{base}_o{i}" for i in range(n_out)])
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=base, domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs


class GraphBuilder:
    """Emit one decoder-only LM graph that serves prefill, decode, chain and tree verify."""

    def __init__(self, spec: ArchSpec, weights: ModelWeights, options: GraphOptions,
                 writer: TensorWriter | None = None) -> None:
        if options.dtype not in GRAPH_DTYPES:
            raise ValueError(f"graph dtype must be one of {', '.join(GRAPH_DTYPES)}, not '{options.dtype}'")
        if options.quantize is not None and options.quantize not in QUANT_SCHEMES:
            raise ValueError(f"unknown quantization '{options.quantize}'; choose one of {', '.join(QUANT_SCHEMES)}")
        if options.quantize == W8A8 and options.dtype != "fp32":
            raise ValueError("quantize='w8a8' needs dtype fp32 (MatMulIntegerToFloat's CPU kernel outputs float32)")
        self.spec = spec
        self.w = weights
        self.opt = options
        self.bits = QUANT_BITS.get(options.quantize) if options.quantize else None
        self.w8a8 = options.quantize == W8A8
        self._act_q: dict[str, tuple[str, str]] = {}  # W8A8: an activation's (uint8 tensor, row scales)
        self.out_vocab = spec.vocab_size if options.output_ids is None else len(options.output_ids)
        if self.out_vocab != spec.vocab_size and weights.tied:
            raise ValueError("a cut LM head cannot share the embedding table (prune_lm_head unties them)")
        # one ONNX Attention node per layer (draft graphs): needs the contrib op set's company
        # (not portable) and float32 sums (the target's float64 ones are what makes it exact)
        self._fused_attn = options.fused_attention
        if options.fused_attention and (not options.fused or options.attention_accumulation != "native"):
            raise ValueError("fused_attention needs fused=True and attention_accumulation='native' "
                             "(the portable op set stays plain ONNX; float64 sums are the decomposed graph's)")
        if options.feature_layers is not None:
            check_feature_layers(spec, options.feature_layers)
        opset = max(options.opset, FUSED_ATTENTION_OPSET) if options.fused_attention else options.opset
        if self.w8a8 and options.fused:  # one blocked QuantizeLinear per activation (_quantize_rows)
            opset = max(opset, BLOCKED_QUANTIZE_OPSET)
        self.g = _Graph(GRAPH_DTYPES[options.dtype], opset, writer)
        # W8A8: the uint8 zero points of an activation's rows, one tensor per row layout ("rows":
        # every decoder activation, [B, S, 1]; "kept": the LM head's input, its last rows only)
        self._row_zero: dict[str, str] = {}

    # -- small emitters --------------------------------------------------------------------
    def _quantized(self, w: np.ndarray, hint: str) -> tuple[str, str]:
        """Quantize ``w`` [K, N]; return the names of the packed weights and the scales."""
        g = self.g
        k, n = w.shape
        g.count_weights(k * n)
        packed, scales = quantize_blockwise(w, self.bits, self.opt.block_size)
        return g.packed(packed, hint + "_q"), g.packed(scales.astype(g.np_dtype), hint + "_scales")

    def _matmul_nbits(self, x: str, packed: str, scales: str, k: int, n: int, hint: str) -> str:
        return self.g.op("MatMulNBits", [x, packed, scales], hint, domain=MS_DOMAIN, K=k, N=n, bits=self.bits,
                         block_size=self.opt.block_size, accuracy_level=ACCURACY_LEVEL)

    def _per_channel(self, w: np.ndarray, hint: str) -> tuple[str, str]:
        """W8A8: ``w`` [K, N] -> the names of its int8 [K, N] weight and float32 [N] scales."""
        g = self.g
        k, n = w.shape
        g.count_weights(k * n)
        q, scales = quantize_per_channel(w)
        return g.packed(q, hint + "_q"), g.packed(scales, hint + "_scales")

    def _quantize_rows(self, x: str, k: int, rows: str = "rows") -> tuple[str, str]:
        """W8A8: ``x`` [..., K] -> (uint8, zero point 128; scales [..., 1]), one scale per row.

        Per row, never per tensor (DynamicQuantizeLinear): a per-tensor scale would tie a row's
        result to the other rows of the call, and greedy speculation would stop being exact.
        Quantized once per activation: the q/k/v (or gate/up) projections of one input share it.
        ``round(x / scale) + 128`` is one ``QuantizeLinear`` whose block is the whole row (opset
        21) in the fused op set, its zero points (one per row) made once per row layout
        (``rows``: activations sharing one ``[B, S, 1]`` shape of scales), and ``Div``, ``Round``,
        ``Add``, ``Cast`` in the portable one: the same bits (division, round half to even), 3
        nodes fewer per activation (~340 on a 28-layer model; a one-token call pays per node).
        """
        if x in self._act_q:
            return self._act_q[x]
        g = self.g
        peak = g.op("Abs", [x], "aq_abs")
        if g.opset >= 18:
            peak = g.op("ReduceMax", [peak, g.shape([-1], "axes")], "aq_peak", keepdims=1)
        else:
            peak = g.op("ReduceMax", [peak], "aq_peak", axes=[-1], keepdims=1)
        peak = g.op("Max", [peak, g.const(np.array(ACT_EPS, np.float32), "aq_eps")], "aq_floor")
        scale = g.op("Div", [peak, g.const(np.array(127, np.float32), "aq_127")], "aq_scale")
        if self.opt.fused and g.opset >= BLOCKED_QUANTIZE_OPSET:
            zero = self._row_zero.get(rows)
            if zero is None:
                zero = self._row_zero[rows] = g.op(
                    "Expand", [g.const(np.array([128], np.uint8), "aq_zero_row", dtype=np.uint8),
                               g.op("Shape", [scale], "aq_rows")], "aq_zero_points")
            q = g.op("QuantizeLinear", [x, scale, zero], "aq_u8", axis=-1, block_size=k)
        else:
            r = g.op("Round", [g.op("Div", [x, scale], "aq_div")], "aq_round")
            q = g.op("Cast", [g.op("Add", [r, g.const(np.array(128, np.float32), "aq_128")], "aq_shift")], "aq_u8",
                     to=TensorProto.UINT8)
        self._act_q[x] = (q, scale)
        return q, scale

    def _matmul_w8a8(self, x: str, q: str, scales: str, hint: str, k: int, rows: str = "rows") -> str:
        """x @ (q * scales) as an integer GEMM of per-row quantized ``x``, then its row scales."""
        g = self.g
        qx, sx = self._quantize_rows(x, k, rows)
        zero = g.const(np.array(128, np.uint8), "aq_zero")
        if self.opt.fused:  # ONNX Runtime's contrib op: the int32 -> float conversion and scales fused
            y = g.op("MatMulIntegerToFloat", [qx, q, g.const(np.array(1.0, np.float32), "aq_one"), scales, zero],
                     hint, domain=MS_DOMAIN)
        else:  # standard ONNX (the portable op set)
            acc = g.op("MatMulInteger", [qx, q, zero], hint + "_int")
            y = g.op("Mul", [g.op("Cast", [acc], hint + "_float", to=TensorProto.FLOAT), scales], hint)
        return g.op("Mul", [y, sx], hint + "_rescale")

    def _linear(self, x: str, w: np.ndarray, b: np.ndarray | None, hint: str) -> str:
        if self.w8a8:
            q, scales = self._per_channel(w, hint)
            y = self._matmul_w8a8(x, q, scales, hint, w.shape[0])
        elif self.bits:
            packed, scales = self._quantized(w, hint)
            y = self._matmul_nbits(x, packed, scales, w.shape[0], w.shape[1], hint)
        else:
            y = self.g.op("MatMul", [x, self.g.const(w, hint + "_w")], hint)
        if b is not None:
            y = self.g.op("Add", [y, self.g.const(b, hint + "_b")], hint + "_bias")
        return y

    def _reduce_mean_last(self, x: str) -> str:
        if self.g.opset >= 18:
            return self.g.op("ReduceMean", [x, self.g.shape([-1], "axes")], "rms_mean", keepdims=1)
        return self.g.op("ReduceMean", [x], "rms_mean", axes=[-1], keepdims=1)

    def _rms_plain(self, x: str, w: np.ndarray) -> str:
        g = self.g
        sq = g.op("Mul", [x, x], "rms_sq")
        mean = self._reduce_mean_last(sq)
        eps = g.op("Add", [mean, g.const(np.array(self.spec.norm_eps), "eps")], "rms_eps")
        inv = g.op("Reciprocal", [g.op("Sqrt", [eps], "rms_sqrt")], "rms_inv")
        return g.op("Mul", [g.op("Mul", [x, inv], "rms_scale"), g.const(w, "rms_w")], "rms")

    def _norm(self, residual: str, pending: str | None, w: np.ndarray, b: np.ndarray | None,
              hint: str) -> tuple[str, str]:
        """Normalize ``residual + pending``; return (normed, new residual)."""
        g, s = self.g, self.spec
        if self.opt.fused:
            gamma = g.const(w, hint + "_gamma")
            if s.norm == "rms":
                if pending is None:
                    out = g.op("SimplifiedLayerNormalization", [residual, gamma], hint,
                               axis=-1, epsilon=s.norm_eps, stash_type=1)
                    return out, residual
                outs = g.op("SkipSimplifiedLayerNormalization", [residual, pending, gamma], hint,
                            n_out=4, domain=MS_DOMAIN, epsilon=s.norm_eps)
                return outs[0], outs[3]
            beta = g.const(b if b is not None else np.zeros_like(w), hint + "_beta")
            if pending is None:
                out = g.op("LayerNormalization", [residual, gamma, beta], hint, axis=-1,
                           epsilon=s.norm_eps)
                return out, residual
            outs = g.op("SkipLayerNormalization", [residual, pending, gamma, beta], hint, n_out=4,
                        domain=MS_DOMAIN, epsilon=s.norm_eps)
            return outs[0], outs[3]
        if pending is not None:
            residual = g.op("Add", [residual, pending], hint + "_residual")
        if s.norm == "rms":
            return self._rms_plain(residual, w), residual
        beta = g.const(b if b is not None else np.zeros_like(w), hint + "_beta")
        out = g.op("LayerNormalization", [residual, g.const(w, hint + "_gamma"), beta], hint,
                   axis=-1, epsilon=s.norm_eps)
        return out, residual

    def _head_rms(self, x: str, heads: int, w: np.ndarray, hint: str) -> str:
        """Per-head RMSNorm over head_dim (Qwen3's q_norm / k_norm)."""
        g, d = self.g, self.spec.head_dim
        x4 = g.op("Reshape", [x, g.shape([0, 0, heads, d])], hint + "_4d")
        if self.opt.fused:
            normed = g.op("SimplifiedLayerNormalization", [x4, g.const(w, hint + "_gamma")], hint,
                          axis=-1, epsilon=self.spec.norm_eps, stash_type=1)
        else:
            normed = self._rms_plain(x4, w)
        return g.op("Reshape", [normed, g.shape([0, 0, heads * d])], hint + "_3d")

    def _activation(self, x: str) -> str:
        g, act = self.g, self.spec.activation
        if act == "relu":
            return g.op("Relu", [x])
        if self.opt.fused:
            if act == "silu":
                return g.op("QuickGelu", [x], "silu", domain=MS_DOMAIN, alpha=1.0)
            if act == "gelu":
                return g.op("Gelu", [x], "gelu", domain=MS_DOMAIN)
            return g.op("FastGelu", [x], "gelu_tanh", domain=MS_DOMAIN)
        if act == "silu":
            return g.op("Mul", [x, g.op("Sigmoid", [x])], "silu")
        half = g.const(np.array(0.5), "half")
        one = g.const(np.array(1.0), "one")
        if act == "gelu":
            inner = g.op("Erf", [g.op("Mul", [x, g.const(np.array(1 / np.sqrt(2.0)), "isqrt2")])])
        else:
            cube = g.op("Mul", [g.op("Mul", [x, x]), x])
            poly = g.op("Add", [x, g.op("Mul", [cube, g.const(np.array(0.044715), "c")])])
            inner = g.op("Tanh", [g.op("Mul", [poly, g.const(np.array(np.sqrt(2 / np.pi)), "k")])])
        return g.op("Mul", [g.op("Mul", [x, half]), g.op("Add", [inner, one])], act)

    # -- rotary -----------------------------------------------------------------------------
    def _rope_setup(self) -> None:
        """cos/sin constants for every rotary table a layer uses (portable: gathered once each)."""
        g, s, w = self.g, self.spec, self.w
        tables = {"default": (w.rope_cos, w.rope_sin), **w.extra_rope}
        used = set(s.layer_rope) - {None} if s.layer_rope is not None else {"default"}
        self._rope_tables: dict[str, tuple[str, str]] = {}
        for name in sorted(used):
            if name not in tables:
                raise ValueError(f"layer rotary table '{name}' has no weights")
            cos_np, sin_np = tables[name]
            cos = g.const(cos_np, "cos_cache")
            sin = g.const(sin_np, "sin_cache")
            if not self.opt.fused:
                cos = g.op("Gather", [cos, "position_ids"], "cos_g")  # [B,S,R/2]
                sin = g.op("Gather", [sin, "position_ids"], "sin_g")
                cos = g.op("Concat", [cos, cos], "cos_full", axis=-1)
                sin = g.op("Concat", [sin, sin], "sin_full", axis=-1)
                axes = g.shape([2], "axes")
                cos = g.op("Unsqueeze", [cos, axes], "cos_b")  # [B,S,1,R]
                sin = g.op("Unsqueeze", [sin, axes], "sin_b")
            self._rope_tables[name] = (cos, sin)

    def _rope(self, x: str, heads: int, hint: str, table: str = "default") -> str:
        s, g = self.spec, self.g
        cos, sin = self._rope_tables[table]
        if self.opt.fused:
            attrs = {"num_heads": heads, "interleaved": 0}
            if s.rotary_dim != s.head_dim:
                attrs["rotary_embedding_dim"] = s.rotary_dim
            return g.op("RotaryEmbedding", [x, "position_ids", cos, sin], hint,
                        domain=MS_DOMAIN, **attrs)
        d, r = s.head_dim, s.rotary_dim
        x4 = g.op("Reshape", [x, g.shape([0, 0, heads, d])], hint + "_4d")
        if r != d:
            rot, keep = g.op("Split", [x4, g.shape([r, d - r], "split")], hint + "_split", n_out=2, axis=-1)
        else:
            rot, keep = x4, None
        x1, x2 = g.op("Split", [rot, g.shape([r // 2, r // 2], "split")], hint + "_halves", n_out=2, axis=-1)
        rotated = g.op("Concat", [g.op("Neg", [x2]), x1], hint + "_rot", axis=-1)
        out = g.op("Add", [g.op("Mul", [rot, cos]), g.op("Mul", [rotated, sin])], hint + "_rope")
        if keep is not None:
            out = g.op("Concat", [out, keep], hint + "_join", axis=-1)
        return g.op("Reshape", [out, g.shape([0, 0, heads * d])], hint + "_3d")

    # -- masks -------------------------------------------------------------------------------
    def _mask(self, window: int | None) -> str:
        """The additive mask a layer uses, built once per distinct window.

        ``window`` None: the graph input as given. Otherwise the input plus -inf wherever
        ``q_pos - k_pos >= window``, with key positions ``0..P-1`` for the committed past (the
        runtime's cache holds position i at slot i) followed by ``position_ids`` for the new tokens.
        """
        if window in self._masks:
            return self._masks[window]
        g = self.g
        mask = "attention_mask"
        if window is not None:
            if self._distance is None:
                past_shape = g.op("Shape", ["past_key.0"], "past_shape")
                past_len = g.op("Gather", [past_shape, g.const(np.array(1, dtype=np.int64), "one_i", dtype=np.int64)],
                                "past_len", axis=0)
                past_pos = g.op("Range", [g.const(np.array(0, dtype=np.int64), "zero_i", dtype=np.int64), past_len,
                                          g.const(np.array(1, dtype=np.int64), "step_i", dtype=np.int64)],
                                "past_positions")  # [P]
                q_pos = g.op("Unsqueeze", ["position_ids", g.shape([2], "axes")], "q_positions")  # [B,S,1]
                new_pos = g.op("Unsqueeze", ["position_ids", g.shape([1], "axes")], "k_positions")  # [B,1,S]
                self._distance = g.op("Concat", [g.op("Sub", [q_pos, past_pos], "dist_past"),
                                                 g.op("Sub", [q_pos, new_pos], "dist_new")],
                                      "distance", axis=-1)  # [B,S,P+S] = q_pos - k_pos
            inside = g.op("Less", [self._distance, g.const(np.array(window, dtype=np.int64), "window",
                                                            dtype=np.int64)], "in_window")
            extra = g.op("Where", [inside, g.const(np.array(0.0, dtype=np.float32), "zero_f", dtype=np.float32),
                                   g.const(np.array(-np.inf, dtype=np.float32), "ninf", dtype=np.float32)],
                         "window_bias")
            extra = g.op("Unsqueeze", [extra, g.shape([1], "axes")], "window_bias_4d")  # [B,1,S,T]
            mask = g.op("Add", [mask, extra], f"mask_w{window}")
        if self.opt.attention_accumulation == "fp64":
            mask = g.op("Cast", [mask], "mask_cast", to=TensorProto.DOUBLE)
        elif g.np_dtype != np.float32:
            mask = g.op("Cast", [mask], "mask_cast", to=g.onnx_dtype)
        grp = self.spec.num_heads // self.spec.num_kv_heads
        if grp > 1 and not self._fused_attn:  # rows ordered (group, seq): tile the [S, T] mask once per group
            mask = g.op("Tile", [mask, g.shape([1, 1, grp, 1], "tile")], "mask_tiled")
        self._masks[window] = mask
        return mask

    # -- attention ---------------------------------------------------------------------------
    def _attention(self, q: str, k_all: str, v_all: str, mask: str, hint: str) -> str:
        """Grouped attention without repeating K/V: query heads of one KV head share a GEMM."""
        g, s = self.g, self.spec
        h, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        grp = h // hkv
        if grp == 1:
            q4 = g.op("Transpose", [g.op("Reshape", [q, g.shape([0, 0, h, d])])], hint + "_q", perm=[0, 2, 1, 3])
        else:
            q5 = g.op("Reshape", [q, g.shape([0, 0, hkv, grp, d])], hint + "_q5")
            q5 = g.op("Transpose", [q5], hint + "_qt", perm=[0, 2, 3, 1, 4])  # [B,Hkv,G,S,D]
            q4 = g.op("Reshape", [q5, g.shape([0, hkv, -1, d])], hint + "_q")  # [B,Hkv,G*S,D]
        kt = g.op("Transpose", [k_all], hint + "_kt", perm=[0, 2, 3, 1])  # [B,Hkv,D,T]
        vt = g.op("Transpose", [v_all], hint + "_vt", perm=[0, 2, 1, 3])  # [B,Hkv,T,D]
        scores = g.op("MatMul", [q4, kt], hint + "_scores")
        if s.attn_softcap:  # the 1/c is folded into the query weights with the scale
            scores = g.op("Mul", [g.op("Tanh", [scores], hint + "_tanh"),
                                  g.const(np.array(s.attn_softcap), "softcap")], hint + "_capped")
        if self.opt.attention_accumulation == "fp64":
            # Sums over the key axis in float64, rounded once to the graph dtype: a tree node's
            # visible keys sit at other columns than in sequential decoding (holes of masked
            # siblings), and ONNX Runtime's float32 Softmax / MatMul reductions group terms by
            # column, so float32 tree rows differ from sequential rows in the last bits
            # (weight-only int4 with int8 activations amplifies that into flipped argmaxes).
            # In float64 the grouping changes the result below float32 resolution.
            scores = g.op("Cast", [scores], hint + "_scores64", to=TensorProto.DOUBLE)
            vt = g.op("Cast", [vt], hint + "_v64", to=TensorProto.DOUBLE)
        scores = g.op("Add", [scores, mask], hint + "_masked")
        probs = g.op("Softmax", [scores], hint + "_probs", axis=-1)
        ctx = g.op("MatMul", [probs, vt], hint + "_ctx")  # [B,Hkv,G*S,D]
        if self.opt.attention_accumulation == "fp64":
            ctx = g.op("Cast", [ctx], hint + "_ctx32", to=g.onnx_dtype)
        if grp == 1:
            ctx = g.op("Transpose", [ctx], hint + "_ctxt", perm=[0, 2, 1, 3])
        else:
            ctx = g.op("Reshape", [ctx, g.shape([0, hkv, grp, -1, d])], hint + "_ctx5")
            ctx = g.op("Transpose", [ctx], hint + "_ctxt", perm=[0, 3, 1, 2, 4])  # [B,S,Hkv,G,D]
        return g.op("Reshape", [ctx, g.shape([0, 0, h * d])], hint + "_merged")

    def _attend(self, q: str, k: str, v: str, layer: int, window, prefix: str) -> str:
        """Layer ``layer``'s attention over its past and new K/V (``new_key.{layer}`` /
        ``new_value.{layer}``, already emitted): one fused node, or the decomposed ops."""
        if self._fused_attn:
            return self._fused_attention(q, k, v, layer, self._mask(window), prefix + "_attn")
        g = self.g
        k_all = g.op("Concat", [f"past_key.{layer}", f"new_key.{layer}"], prefix + "_k_all", axis=1)
        v_all = g.op("Concat", [f"past_value.{layer}", f"new_value.{layer}"], prefix + "_v_all", axis=1)
        return self._attention(q, k_all, v_all, self._mask(window), prefix + "_attn")

    def _fused_attention(self, q: str, k: str, v: str, layer: int, mask: str, hint: str) -> str:
        """Attention as one ONNX ``Attention`` node (opset 23; ONNX Runtime's CPU kernel since 1.23).

        Drafts by default, targets with ``--target-attention fused`` (``GraphOptions.fused_attention``):
        the kernel sums over keys in float32, in its own grouping, so tree rows are not
        bit-identical to sequential rows (the target's float64 sums are, see :meth:`_attention`);
        a draft's numbers only decide what is proposed, a fused target is exact for chains only.
        The contract is unchanged: past K/V stay sequence-major ``[B, P, Hkv, D]`` and are joined
        with the new rows as ``[B, P+S, Hkv*D]`` (a 3-D K/V is read as ``[B, T, Hkv, D]``, so the
        reshapes move no data); the additive ``[B, 1, S, T]`` mask (causal, chain, tree, per-layer
        windows, padded batch rows) is the op's ``attn_mask`` as is, broadcast over heads; grouped
        K/V heads are the op's ``kv_num_heads`` (no repeat); the attention scale stays folded into
        the query weights (``scale=1``) and Gemma 2's soft-cap is the op's ``softcap``.
        """
        g, s = self.g, self.spec
        hkv, d = s.num_kv_heads, s.head_dim
        flat = g.shape([0, 0, hkv * d])
        k_all = g.op("Reshape", [g.op("Concat", [f"past_key.{layer}", f"new_key.{layer}"], hint + "_k4", axis=1), flat],
                     hint + "_k_all")
        v_all = g.op("Reshape", [g.op("Concat", [f"past_value.{layer}", f"new_value.{layer}"], hint + "_v4", axis=1),
                                 flat], hint + "_v_all")
        attrs = {"softcap": float(s.attn_softcap)} if s.attn_softcap else {}
        return g.op("Attention", [q, k_all, v_all, mask], hint, q_num_heads=s.num_heads, kv_num_heads=hkv,
                    scale=1.0, **attrs)

    # -- whole model -------------------------------------------------------------------------
    def build(self) -> onnx.ModelProto:
        s, g, w = self.spec, self.g, self.w
        h, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        kv_type = g.onnx_dtype
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, ["batch", 1, "seq", "total"]),
        ]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", s.vocab_size])]
        for i in range(s.num_layers):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_{kind}.{i}", kv_type, ["batch", "past", hkv, d]))
                outputs.append(helper.make_tensor_value_info(f"new_{kind}.{i}", kv_type, ["batch", "seq", hkv, d]))

        x = self._embedding()
        if s.embedding_scale is not None and s.embedding_scale != 1.0:
            x = g.op("Mul", [x, g.const(np.array(s.embedding_scale), "embed_scale")], "embed_scaled")
        if s.positions == "learned":
            pos = g.op("Gather", [g.const(w.positions, "wpe"), "position_ids"], "embed_positions")
            x = g.op("Add", [x, pos], "embed_sum")
        else:
            self._rope_setup()
        if s.layer_windows is not None and s.sliding_window is not None:
            raise ValueError("a model has either one sliding window for the runtime or per-layer windows")
        self._masks: dict[int | None, str] = {}
        self._distance: str | None = None
        windows = s.layer_windows or [None] * s.num_layers
        ropes = s.layer_rope or ["default"] * s.num_layers

        scale = s.attention_scale if s.attention_scale is not None else 1.0 / np.sqrt(d)
        # tanh(q.k * scale / c) * c: 1/c folded into q too, unless the fused op applies the soft-cap
        q_fold = scale / s.attn_softcap if s.attn_softcap and not self._fused_attn else scale
        residual, pending = x, None
        layer_out: dict[int, str] = {}  # layer -> its output (the residual stream after it), for ``features``
        for i, lw in enumerate(w.layers):
            p = f"l{i}"
            lw = self._fold_residual_multiplier(lw)
            if lw.ln1_w is not None:
                normed, residual = self._norm(residual, pending, lw.ln1_w, lw.ln1_b, p + "_ln1")
            else:  # no pre-attention norm (OLMo 2): the branch reads the residual stream itself
                if pending is not None:
                    residual = g.op("Add", [residual, pending], p + "_residual")
                normed = residual
            if i > 0:  # the norm's skip sum (or the Add) is the previous layer's output
                layer_out[i - 1] = residual
            q_w, q_b, q_norm = lw.q_w, lw.q_b, lw.q_norm_w
            if q_norm is not None:
                q_norm = q_norm * q_fold
            else:
                q_w = q_w * q_fold
                q_b = None if q_b is None else q_b * q_fold
            qkv_w = np.concatenate([q_w, lw.k_w, lw.v_w], axis=1)
            qkv_b = None
            if lw.q_b is not None or lw.k_b is not None or lw.v_b is not None:
                zeros = lambda n: np.zeros(n, dtype=np.float32)  # noqa: E731
                qkv_b = np.concatenate([
                    q_b if q_b is not None else zeros(h * d),
                    lw.k_b if lw.k_b is not None else zeros(hkv * d),
                    lw.v_b if lw.v_b is not None else zeros(hkv * d),
                ])
            qkv = self._linear(normed, qkv_w, qkv_b, p + "_qkv")
            q, k, v = g.op("Split", [qkv, g.shape([h * d, hkv * d, hkv * d], "split")], p + "_qkv_split",
                           n_out=3, axis=-1)
            if q_norm is not None:
                if s.qk_norm == "full":  # over the whole projection, before the head split
                    q, _ = self._norm(q, None, q_norm, None, p + "_qnorm")
                    k, _ = self._norm(k, None, lw.k_norm_w, None, p + "_knorm")
                else:
                    q = self._head_rms(q, h, q_norm, p + "_qnorm")
                    k = self._head_rms(k, hkv, lw.k_norm_w, p + "_knorm")
            if s.positions == "rope" and ropes[i] is not None:
                q = self._rope(q, h, p + "_qrope", ropes[i])
                k = self._rope(k, hkv, p + "_krope", ropes[i])
            kv_shape = g.shape([0, 0, hkv, d])
            g.op("Reshape", [k, kv_shape], outputs=[f"new_key.{i}"])
            g.op("Reshape", [v, kv_shape], outputs=[f"new_value.{i}"])
            attn = self._linear(self._attend(q, k, v, i, windows[i], p), lw.o_w, lw.o_b, p + "_o")
            if lw.post_attn_norm_w is not None:
                attn, _ = self._norm(attn, None, lw.post_attn_norm_w, None, p + "_post_attn_norm")

            if s.parallel_residual:
                normed2, _ = self._norm(residual, None, lw.ln2_w, lw.ln2_b, p + "_ln2")
                mlp = self._mlp(normed2, lw, p)
                pending = g.op("Add", [attn, mlp], p + "_delta")
            else:
                if lw.ln2_w is not None:
                    normed2, residual = self._norm(residual, attn, lw.ln2_w, lw.ln2_b, p + "_ln2")
                else:
                    residual = g.op("Add", [residual, attn], p + "_residual_attn")
                    normed2 = residual
                pending = self._mlp(normed2, lw, p)
                if lw.post_mlp_norm_w is not None:
                    pending, _ = self._norm(pending, None, lw.post_mlp_norm_w, None, p + "_post_mlp_norm")

        final, layer_out[s.num_layers - 1] = self._norm(residual, pending, w.final_norm_w, w.final_norm_b, "final_norm")
        logits = self._lm_head(self._kept_rows(final, inputs))
        if s.final_softcap:  # tanh(logits / c) * c, the 1/c folded into lm_head
            logits = g.op("Mul", [g.op("Tanh", [logits], "logits_tanh"),
                                  g.const(np.array(s.final_softcap), "final_softcap")], "logits_capped")
        if self.opt.output_ids is not None:
            logits = self._widen_logits(logits)
        if g.np_dtype != np.float32:
            logits = g.op("Cast", [logits], "logits_cast", to=TensorProto.FLOAT)
        if self._fused_attn and g.nodes[-1].output[0] == logits:
            g.nodes[-1].output[0] = "logits"  # the last node writes the output (no Identity)
        else:
            g.op("Identity", [logits], outputs=["logits"])
        if self.opt.feature_layers is not None:
            outputs.append(self._features(layer_out))

        return self.finish(f"specdec_{s.family}", inputs, outputs)

    def _kept_rows(self, final: str, inputs: list) -> str:
        """The rows of ``final`` the LM head sees: the last ``logits_to_keep`` (transformers' name),
        every row when it is 0, its default. A prefill needs its last row's logits only, and the
        LM head is ~15% of a prefill's work at a 152k vocabulary (and [S, V] floats of output);
        verify and tree calls leave the default. An input with an initializer is optional in
        ONNX (IR >= 4), so callers that do not know it, and older bundles' callers, are unchanged."""
        inputs.append(helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]))
        self.g.inits.append(numpy_helper.from_array(np.zeros(1, dtype=np.int64), "logits_to_keep"))
        return self._last_rows(final)

    def _last_rows(self, x: str) -> str:
        """The last ``logits_to_keep`` rows of ``x`` [B, S, H] (all of them for 0)."""
        g = self.g
        return g.op("Slice", [x, g.op("Neg", ["logits_to_keep"], "keep_from"),
                              g.shape([np.iinfo(np.int64).max], "keep_end"), g.shape([1], "keep_axis")], "kept_rows")

    def finish(self, name: str, inputs: list, outputs: list):
        """The ModelProto of what was emitted: opsets (the contrib domain when used) and the IR
        version ONNX Runtime reads for that opset."""
        g = self.g
        graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
        opsets = [helper.make_opsetid("", g.opset)]
        if self.opt.fused or g.uses_ms_domain:
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="specdec-rt")
        model.ir_version = 8 if g.opset <= 17 else (9 if g.opset <= 20 else helper.find_min_ir_version_for(opsets[:1]))
        return model

    def _features(self, layer_out: dict[int, str]):
        """The ``features`` output: the listed layers' outputs side by side, float32."""
        g, s = self.g, self.spec
        layers = tuple(self.opt.feature_layers)
        parts = [layer_out[i] for i in layers]
        cast = g.np_dtype != np.float32
        joined = parts[0] if len(parts) == 1 else g.op("Concat", parts, "features_cat" if cast else None,
                                                         outputs=None if cast else ["features"], axis=-1)
        if cast:
            g.op("Cast", [joined], outputs=["features"], to=TensorProto.FLOAT)
        elif len(parts) == 1:
            g.op("Identity", [joined], outputs=["features"])
        return helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", "seq", len(layers) * s.hidden_size])

    # -- embedding and LM head -------------------------------------------------------------------
    def _logit_fold(self) -> float:
        """Factor folded into the LM head: Granite's logit multiplier, 1 / final soft-cap."""
        s = self.spec
        fold = s.logit_multiplier if s.logit_multiplier is not None else 1.0
        if s.final_softcap:
            fold /= s.final_softcap
        return fold

    def _vocab_matmul(self, source, hint: str, fold: float = 1.0) -> str:
        """The LM head's ``[hidden, V]`` MatMul matrix, converted and written in row blocks."""
        if not isinstance(source, VocabMatrix):
            return self.g.const(source * fold if fold != 1.0 else source, hint)
        v, h = source.shape
        blocks = (source.columns_t(a, b) * fold if fold != 1.0 else source.columns_t(a, b) for a, b in _blocks(h, v))
        return self.g.const_blocks(hint, (h, v), blocks)

    def _vocab_quantized(self, source, hint: str, fold: float = 1.0) -> tuple[str, str]:
        """Quantize the ``[hidden, V]`` matrix of ``source`` (a VocabMatrix, or an array already in
        MatMul layout) in blocks of vocabulary columns: the same bytes as quantizing it whole."""
        if not isinstance(source, VocabMatrix):
            return self._quantized(source * fold if fold != 1.0 else source, hint)
        g = self.g
        v, h = source.shape
        g.count_weights(v * h)
        bs = self.opt.block_size
        k_blocks, blob = (h + bs - 1) // bs, bs * self.bits // 8
        scales: list[np.ndarray] = []

        def packed_blocks():
            for a, b in _blocks(v, h):
                rows = source.rows(a, b)  # [b - a, hidden]: columns a..b of the MatMul matrix
                if fold != 1.0:
                    rows = rows * fold
                packed, sc = quantize_blockwise(np.ascontiguousarray(rows.T), self.bits, bs)
                scales.append(sc)
                yield packed

        packed = g.packed_blocks(hint + "_q", np.uint8, (v, k_blocks, blob), packed_blocks())
        return packed, g.packed(np.concatenate(scales).astype(g.np_dtype), hint + "_scales")

    def _vocab_per_channel(self, source, hint: str, fold: float = 1.0) -> tuple[str, str]:
        """W8A8: the LM head's ``[hidden, V]`` matrix as int8 + one scale per vocabulary entry;
        a VocabMatrix is read twice in blocks (peaks per entry, then the integers by rows of the
        MatMul layout): the same bytes as :func:`quantize_per_channel` of the whole matrix."""
        if not isinstance(source, VocabMatrix):
            return self._per_channel(source * fold if fold != 1.0 else source, hint)
        g = self.g
        v, h = source.shape
        g.count_weights(v * h)
        peaks = np.concatenate([np.abs(source.rows(a, b) * np.float32(fold) if fold != 1.0 else source.rows(a, b))
                                .max(axis=1) for a, b in _blocks(v, h)])
        scales = np.where(peaks > 0, peaks / W8A8_WEIGHT_LIMIT, 1.0).astype(np.float32)

        def int_blocks():
            for a, b in _blocks(h, v):
                cols = source.columns_t(a, b)
                if fold != 1.0:
                    cols = cols * np.float32(fold)
                yield np.clip(np.rint(cols / scales), -W8A8_WEIGHT_LIMIT, W8A8_WEIGHT_LIMIT).astype(np.int8)

        q = g.packed_blocks(hint + "_q", np.int8, (h, v), int_blocks())
        return q, g.packed(scales, hint + "_scales")

    def _embedding_w8a8(self, shared: bool) -> str:
        """W8A8 token embeddings: int8 rows times their scale. Tied: columns of the LM head's
        [hidden, V] integers (Gather on axis 1 + Transpose); untied: a [V, hidden] int8 table."""
        g, w = self.g, self.w
        if shared:
            q, scales = self._vocab_per_channel(w.lm_head, "lm_head")
            self._lm = ("w8a8", q, scales)
            x = g.op("Gather", [q, "input_ids"], "embed_tokens_q", axis=1)  # [hidden, B, S] int8
            x = g.op("Transpose", [g.op("Cast", [x], "embed_tokens_f", to=TensorProto.FLOAT)], "embed_tokens_bsh",
                     perm=[1, 2, 0])
        else:
            embed = w.embed
            rows = embed.rows if isinstance(embed, VocabMatrix) else (lambda a, b: np.asarray(embed[a:b]))
            v, h = embed.shape
            g.count_weights(v * h)
            parts: list[np.ndarray] = []

            def row_blocks():  # a scale per token: per output channel of the table's transpose
                for a, b in _blocks(v, h):
                    q_t, sc = quantize_per_channel(rows(a, b).T)
                    parts.append(sc)
                    yield np.ascontiguousarray(q_t.T)

            q = g.packed_blocks("embed_q", np.int8, (v, h), row_blocks())
            scales = g.packed(np.concatenate(parts), "embed_scales")
            x = g.op("Cast", [g.op("Gather", [q, "input_ids"], "embed_tokens_q")], "embed_tokens_bsh",
                     to=TensorProto.FLOAT)
        row_scale = g.op("Unsqueeze", [g.op("Gather", [scales, "input_ids"], "embed_scale"), g.shape([-1], "axes")],
                         "embed_scale_col")  # [B, S, 1]
        return g.op("Mul", [x, row_scale], "embed_tokens")

    def _embedding(self) -> str:
        """Token embeddings [B, S, hidden].

        Tied embeddings (the LM head is the embedding table, unscaled, without bias) are stored
        once: the LM head's [hidden, V] matrix (or its quantized form) also serves the lookup,
        by ``Gather`` on axis 1 + ``Transpose`` (float) or ``GatherBlockQuantized`` (quantized).
        Quantized untied tables are stored in the same packed layout; a hidden size that is not a
        multiple of the block size keeps a float table. Vocabulary-sized matrices are converted
        in blocks of at most VOCAB_BLOCK_BYTES.
        """
        g, s, w = self.g, self.spec, self.w
        self._lm: tuple | None = None  # the LM head, when the embedding emitted it
        shared = w.tied and w.lm_head_b is None and self._logit_fold() == 1.0
        if self.w8a8 and self.opt.quantize_embedding:
            return self._embedding_w8a8(shared)
        if self.w8a8 and shared:  # a float table for the lookup, the LM head stays W8A8
            shared = False
        quantized_table = self.bits and self.opt.quantize_embedding and s.hidden_size % self.opt.block_size == 0
        if shared and (quantized_table or not self.bits):
            if self.bits:
                packed, scales = self._vocab_quantized(w.lm_head, "lm_head")
                self._lm = ("nbits", packed, scales)
                return self._gather_quantized(packed, scales)
            table = self._vocab_matmul(w.lm_head, "lm_head_w")
            self._lm = ("float", table)
            x = g.op("Gather", [table, "input_ids"], "embed_tokens", axis=1)  # [hidden, B, S]
            return g.op("Transpose", [x], "embed_tokens_bsh", perm=[1, 2, 0])
        embed = w.embed
        if quantized_table:
            # the table as the weight of x @ embed.T: packed [V, blocks, blob], like an LM head
            source = embed if isinstance(embed, VocabMatrix) else np.ascontiguousarray(embed.T)
            packed, scales = self._vocab_quantized(source, "embed")
            return self._gather_quantized(packed, scales)
        if isinstance(embed, VocabMatrix):
            v, h = embed.shape
            table = g.const_blocks("embed", (v, h), (embed.rows(a, b) for a, b in _blocks(v, h)))
        else:
            table = g.const(embed, "embed")
        return g.op("Gather", [table, "input_ids"], "embed_tokens")

    def _gather_quantized(self, packed: str, scales: str) -> str:
        """Rows of a table packed like a MatMulNBits weight ([V, blocks, blob], scales [V, blocks]);
        GatherBlockQuantized wants the scales as [V, blocks, 1] (ONNX Runtime folds the Reshape)."""
        g = self.g
        scales_3d = g.op("Reshape", [scales, g.shape([self.spec.vocab_size, -1, 1])], "embed_scales_3d")
        x = g.op("GatherBlockQuantized", [packed, "input_ids", scales_3d], "embed_tokens", domain=MS_DOMAIN,
                 bits=self.bits, block_size=self.opt.block_size, gather_axis=0, quantize_axis=2)
        return g.op("Reshape", [x, g.shape([0, 0, self.spec.hidden_size])], "embed_tokens_bsh")  # [B,S,blocks,bs] -> [B,S,H]

    def _lm_head(self, final: str) -> str:
        g, s, w = self.g, self.spec, self.w
        if self._lm is not None and self._lm[0] == "w8a8":
            return self._matmul_w8a8(final, self._lm[1], self._lm[2], "lm_head", s.hidden_size, "kept")
        if self._lm is not None and self._lm[0] == "nbits":
            return self._matmul_nbits(final, self._lm[1], self._lm[2], s.hidden_size, self.out_vocab, "lm_head")
        if self._lm is not None:
            return g.op("MatMul", [final, self._lm[1]], "lm_head")
        fold = self._logit_fold()
        if self.w8a8:
            q, scales = self._vocab_per_channel(w.lm_head, "lm_head", fold)
            y = self._matmul_w8a8(final, q, scales, "lm_head", s.hidden_size, "kept")
        elif self.bits:
            packed, scales = self._vocab_quantized(w.lm_head, "lm_head", fold)
            y = self._matmul_nbits(final, packed, scales, s.hidden_size, self.out_vocab, "lm_head")
        else:
            y = g.op("MatMul", [final, self._vocab_matmul(w.lm_head, "lm_head_w", fold)], "lm_head")
        if w.lm_head_b is not None:
            y = g.op("Add", [y, g.const(w.lm_head_b * fold, "lm_head_b")], "lm_head_bias")
        return y

    def _widen_logits(self, logits: str) -> str:
        """[B, S, N] logits of the kept tokens -> [B, S, V], -inf elsewhere (probability exactly
        0 under any softmax, never an argmax): one Expand of -inf and one ScatterElements, a
        write of V floats per row against the N x hidden GEMM it replaces V x hidden of."""
        g, v = self.g, self.spec.vocab_size
        ids = self.opt.output_ids
        shape = g.op("Shape", [logits], "logits_cut_shape")
        lead = g.op("Slice", [shape, g.shape([0]), g.shape([2]), g.shape([0])], "logits_lead")
        full = g.op("Concat", [lead, g.shape([v])], "logits_full_shape", axis=0)
        floor = g.op("Expand", [g.const(np.array(-np.inf), "logits_floor", dtype=g.np_dtype), full], "logits_floor_full")
        where = g.op("Expand", [g.packed(np.asarray(ids, dtype=np.int64), "output_ids"), shape], "logits_cut_ids")
        return g.op("ScatterElements", [floor, where, logits], "logits_widened", axis=2)

    def _fold_residual_multiplier(self, lw):
        """Granite's ``residual + branch * m``: m folded into the o and down projections."""
        m = self.spec.residual_multiplier
        if m is None or m == 1.0:
            return lw
        if lw.post_attn_norm_w is not None or lw.post_mlp_norm_w is not None:
            raise ValueError("a residual multiplier after a post-branch norm cannot be folded")
        scaled = lambda a: None if a is None else a * m  # noqa: E731
        return replace(lw, o_w=lw.o_w * m, o_b=scaled(lw.o_b), down_w=lw.down_w * m, down_b=scaled(lw.down_b))

    def _mlp(self, x: str, lw, p: str) -> str:
        g = self.g
        if self.spec.gated_mlp:
            inter = lw.up_w.shape[1]
            gu_w = np.concatenate([lw.gate_w, lw.up_w], axis=1)
            gu_b = None
            if lw.gate_b is not None or lw.up_b is not None:
                gu_b = np.concatenate([
                    lw.gate_b if lw.gate_b is not None else np.zeros(inter, np.float32),
                    lw.up_b if lw.up_b is not None else np.zeros(inter, np.float32),
                ])
            gu = self._linear(x, gu_w, gu_b, p + "_gate_up")
            gate, up = g.op("Split", [gu, g.shape([inter, inter], "split")], p + "_gu_split", n_out=2, axis=-1)
            hidden = g.op("Mul", [self._activation(gate), up], p + "_gated")
        else:
            hidden = self._activation(self._linear(x, lw.up_w, lw.up_b, p + "_fc_in"))
        return self._linear(hidden, lw.down_w, lw.down_b, p + "_down")


def build_model(spec: ArchSpec, weights: ModelWeights, options: GraphOptions) -> onnx.ModelProto:
    """The whole graph in memory, weights inline (small models; see ``write_model`` for any size)."""
    return GraphBuilder(spec, weights, options).build()


@dataclass
class WrittenGraph:
    files: list[str]  # the .onnx file and its one external-data file
    sha256: dict[str, str]  # file -> digest
    num_params: int
    num_nodes: int
    size_bytes: int
    unquantized_bytes: int  # the initializers' size had nothing been quantized
    opset: int = 17  # the default domain's opset of the graph written


def write_model(spec: ArchSpec, weights: ModelWeights, options: GraphOptions, path: str) -> WrittenGraph:
    """Build the graph straight to ``path`` + ``path.data``: weights are converted, quantized if
    asked, written and dropped one at a time, so memory stays at about one layer's weights."""
    def build(writer: TensorWriter):
        builder = GraphBuilder(spec, weights, options, writer)
        return builder.build(), builder.g

    return write_graph(path, build)


def write_graph(path: str, build) -> WrittenGraph:
    """Write the graph that ``build(writer)`` makes (it returns the ModelProto and the builder's
    ``g``, whose initializers went to ``writer``) to ``path`` + ``path.data``."""
    data_path = path + ".data"
    writer = TensorWriter(data_path)
    try:
        model, g = build(writer)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    graph_bytes = model.SerializeToString()  # names, shapes, offsets: kilobytes at any model size
    try:
        with open(path, "wb") as f:
            f.write(graph_bytes)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ExportError(f"no space left on the device writing {path}; free space or choose another --out") from None
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    digests = {path: hashlib.sha256(graph_bytes).hexdigest(), data_path: writer.sha256.hexdigest()}
    return WrittenGraph(files=[path, data_path], sha256=digests, num_params=g.num_params, num_nodes=len(model.graph.node),
                        size_bytes=os.path.getsize(path) + os.path.getsize(data_path),
                        unquantized_bytes=g.unquantized_bytes, opset=g.opset)
