"""EAGLE-3 heads as ONNX graphs (issue 22): ``head/fc.onnx`` and ``head/model.onnx``.

The head (specdec_rt.export.eagle: fc + one decoder layer over ``[norm(embed(token)),
norm(hidden)]`` + norm + a reduced LM head) is built op by op with the target builder's emitters
(:class:`HeadGraphBuilder` is a :class:`~specdec_rt.export.graph.GraphBuilder` over a one-layer
``ArchSpec``): fused RMSNorm / skip-norm / rotary of ONNX Runtime's contrib domain (or the
portable decompositions), q/k/v and gate/up packed into single GEMMs, the attention scale folded
into the query weights, grouped attention without repeating K/V, attention with float32 sums
(one ONNX Attention node with ``fused_attention``, as drafts; the head only proposes),
MatMulNBits / GatherBlockQuantized with ``quantize``.

Graph contract (docs/design.md, "EAGLE-3 heads: export"):

- ``head/fc.onnx``: ``features`` float32 [B, S, F] -> ``hidden_states`` float32 [B, S, H], the
  fc over the target's ``features`` output (F = len(feature_layers) x target hidden).
- ``head/model.onnx``: inputs ``input_ids`` int64 [B, S], ``hidden_states`` float32 [B, S, H]
  (fc's output at a verified position, a previous ``hidden_out`` at a drafted one),
  ``position_ids`` int64 [B, S], ``attention_mask`` float32 [B, 1, S, P + S] (additive, 0 or
  -inf), ``past_key.0`` / ``past_value.0`` float32 [B, P, Hkv, D] (sequence-major),
  ``logits_to_keep`` int64 [1] (n, 1 <= n <= S: logits for the last n rows only); outputs
  ``logits`` float32 [B, n, V] (the target's vocabulary, -inf outside the draft vocabulary:
  draft id d lands at target id d + d2t[d]), ``hidden_out`` float32 [B, S, H] (the layer's
  output before the final norm), ``new_key.0`` / ``new_value.0`` [B, S, Hkv, D] (rotated K, V).

Row convention (eagle.py): the row at position i pairs the target's feature of position i with
the token at i + 1, predicts the token at i + 2, has rotary position i and its K/V at slot i.
"""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from specdec_rt.errors import ExportError, ValidationError
from specdec_rt.export.arch import ArchSpec, LayerWeights, ModelWeights, VocabMatrix
from specdec_rt.export.config_files import read_json_config
from specdec_rt.export.graph import GraphBuilder, GraphOptions, WrittenGraph, write_graph
from specdec_rt.export.quantize import QUANT_BITS

HEAD_DIR = "head"
FAMILY = "eagle3"


# -- loading -------------------------------------------------------------------------------------

def read_head_config(folder) -> dict:
    """The head folder's config.json as a dict; one line when the folder or the file is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"--draft-head '{folder}' is not a folder (an EAGLE-3 head: config.json + "
                          "model.safetensors or pytorch_model.bin)")
    path = folder / "config.json"
    if not path.is_file():
        raise ExportError(f"'{folder}' is not an EAGLE-3 head folder: config.json is missing")
    return read_json_config(path, "head config")


def check_head_folder(folder, target_checkpoint=None) -> None:
    """Before anything is loaded: the folder holds a readable head config and weights (and, when
    the target's config.json says how many layers it has, feature layers within them)."""
    from specdec_rt.export.eagle import HEAD_WEIGHTS, EagleConfig

    data = read_head_config(folder)
    folder = Path(folder)
    if not (folder / HEAD_WEIGHTS).is_file() and not (folder / "pytorch_model.bin").is_file():
        raise ExportError(f"'{folder}' holds no head weights ({HEAD_WEIGHTS} or pytorch_model.bin)")
    layers = None
    if target_checkpoint is not None and (Path(target_checkpoint) / "config.json").is_file():
        try:
            layers = json.loads((Path(target_checkpoint) / "config.json").read_text()).get("num_hidden_layers")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            pass
    layers = layers if isinstance(layers, int) else None
    named = data.get("eagle_aux_hidden_state_layer_ids") or (data.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if layers is None and not named:
        return  # the defaults depend on the target's depth: checked once it is loaded
    cfg = EagleConfig.from_json(data, layers)  # a missing field or an unsupported switch: one line
    bad = [i for i in cfg.feature_layers if layers is not None and not 0 <= i < layers]
    if bad:
        raise ExportError(f"this EAGLE-3 head reads feature layers {bad}, outside the target's {layers} layers")


def load_target_head(folder, torch_model, spec: ArchSpec):
    """The head of ``folder`` for the loaded target: checked against it first (one line naming
    what differs: vocabulary, hidden size, feature layers), then loaded with the target's token
    embedding table (eagle.load_head)."""
    from specdec_rt.export.eagle import EagleConfig, check_head_matches, load_head

    cfg = EagleConfig.from_json(read_head_config(folder), spec.num_layers)
    check_head_matches(cfg, spec.vocab_size, spec.hidden_size, spec.num_layers)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ExportError(f"the head's {cfg.num_attention_heads} attention heads are not a multiple of its "
                          f"{cfg.num_key_value_heads} key/value heads")
    embed = torch_model.get_input_embeddings().weight.detach()
    return load_head(folder, embed, spec.num_layers)


# -- canonical form ------------------------------------------------------------------------------

def _mm(linear) -> np.ndarray:
    """An nn.Linear weight [out, in] as a MatMul matrix [in, out] (float32)."""
    return np.ascontiguousarray(linear.weight.detach().float().numpy().T)


def _vec(t) -> np.ndarray:
    return t.detach().float().numpy().copy()


def draft_ids(head) -> np.ndarray:
    """Target id of every draft-vocabulary slot (d + d2t[d]); they must be distinct target ids."""
    ids = head.draft_ids().numpy().astype(np.int64)
    v = head.cfg.vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= v):
        raise ExportError(f"the head's d2t maps draft ids outside the target vocabulary (0..{v - 1})")
    if len(np.unique(ids)) != len(ids):
        raise ExportError("the head's d2t maps two draft ids to the same target token")
    return ids


def head_spec(head, max_positions: int) -> ArchSpec:
    """The head as a one-layer ArchSpec: what the builder's emitters read (RMS norms, SiLU gated
    MLP, full rotary of the default kind over ``max_positions`` positions, the target's vocabulary
    as the logits' width)."""
    cfg = head.cfg
    return ArchSpec(family=FAMILY, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=1,
                    num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    norm="rms", norm_eps=cfg.rms_norm_eps, activation="silu", gated_mlp=True, positions="rope",
                    rotary_dim=cfg.head_dim, max_positions=max_positions)


def head_weights(head, max_positions: int) -> tuple[ModelWeights, dict]:
    """Canonical weights of the head (the layer's in ``layers[0]``, q/k/v reading 2H) and the
    rest the builder needs by name: norms, fc."""
    import torch

    from specdec_rt.export.eagle import rotary_tables

    cfg, layer = head.cfg, head.midlayer
    a, m = layer.self_attn, layer.mlp
    lw = LayerWeights(ln1_w=None, ln1_b=None, q_w=_mm(a.q_proj), k_w=_mm(a.k_proj), v_w=_mm(a.v_proj),
                      q_b=None, k_b=None, v_b=None, o_w=_mm(a.o_proj), o_b=None,
                      ln2_w=_vec(layer.post_attention_layernorm.weight), ln2_b=None,
                      up_w=_mm(m.up_proj), up_b=None, down_w=_mm(m.down_proj), down_b=None, gate_w=_mm(m.gate_proj))
    # the same elementwise float32 arithmetic as eagle.rotary_tables at each position (first half)
    cos, sin = rotary_tables(torch.arange(max_positions), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    half = cfg.head_dim // 2
    weights = ModelWeights(embed=VocabMatrix(head.embed_tokens.weight.detach()),
                           lm_head=VocabMatrix(head.lm_head.weight.detach()), lm_head_b=None,
                           final_norm_w=_vec(head.norm.weight), final_norm_b=None, layers=[lw],
                           rope_cos=cos[:, :half].numpy().copy(), rope_sin=sin[:, :half].numpy().copy())
    extra = {"input_norm": _vec(layer.input_layernorm.weight), "hidden_norm": _vec(layer.hidden_norm.weight),
             "fc": _mm(head.fc), "norm_before_residual": cfg.norm_before_residual}
    return weights, extra


# -- graphs --------------------------------------------------------------------------------------

class HeadGraphBuilder(GraphBuilder):
    """The head's two graphs from the target builder's emitters (see the module docstring)."""

    def __init__(self, spec: ArchSpec, weights: ModelWeights, extra: dict, options: GraphOptions,
                 writer=None) -> None:
        super().__init__(spec, weights, options, writer)
        self.extra = extra

    def build_fc(self):
        """``features`` [B, S, F] -> ``hidden_states`` [B, S, H]."""
        g, fc = self.g, self.extra["fc"]
        self._linear("features", fc, None, "fc")
        g.nodes[-1].output[0] = "hidden_states"  # the GEMM writes the output (no Identity)
        inputs = [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", "seq", fc.shape[0]])]
        outputs = [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", "seq", fc.shape[1]])]
        return self.finish("specdec_eagle3_fc", inputs, outputs)

    def build(self):
        s, g, w = self.spec, self.g, self.w
        h, hkv, d, hid = s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size
        lw = w.layers[0]
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", "seq", hid]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, ["batch", 1, "seq", "total"]),
            helper.make_tensor_value_info("past_key.0", TensorProto.FLOAT, ["batch", "past", hkv, d]),
            helper.make_tensor_value_info("past_value.0", TensorProto.FLOAT, ["batch", "past", hkv, d]),
            helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]),
        ]
        outputs = [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "kept", s.vocab_size]),
            helper.make_tensor_value_info("hidden_out", TensorProto.FLOAT, ["batch", "seq", hid]),
            helper.make_tensor_value_info("new_key.0", TensorProto.FLOAT, ["batch", "seq", hkv, d]),
            helper.make_tensor_value_info("new_value.0", TensorProto.FLOAT, ["batch", "seq", hkv, d]),
        ]
        self._masks, self._distance = {}, None
        emb = self._embedding()
        self._rope_setup()
        e_n, _ = self._norm(emb, None, self.extra["input_norm"], None, "input_norm")
        h_n, _ = self._norm("hidden_states", None, self.extra["hidden_norm"], None, "hidden_norm")
        x = g.op("Concat", [e_n, h_n], "attn_in", axis=-1)  # [B, S, 2H]
        qkv_w = np.concatenate([lw.q_w / np.sqrt(d), lw.k_w, lw.v_w], axis=1)  # the scale folded into q
        qkv = self._linear(x, qkv_w, None, "l0_qkv")
        q, k, v = g.op("Split", [qkv, g.shape([h * d, hkv * d, hkv * d], "split")], "l0_qkv_split", n_out=3, axis=-1)
        q = self._rope(q, h, "l0_qrope")
        k = self._rope(k, hkv, "l0_krope")
        kv_shape = g.shape([0, 0, hkv, d])
        g.op("Reshape", [k, kv_shape], outputs=["new_key.0"])
        g.op("Reshape", [v, kv_shape], outputs=["new_value.0"])
        attn = self._linear(self._attend(q, k, v, 0, None, "l0"), lw.o_w, None, "l0_o")
        # residual: the hidden input (not the 2H attention input), or its normed form with
        # norm_before_residual, as eagle.EagleLayer.residual
        residual_in = h_n if self.extra.get("norm_before_residual") else "hidden_states"
        normed2, residual = self._norm(residual_in, attn, lw.ln2_w, None, "l0_ln2")
        mlp = self._mlp(normed2, lw, "l0")
        g.op("Add", [residual, mlp], outputs=["hidden_out"])
        # logits of the last ``logits_to_keep`` rows only (transformers' name): a catch-up over
        # many verified positions needs its last row's, a tree level all of its rows'
        final, _ = self._norm(self._last_rows("hidden_out"), None, w.final_norm_w, None, "final_norm")
        logits = self._lm_head(final)
        if self.opt.output_ids is not None:
            logits = self._widen_logits(logits)
        g.op("Identity", [logits], outputs=["logits"])
        return self.finish("specdec_eagle3_head", inputs, outputs)


@dataclass
class HeadGraphs:
    model: WrittenGraph
    fc: WrittenGraph
    spec: ArchSpec
    options: GraphOptions


def write_head(head, out_dir, *, max_positions: int, fused: bool = True, opset: int = 17,
               quantize: str | None = None, block_size: int = 32, quantize_embedding: bool = True,
               fused_attention: bool = False) -> HeadGraphs:
    """Write ``out_dir/model.onnx`` and ``out_dir/fc.onnx`` (each with its ``.data`` file).
    ``fused_attention``: one ONNX Attention node (opset 23, ONNX Runtime >= 1.23), as drafts have
    by default: a float32 kernel whose sums group differently, harmless for proposals."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = head_spec(head, max_positions)
    weights, extra = head_weights(head, max_positions)
    ids = draft_ids(head)
    identity = len(ids) == spec.vocab_size and bool((ids == np.arange(len(ids))).all())
    options = GraphOptions(dtype="fp32", opset=opset, fused=fused, attention_accumulation="native",
                           quantize=quantize, block_size=block_size, quantize_embedding=quantize_embedding,
                           output_ids=None if identity else ids, fused_attention=fused and fused_attention)

    def graph(method: str):
        def build(writer):
            builder = HeadGraphBuilder(spec, weights, extra, options, writer)
            return getattr(builder, method)(), builder.g
        return build

    fc = write_graph(str(out_dir / "fc.onnx"), graph("build_fc"))
    model = write_graph(str(out_dir / "model.onnx"), graph("build"))
    return HeadGraphs(model=model, fc=fc, spec=spec, options=options)


# -- validation ----------------------------------------------------------------------------------

PREFILL = 6  # rows of the P = 0 call
VERIFY = 4  # rows of the call on P = PREFILL


@dataclass
class HeadReference:
    """EagleHead.step's outputs (PyTorch, float32) for the validation cases."""

    features: np.ndarray  # [1, PREFILL + VERIFY, F]
    hidden: np.ndarray  # fc(features)
    tokens: np.ndarray  # [1, PREFILL + VERIFY]
    logits: np.ndarray  # [PREFILL + VERIFY, V] (-inf outside the draft vocabulary)
    hidden_out: np.ndarray  # [PREFILL + VERIFY, H]
    keys: np.ndarray  # [PREFILL + VERIFY, Hkv, D]
    values: np.ndarray
    seconds: float = 0.0


def head_reference(head, seed: int = 0) -> HeadReference:
    """fc on random features; a prefill of PREFILL rows at P = 0, then VERIFY rows on that past
    (causal mask), as the head's torch definition computes them."""
    import torch

    t0 = time.perf_counter()
    cfg = head.cfg
    rng = np.random.default_rng(seed)
    n = PREFILL + VERIFY
    features = rng.standard_normal((1, n, len(cfg.feature_layers) * cfg.target_hidden_size)).astype(np.float32)
    tokens = rng.integers(0, cfg.vocab_size, (1, n))
    with torch.no_grad():
        hidden = head.fc(torch.from_numpy(features))
        ids = torch.from_numpy(tokens)
        lg_a, out_a, (k_a, v_a) = head.step(ids[:, :PREFILL], hidden[:, :PREFILL], torch.arange(PREFILL)[None])
        lg_b, out_b, (k_b, v_b) = head.step(ids[:, PREFILL:], hidden[:, PREFILL:], torch.arange(PREFILL, n)[None],
                                            past=(k_a, v_a))
    seq = lambda t: torch.cat(t, dim=2)[0].transpose(0, 1).numpy().copy()  # noqa: E731 - [B,Hkv,T,D] -> [T,Hkv,D]
    return HeadReference(features=features, hidden=hidden.numpy().copy(), tokens=tokens,
                         logits=torch.cat([lg_a, lg_b], dim=1)[0].numpy().copy(),
                         hidden_out=torch.cat([out_a, out_b], dim=1)[0].numpy().copy(),
                         keys=seq((k_a, k_b)), values=seq((v_a, v_b)), seconds=time.perf_counter() - t0)


def _logit_error(got: np.ndarray, want: np.ndarray) -> float:
    """Max |difference| over the finite logits; inf when the -inf pattern differs."""
    if not np.array_equal(np.isneginf(got), np.isneginf(want)) or not np.isfinite(got[~np.isneginf(got)]).all():
        return float("inf")
    keep = ~np.isneginf(want)
    return float(np.abs(got[keep] - want[keep]).max()) if keep.any() else 0.0


def compare_head(model_path: str, fc_path: str, ref: HeadReference, *, enforce: bool = True,
                 prepack: bool = True) -> dict:
    """The head graphs in ONNX Runtime against :func:`head_reference`: fc; prefill (P = 0, S =
    PREFILL); S = VERIFY on P = PREFILL under the causal mask; a one-row decode that must equal
    row 0 of that call, and the same call with ``logits_to_keep`` = 1 its last row. Tolerance 1e-3 x the scale of each output (max |logit|, max |hidden|,
    max |K/V|, at least 1); the -inf pattern of the logits must be identical."""
    import onnxruntime as ort

    from specdec_rt.runtime.engines.sessions import session_options

    t0 = time.perf_counter()
    opts = session_options()
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    fc = ort.InferenceSession(fc_path, opts, providers=["CPUExecutionProvider"])
    sess = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])
    t1 = time.perf_counter()
    names = [o.name for o in sess.get_outputs()]
    hkv, d = ref.keys.shape[1:]

    def run(rows: slice, past_k, past_v, keep: int | None = None):
        s, p = rows.stop - rows.start, past_k.shape[1]
        allowed = np.ones((s, p + s), dtype=bool)
        allowed[:, p:] = np.tril(np.ones((s, s), dtype=bool))
        feed = {"input_ids": ref.tokens[:, rows], "hidden_states": ref.hidden[:, rows],
                "position_ids": np.arange(rows.start, rows.stop, dtype=np.int64)[None],
                "attention_mask": np.where(allowed, 0.0, -np.inf).astype(np.float32)[None, None],
                "past_key.0": past_k, "past_value.0": past_v, "logits_to_keep": np.array([keep or s], dtype=np.int64)}
        return dict(zip(names, sess.run(None, feed)))

    n = PREFILL + VERIFY
    cases: dict[str, dict[str, float]] = {}
    hidden = fc.run(None, {"features": ref.features})[0]
    fc_err = float(np.abs(hidden - ref.hidden).max())
    empty = np.zeros((1, 0, hkv, d), np.float32)
    a = run(slice(0, PREFILL), empty, empty)
    b = run(slice(PREFILL, n), a["new_key.0"], a["new_value.0"])
    c = run(slice(PREFILL, PREFILL + 1), a["new_key.0"], a["new_value.0"])
    for case, out, rows in (("prefill_P0", a, slice(0, PREFILL)), (f"verify_S{VERIFY}", b, slice(PREFILL, n)),
                            ("decode_S1", c, slice(PREFILL, PREFILL + 1))):
        cases[case] = {"logits": _logit_error(out["logits"][0], ref.logits[rows]),
                       "hidden_out": float(np.abs(out["hidden_out"][0] - ref.hidden_out[rows]).max()),
                       "kv": max(float(np.abs(out["new_key.0"][0] - ref.keys[rows]).max()),
                                 float(np.abs(out["new_value.0"][0] - ref.values[rows]).max()))}
    last = run(slice(PREFILL, n), a["new_key.0"], a["new_value.0"], keep=1)  # logits of the last row only
    decode_vs_verify = max(_logit_error(c["logits"][0], b["logits"][0, :1]),
                           float(np.abs(c["hidden_out"][0] - b["hidden_out"][0, :1]).max()),
                           _logit_error(last["logits"][0], b["logits"][0, -1:]))
    finite = ref.logits[~np.isneginf(ref.logits)]
    scale = {"logits": max(1.0, float(np.abs(finite).max())),
             "hidden_out": max(1.0, float(np.abs(ref.hidden_out).max())),
             "kv": max(1.0, float(np.abs(ref.keys).max()), float(np.abs(ref.values).max())),
             "fc": max(1.0, float(np.abs(ref.hidden).max()))}
    worst = {k: max(c[k] for c in cases.values()) for k in ("logits", "hidden_out", "kv")}
    got = np.concatenate([a["logits"][0], b["logits"][0]])
    report = {
        "max_logit_error": worst["logits"], "max_hidden_error": worst["hidden_out"], "max_kv_error": worst["kv"],
        "fc_error": fc_err, "decode_vs_verify_error": decode_vs_verify,
        "neg_inf_pattern_identical": bool(np.array_equal(np.isneginf(got), np.isneginf(ref.logits))),
        "top1_agreement": float(np.mean(np.argmax(got, -1) == np.argmax(ref.logits, -1))),
        "max_abs_logit": scale["logits"], "tolerance": 1e-3 * scale["logits"],
        "cases": {f"{case}.{k}": v for case, errs in cases.items() for k, v in errs.items()},
        "seconds": {"reference": round(ref.seconds, 3), "session": round(t1 - t0, 3),
                    "cases": round(time.perf_counter() - t1, 3)},
    }
    over = [f"{name} {err:.3g} > {1e-3 * scale[key]:.3g}" for name, err, key in (
        ("logits", worst["logits"], "logits"), ("decode-vs-verify", decode_vs_verify, "logits"),
        ("hidden_out", worst["hidden_out"], "hidden_out"), ("K/V", worst["kv"], "kv"), ("fc", fc_err, "fc"))
        if not err <= 1e-3 * scale[key]]
    if enforce and over:
        raise ValidationError("the exported EAGLE-3 head disagrees with PyTorch: " + "; ".join(over) + "; cases: "
                              + ", ".join(f"{k}={v:.3g}" for k, v in report["cases"].items()))
    return report


# -- the export step -----------------------------------------------------------------------------

@dataclass
class HeadExport:
    spec: ArchSpec
    info: dict  # the manifest's models["head"]
    sha256: dict[str, str]  # bundle-relative file -> digest


def export_head(head, source: str, out_dir, *, max_positions: int, fused: bool = True, opset: int = 17,
                quantize: str | None = None, block_size: int = 32, quantize_embedding: bool = True,
                fused_attention: bool = False, validate: bool = True, stages=None) -> HeadExport:
    """Reference (PyTorch), graphs, validation of one loaded head into ``out_dir/head/``; the
    torch head is dropped once the graphs are written. ``stages``: the pipeline's progress."""
    out_dir = Path(out_dir)
    cfg = head.cfg

    def stage(name):
        if stages is not None:
            stages.start(name)

    def done():
        if stages is not None:
            stages.done()

    ref = None
    if validate:
        stage("reference head")
        ref = head_reference(head)
        done()
    stage("build head")
    graphs = write_head(head, out_dir / HEAD_DIR, max_positions=max_positions, fused=fused, opset=opset,
                        quantize=quantize, block_size=block_size, quantize_embedding=quantize_embedding,
                        fused_attention=fused_attention)
    del head
    gc.collect()
    done()
    stage("validate head")
    validation: dict = {}
    if ref is not None:
        paths = (str(out_dir / HEAD_DIR / "model.onnx"), str(out_dir / HEAD_DIR / "fc.onnx"))
        if quantize:  # reported, not enforced, as for the other graphs
            validation = {"quantized": compare_head(*paths, ref, enforce=False)}
        else:
            validation = compare_head(*paths, ref, prepack=False)
    done()
    written = [graphs.model, graphs.fc]
    info = {
        "graph": f"{HEAD_DIR}/model.onnx",
        "fc_graph": f"{HEAD_DIR}/fc.onnx",
        "family": FAMILY,
        "num_layers": 1,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,  # the target's: the width of the logits
        "draft_vocab_size": cfg.draft_vocab_size,
        "dtype": "float32",
        "kv_dtype": "float32",
        "max_positions": max_positions,
        "feature_layers": list(cfg.feature_layers),
        "features_dim": len(cfg.feature_layers) * cfg.target_hidden_size,
        "quantization": quantize,
        "quant_block_size": block_size if quantize in QUANT_BITS else None,  # w8a8: per channel
        "opset": graphs.model.opset,
        "fused_ops": fused,
        "fused_attention": graphs.options.fused_attention,
        "num_parameters": sum(w.num_params for w in written),
        "num_nodes": graphs.model.num_nodes + graphs.fc.num_nodes,
        "size_bytes": sum(w.size_bytes for w in written),
        "size_bytes_unquantized": sum(w.unquantized_bytes for w in written) if quantize
        else sum(w.size_bytes for w in written),
        "validation": validation,
        "source": {"format": "eagle3", "path": str(source)},
    }
    sha = {str(Path(f).relative_to(out_dir)): digest for w in written for f, digest in w.sha256.items()}
    return HeadExport(spec=graphs.spec, info=info, sha256=sha)
