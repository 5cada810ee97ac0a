"""Architecture description: one canonical form for every supported Hugging Face family.

The graph builder never looks at a Hugging Face module. Each family's extractor reads the loaded
PyTorch model once and returns an :class:`ArchSpec` (shapes and switches) plus canonical weights
(``[in, out]`` matrices ready for ``MatMul``). Adding a family means writing one extractor.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specdec_rt.errors import UnsupportedArchitectureError  # noqa: F401 - defined there, re-exported here

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite",
                      "phi3", "smollm3", "olmo2", "starcoder2", "gpt2", "gpt_neox")

# rope types whose cos/sin depend on the position only (a static table is exact): the rotary
# module computes them. "longrope" is capped at its switch point, "dynamic" only rescales beyond
# max_position_embeddings, which caps the exported context.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class LayerWeights:
    """Weights of one decoder layer in MatMul layout (``x @ w``)."""

    ln1_w: np.ndarray | None  # None: no norm before attention (OLMo 2)
    ln1_b: np.ndarray | None
    q_w: np.ndarray
    k_w: np.ndarray
    v_w: np.ndarray
    q_b: np.ndarray | None
    k_b: np.ndarray | None
    v_b: np.ndarray | None
    o_w: np.ndarray
    o_b: np.ndarray | None
    ln2_w: np.ndarray | None  # None: no norm before the MLP (OLMo 2)
    ln2_b: np.ndarray | None
    # gated MLP: up_w and gate_w; plain MLP: up_w only (fc_in)
    up_w: np.ndarray
    up_b: np.ndarray | None
    down_w: np.ndarray
    down_b: np.ndarray | None
    gate_w: np.ndarray | None = None
    gate_b: np.ndarray | None = None
    q_norm_w: np.ndarray | None = None  # [head_dim] per head, or [heads * head_dim] (ArchSpec.qk_norm)
    k_norm_w: np.ndarray | None = None
    # norms of a branch's output before it joins the residual (Gemma 2/3 sandwich, OLMo 2)
    post_attn_norm_w: np.ndarray | None = None
    post_mlp_norm_w: np.ndarray | None = None


@dataclass
class ArchSpec:
    """Shapes and switches that decide the graph's structure."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm: str  # "rms" | "layer"
    norm_eps: float
    activation: str  # "silu" | "gelu" | "gelu_tanh" | "relu"
    gated_mlp: bool
    positions: str  # "rope" | "learned"
    rotary_dim: int = 0
    parallel_residual: bool = False
    embedding_scale: float | None = None
    attention_scale: float | None = None  # None -> 1/sqrt(head_dim)
    max_positions: int = 2048
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    qk_norm: str = "head"  # "head": q/k norm per head over head_dim (Qwen3, Gemma 3); "full": over
    #                        the whole projection before the head split (OLMo 2)
    attn_softcap: float | None = None  # scores = tanh(scores / c) * c before the mask (Gemma 2)
    final_softcap: float | None = None  # logits = tanh(logits / c) * c (Gemma 2/3)
    residual_multiplier: float | None = None  # branch outputs scaled before the residual add (Granite)
    logit_multiplier: float | None = None  # logits scaled (Granite: 1 / logits_scaling)
    # Per-layer sliding windows applied *inside the graph* (layers that differ: Gemma 2/3). None:
    # no per-layer windows; a window shared by every layer is ``sliding_window``, which the runtime's
    # masks apply. The two are never both set.
    layer_windows: list[int | None] | None = None
    # Per-layer rotary table: "default" (ModelWeights.rope_cos/sin), a key of ModelWeights.extra_rope,
    # or None for a layer without rotary (SmolLM3's NoPE layers). None: every layer uses "default".
    layer_rope: list[str | None] | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None


class LazyLayers(Sequence):
    """The decoder layers' weights, converted from the torch model when asked for, one at a time.

    Nothing is cached: the graph builder reads each layer once, writes it and drops it, so at most
    one layer exists as numpy arrays at a time, whatever the model's size.
    """

    def __init__(self, count: int, make: Callable[[int], LayerWeights]) -> None:
        self._count, self._make = count, make

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._make(j) for j in range(*i.indices(self._count))]
        if not -self._count <= i < self._count:
            raise IndexError(i)
        return self._make(i % self._count)


class VocabMatrix:
    """A vocabulary-sized torch weight ``[V, hidden]`` (an embedding table, or an LM head's
    ``nn.Linear`` weight), converted to float32 numpy in slices, never whole: at Gemma's 256k x
    2304 a float32 copy alone is 2.4 GB.

    ``rows(v0, v1)``: embedding layout ``[v1 - v0, hidden]``; ``columns_t(h0, h1)``: MatMul layout
    ``[h1 - h0, V]`` (rows ``h0..h1`` of the transposed weight).
    """

    def __init__(self, weight) -> None:
        self.weight = weight

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def rows(self, v0: int, v1: int) -> np.ndarray:
        return _np(self.weight[v0:v1])

    def columns_t(self, h0: int, h1: int) -> np.ndarray:
        return _t(self.weight[:, h0:h1])

    def embedding(self) -> np.ndarray:
        return self.rows(0, self.shape[0])

    def matmul(self) -> np.ndarray:
        return self.columns_t(0, self.shape[1])


@dataclass
class ModelWeights:
    """Canonical weights. The decoder layers may be lazy (``LazyLayers``); the embedding and LM
    head may be :class:`VocabMatrix` (the embedding as its table, the LM head as its ``[V, hidden]``
    Linear weight; ``lm_head_matrix()`` is the ``[hidden, V]`` MatMul matrix)."""

    embed: np.ndarray | VocabMatrix  # [V, hidden]
    lm_head: np.ndarray | VocabMatrix  # ndarray: [hidden, V]; VocabMatrix: the [V, hidden] weight
    lm_head_b: np.ndarray | None
    final_norm_w: np.ndarray
    final_norm_b: np.ndarray | None
    layers: Sequence[LayerWeights]
    positions: np.ndarray | None = None  # learned position table [max, hidden]
    rope_cos: np.ndarray | None = None  # [max, rotary_dim/2]
    rope_sin: np.ndarray | None = None
    extra_rope: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # name -> (cos, sin)
    # lm_head is exactly embed transposed (one tensor in the checkpoint): the graph may store it once
    tied: bool = False

    def embed_matrix(self) -> np.ndarray:
        return self.embed.embedding() if isinstance(self.embed, VocabMatrix) else self.embed

    def lm_head_matrix(self) -> np.ndarray:
        return self.lm_head.matmul() if isinstance(self.lm_head, VocabMatrix) else self.lm_head


def _np(t) -> np.ndarray | None:
    """A torch tensor as a float32 numpy array that owns its memory (bf16/fp16 upcast exactly)."""
    import torch

    if t is None:
        return None
    t = t.detach().to("cpu")
    if t.dtype == torch.float32:
        return t.numpy().copy()
    return t.float().numpy()  # .float() made a new tensor; the array keeps it alive


def _t(t) -> np.ndarray:
    """A 2-D torch tensor transposed, as a contiguous float32 array, in one conversion pass."""
    import torch

    t = t.detach().to("cpu")
    out = torch.empty((t.shape[1], t.shape[0]), dtype=torch.float32)
    out.copy_(t.t())
    return out.numpy()


def _lin(linear) -> tuple[np.ndarray, np.ndarray | None]:
    """nn.Linear weight [out, in] -> MatMul layout [in, out]."""
    return _t(linear.weight), _np(getattr(linear, "bias", None))


def _layernorm_layer(layer, q, k, v, o, up, down) -> LayerWeights:
    """A layer with biased LayerNorms (``input_layernorm``, ``post_attention_layernorm``) and a
    plain MLP; ``q`` ... ``down`` are (weight, bias) pairs in MatMul layout (StarCoder2, GPT-NeoX)."""
    (q_w, q_b), (k_w, k_b), (v_w, v_b), (o_w, o_b), (up_w, up_b), (down_w, down_b) = q, k, v, o, up, down
    return LayerWeights(
        ln1_w=_np(layer.input_layernorm.weight), ln1_b=_np(layer.input_layernorm.bias),
        q_w=q_w, k_w=k_w, v_w=v_w, q_b=q_b, k_b=k_b, v_b=v_b, o_w=o_w, o_b=o_b,
        ln2_w=_np(layer.post_attention_layernorm.weight),
        ln2_b=_np(layer.post_attention_layernorm.bias),
        up_w=up_w, up_b=up_b, down_w=down_w, down_b=down_b,
    )


def _same_tensor(a, b) -> bool:
    """Two parameters share storage (tied embeddings)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def _rope_tables(model, rotary_dim: int, max_positions: int,
                 layer_type: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables from the model's own rotary module, so every rope scaling type is honoured.

    ``layer_type``: the table of one layer type, for rotary modules that keep one per type
    (Gemma 3: a local base for sliding layers, the global base and scaling for full layers).
    """
    import torch

    rotary = None
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and (layer_type is not None or hasattr(module, "inv_freq")):
            rotary = module
            break
    if rotary is None:
        raise UnsupportedArchitectureError("could not find the model's rotary embedding module")
    positions = torch.arange(max_positions, dtype=torch.int64)[None, :]
    dummy = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(dummy, positions) if layer_type is None else rotary(dummy, positions, layer_type)
    cos = cos[0].float().numpy()
    sin = sin[0].float().numpy()
    half = rotary_dim // 2
    if cos.shape[-1] != rotary_dim:
        raise UnsupportedArchitectureError(
            f"rotary table width {cos.shape[-1]} does not match rotary dim {rotary_dim}"
        )
    return cos[:, :half].copy(), sin[:, :half].copy()


def _rope_parameter_sets(cfg) -> dict[str | None, dict]:
    """The rope parameters, per layer type where the config nests them (Gemma 3), else under None."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(params, dict):
        return {None: {}}
    if params and set(params) <= set(LAYER_TYPES) and all(isinstance(v, dict) or v is None for v in params.values()):
        return {k: (v or {}) for k, v in params.items()}
    return {None: params}


def _check_rope_types(cfg, family: str) -> None:
    for layer_type, params in _rope_parameter_sets(cfg).items():
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            where = "rope_parameters" + (f"['{layer_type}']" if layer_type else "")
            raise UnsupportedArchitectureError(
                f"{family}: rope type '{rope_type}' ({where}.rope_type) is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )


def _layer_types(cfg, family: str) -> list[str] | None:
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return None
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise UnsupportedArchitectureError(
            f"{family}: layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}"
        )
    if len(types) != cfg.num_hidden_layers:
        raise UnsupportedArchitectureError(
            f"{family}: layer_types has {len(types)} entries for {cfg.num_hidden_layers} layers"
        )
    return list(types)


def _windows(per_layer: list[int | None], max_positions: int) -> tuple[int | None, list[int | None] | None]:
    """(window the runtime applies, per-layer windows the graph applies): one of them, or neither.

    A window that every layer shares is the runtime's (as for Mistral); layers that differ get
    their windows inside the graph. A window no shorter than the context never applies.
    """
    per_layer = [w if w is not None and w < max_positions else None for w in per_layer]
    if all(w is None for w in per_layer):
        return None, None
    if len(set(per_layer)) == 1:
        return per_layer[0], None
    return None, per_layer


def _partial_rotary_factor(cfg) -> float:
    """Fraction of head_dim that is rotated: config attribute (transformers 4.x, Phi-3) or
    ``rope_parameters`` / ``rope_scaling`` (transformers 5.x), or GPT-NeoX's legacy ``rotary_pct``."""
    for value in (getattr(cfg, "partial_rotary_factor", None), getattr(cfg, "rotary_pct", None)):
        if value is not None:
            return float(value)
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, attr, None)
        if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
            return float(params["partial_rotary_factor"])
    return 1.0


def _special_tokens(config) -> tuple[list[int], int | None, int | None]:
    eos = getattr(config, "eos_token_id", None)
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return eos_ids, getattr(config, "bos_token_id", None), getattr(config, "pad_token_id", None)


def _act_name(hf_act: str) -> str:
    table = {
        "silu": "silu",
        "swish": "silu",
        "gelu": "gelu",
        "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh",
        "gelu_fast": "gelu_tanh",
        "relu": "relu",
    }
    if hf_act not in table:
        raise UnsupportedArchitectureError(f"activation '{hf_act}' is not supported")
    return table[hf_act]


def _module_activation(module, declared: str) -> str:
    """The activation a model's MLP really applies, probed numerically.

    Config fields disagree across transformers versions (Gemma's ``hidden_act`` vs
    ``hidden_activation``, legacy ``"gelu"`` meaning the tanh approximation), so the module that
    runs is the authority; the config's name is only the fallback when the probe is inconclusive.
    """
    import torch

    act_fn = getattr(module, "act_fn", None) or getattr(module, "act", None)
    if not callable(act_fn):
        return _act_name(declared)
    x = torch.linspace(-6.0, 6.0, 241, dtype=torch.float32)
    with torch.no_grad():
        try:
            y = act_fn(x).float()
        except Exception:  # noqa: BLE001 - an exotic activation module: trust the config
            return _act_name(declared)
    candidates = {
        "silu": torch.nn.functional.silu(x),
        "gelu": torch.nn.functional.gelu(x),
        "gelu_tanh": torch.nn.functional.gelu(x, approximate="tanh"),
        "relu": torch.relu(x),
    }
    for name, ref in candidates.items():
        if float((y - ref).abs().max()) < 1e-5:
            return name
    return _act_name(declared)


def _longrope_context(cfg, max_positions: int) -> int:
    """Cap the context of a long/short-switching rope (Phi-3 ``longrope``) at the switch point.

    transformers uses the *short* factors while the whole sequence fits in
    ``original_max_position_embeddings`` and the *long* factors for every position once it does
    not, discarding and recomputing the KV cache at the switch. A graph with one static cos/sin
    table and a reusable KV cache can only be exact on one side of that switch: the short side,
    which is what every sequence up to the switch sees.
    """
    sets = [p for p in _rope_parameter_sets(cfg).values() if (p.get("rope_type") or p.get("type")) == "longrope"]
    if not sets:
        return max_positions
    originals = [p.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
                 for p in sets]
    original = min((int(o) for o in originals if o), default=None)
    if original and max_positions > int(original):
        import warnings

        warnings.warn(
            f"longrope: max context capped from {max_positions} to {int(original)} "
            "(original_max_position_embeddings); beyond it transformers switches to the long rope "
            "factors and recomputes the KV cache, which a static rotary table cannot reproduce",
            stacklevel=2,
        )
        return int(original)
    return max_positions


# ---------------------------------------------------------------------------------------------
# Llama-like families (Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3, Granite, Phi-3, SmolLM3, OLMo 2)
# ---------------------------------------------------------------------------------------------

_GEMMA = ("gemma", "gemma2", "gemma3_text")


def _refuse(family: str, field_name: str, value, why: str) -> None:
    raise UnsupportedArchitectureError(f"{family}: {field_name}={value!r} is not supported ({why})")


def _family_switches(cfg, family: str, max_positions: int) -> dict:
    """Per-family ArchSpec switches beyond the Llama skeleton, refusing what has no implementation."""
    sw: dict = {}
    layers = cfg.num_hidden_layers
    if family in ("gemma2", "gemma3_text"):
        if getattr(cfg, "use_bidirectional_attention", False):
            _refuse(family, "use_bidirectional_attention", cfg.use_bidirectional_attention,
                    "the graph is causal")
        sw["attention_scale"] = float(cfg.query_pre_attn_scalar) ** -0.5
        if family == "gemma2":
            sw["attn_softcap"] = getattr(cfg, "attn_logit_softcapping", None)
        elif getattr(cfg, "attn_logit_softcapping", None) is not None:
            # transformers' Gemma 3 attention never passes it to the attention function
            _refuse(family, "attn_logit_softcapping", cfg.attn_logit_softcapping,
                    "transformers' Gemma 3 attention ignores it, so no reference output exists")
        sw["final_softcap"] = getattr(cfg, "final_logit_softcapping", None)
    if family == "granite":
        sw["attention_scale"] = float(cfg.attention_multiplier)
        sw["embedding_scale"] = float(cfg.embedding_multiplier)
        sw["residual_multiplier"] = float(cfg.residual_multiplier)
        sw["logit_multiplier"] = 1.0 / float(cfg.logits_scaling)
    types = _layer_types(cfg, family) if family in ("gemma2", "gemma3_text", "smollm3") else None
    if types is not None:
        window = getattr(cfg, "sliding_window", None)
        if family == "smollm3" and "sliding_attention" in types and not getattr(cfg, "use_sliding_window", False):
            # the eager/sdpa masks would slide while flash attention would not: no single reference
            _refuse(family, "use_sliding_window", False, "layer_types has sliding_attention layers")
        per_layer = [window if t == "sliding_attention" else None for t in types]
        sw["sliding_window"], sw["layer_windows"] = _windows(per_layer, max_positions)
    if family == "gemma3_text":
        sets = _rope_parameter_sets(cfg)
        sw["layer_rope"] = ["default" if t == "full_attention" else t for t in types]
        if None in sets:  # pragma: no cover - transformers always nests Gemma 3's parameters
            _refuse(family, "rope_parameters", "flat", "expected one entry per layer type")
    if family == "smollm3":
        flags = list(cfg.no_rope_layers)  # 1: the layer uses rotary, 0: NoPE
        if len(flags) != layers:
            _refuse(family, "no_rope_layers", flags, f"expected {layers} entries")
        sw["layer_rope"] = ["default" if f else None for f in flags]
    return {k: v for k, v in sw.items() if v is not None}


def _llama_like(model, family: str, max_positions: int) -> tuple[ArchSpec, ModelWeights]:
    cfg = model.config
    inner = model.model
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rotary_dim = int(head_dim * _partial_rotary_factor(cfg))
    _check_rope_types(cfg, family)
    act = getattr(cfg, "hidden_activation", None) or cfg.hidden_act
    if family == "gemma":
        act = "gelu_pytorch_tanh" if act in ("gelu", "gelu_pytorch_tanh") else act
    act = _module_activation(inner.layers[0].mlp, act)
    max_positions = _longrope_context(cfg, max_positions)
    eos, bos, pad = _special_tokens(cfg)
    sliding = getattr(cfg, "sliding_window", None) if family in ("mistral", "qwen2", "qwen3", "phi3") else None
    if family in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
        sliding = None
    switches = _family_switches(cfg, family, max_positions)
    first_attn = inner.layers[0].self_attn
    qk_norm = "head"
    if hasattr(first_attn, "q_norm") and first_attn.q_norm.weight.numel() == heads * head_dim != head_dim:
        qk_norm = "full"
    spec = ArchSpec(
        family=family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm="rms",
        norm_eps=float(cfg.rms_norm_eps),
        activation=act,
        gated_mlp=True,
        positions="rope",
        rotary_dim=rotary_dim,
        embedding_scale=float(cfg.hidden_size) ** 0.5 if family in _GEMMA else None,
        max_positions=max_positions,
        sliding_window=sliding,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=qk_norm,
        eos_token_ids=eos,
        bos_token_id=bos,
        pad_token_id=pad,
    )
    for key, value in switches.items():
        setattr(spec, key, value)
    gemma_offset = 1.0 if family in _GEMMA else 0.0

    def norm_w(module) -> np.ndarray | None:
        return None if module is None else _np(module.weight) + gemma_offset

    def one_layer(i: int) -> LayerWeights:
        layer = inner.layers[i]
        attn = layer.self_attn
        mlp = layer.mlp
        if family == "phi3":
            qkv_w, qkv_b = _lin(attn.qkv_proj)
            q_size, kv_size = heads * head_dim, kv_heads * head_dim
            q_w, k_w, v_w = np.split(qkv_w, [q_size, q_size + kv_size], axis=1)
            q_b = k_b = v_b = None
            gu_w, _ = _lin(mlp.gate_up_proj)
            gate_w, up_w = np.split(gu_w, 2, axis=1)
            gate_b = up_b = None
        else:
            q_w, q_b = _lin(attn.q_proj)
            k_w, k_b = _lin(attn.k_proj)
            v_w, v_b = _lin(attn.v_proj)
            gate_w, gate_b = _lin(mlp.gate_proj)
            up_w, up_b = _lin(mlp.up_proj)
        o_w, o_b = _lin(attn.o_proj)
        down_w, down_b = _lin(mlp.down_proj)
        if family in ("gemma2", "gemma3_text"):  # sandwich: pre and post norm around each branch
            ln1, post_attn = layer.input_layernorm, layer.post_attention_layernorm
            ln2, post_mlp = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
        elif family == "olmo2":  # post-norm only: h = h + norm(attn(h)); h = h + norm(mlp(h))
            ln1, post_attn = None, layer.post_attention_layernorm
            ln2, post_mlp = None, layer.post_feedforward_layernorm
        else:
            ln1, post_attn = layer.input_layernorm, None
            ln2, post_mlp = layer.post_attention_layernorm, None
        return LayerWeights(
            ln1_w=norm_w(ln1),
            ln1_b=None,
            q_w=q_w, k_w=k_w, v_w=v_w,
            q_b=q_b, k_b=k_b, v_b=v_b,
            o_w=o_w, o_b=o_b,
            ln2_w=norm_w(ln2),
            ln2_b=None,
            up_w=up_w, up_b=up_b, down_w=down_w, down_b=down_b,
            gate_w=gate_w, gate_b=gate_b,
            q_norm_w=norm_w(attn.q_norm) if hasattr(attn, "q_norm") else None,
            k_norm_w=norm_w(attn.k_norm) if hasattr(attn, "k_norm") else None,
            post_attn_norm_w=norm_w(post_attn),
            post_mlp_norm_w=norm_w(post_mlp),
        )

    layers = LazyLayers(len(inner.layers), one_layer)
    extra_rope = {}
    if family == "gemma3_text":  # full layers: global base (+ scaling); sliding layers: local base
        cos, sin = _rope_tables(model, rotary_dim, max_positions, layer_type="full_attention")
        if "sliding_attention" in spec.layer_rope:
            extra_rope["sliding_attention"] = _rope_tables(model, rotary_dim, max_positions,
                                                           layer_type="sliding_attention")
    else:
        cos, sin = _rope_tables(model, rotary_dim, max_positions)
    weights = ModelWeights(
        embed=VocabMatrix(inner.embed_tokens.weight), lm_head=VocabMatrix(model.lm_head.weight),
        lm_head_b=_np(getattr(model.lm_head, "bias", None)),
        final_norm_w=norm_w(inner.norm), final_norm_b=None,
        layers=layers, rope_cos=cos, rope_sin=sin, extra_rope=extra_rope,
        tied=_same_tensor(model.lm_head.weight, inner.embed_tokens.weight),
    )
    return spec, weights


# ---------------------------------------------------------------------------------------------
# StarCoder2 (LayerNorm with bias, plain MLP with biases, biased q/k/v/o, one sliding window)
# ---------------------------------------------------------------------------------------------


def _starcoder2(model, family: str, max_positions: int) -> tuple[ArchSpec, ModelWeights]:
    cfg = model.config
    inner = model.model
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rotary_dim = int(head_dim * _partial_rotary_factor(cfg))
    _check_rope_types(cfg, family)
    max_positions = _longrope_context(cfg, max_positions)
    eos, bos, pad = _special_tokens(cfg)
    window = getattr(cfg, "sliding_window", None)  # every layer: the runtime's masks apply it
    spec = ArchSpec(
        family=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        norm="layer", norm_eps=float(cfg.norm_epsilon),
        activation=_module_activation(inner.layers[0].mlp, cfg.hidden_act),
        gated_mlp=False, positions="rope", rotary_dim=rotary_dim, max_positions=max_positions,
        sliding_window=window, tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        eos_token_ids=eos, bos_token_id=bos, pad_token_id=pad,
    )
    def one_layer(i: int) -> LayerWeights:
        layer = inner.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        return _layernorm_layer(layer, _lin(attn.q_proj), _lin(attn.k_proj), _lin(attn.v_proj),
                                _lin(attn.o_proj), _lin(mlp.c_fc), _lin(mlp.c_proj))

    cos, sin = _rope_tables(model, rotary_dim, max_positions)
    weights = ModelWeights(
        embed=VocabMatrix(inner.embed_tokens.weight), lm_head=VocabMatrix(model.lm_head.weight),
        lm_head_b=_np(getattr(model.lm_head, "bias", None)),
        final_norm_w=_np(inner.norm.weight), final_norm_b=_np(inner.norm.bias),
        layers=LazyLayers(len(inner.layers), one_layer), rope_cos=cos, rope_sin=sin,
        tied=_same_tensor(model.lm_head.weight, inner.embed_tokens.weight),
    )
    return spec, weights


# ---------------------------------------------------------------------------------------------
# GPT-2 (learned positions, Conv1D, LayerNorm with bias)
# ---------------------------------------------------------------------------------------------


def _gpt2(model, family: str, max_positions: int) -> tuple[ArchSpec, ModelWeights]:
    cfg = model.config
    tr = model.transformer
    hidden, heads = cfg.n_embd, cfg.n_head
    head_dim = hidden // heads
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False):
        raise UnsupportedArchitectureError("gpt2 with scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn")
    eos, bos, pad = _special_tokens(cfg)
    max_positions = min(max_positions, cfg.n_positions)
    spec = ArchSpec(
        family=family, vocab_size=cfg.vocab_size, hidden_size=hidden, num_layers=cfg.n_layer,
        num_heads=heads, num_kv_heads=heads, head_dim=head_dim, norm="layer",
        norm_eps=float(cfg.layer_norm_epsilon), activation=_module_activation(tr.h[0].mlp, cfg.activation_function),
        gated_mlp=False, positions="learned", max_positions=max_positions,
        attention_scale=None if cfg.scale_attn_weights else 1.0,
        tie_word_embeddings=True, eos_token_ids=eos, bos_token_id=bos, pad_token_id=pad,
    )
    def one_layer(i: int) -> LayerWeights:
        block = tr.h[i]
        # Conv1D stores [in, out] already
        qkv_w, qkv_b = _np(block.attn.c_attn.weight), _np(block.attn.c_attn.bias)
        q_w, k_w, v_w = np.split(qkv_w, 3, axis=1)
        q_b, k_b, v_b = np.split(qkv_b, 3)
        return LayerWeights(
            ln1_w=_np(block.ln_1.weight), ln1_b=_np(block.ln_1.bias),
            q_w=q_w.copy(), k_w=k_w.copy(), v_w=v_w.copy(),
            q_b=q_b.copy(), k_b=k_b.copy(), v_b=v_b.copy(),
            o_w=_np(block.attn.c_proj.weight), o_b=_np(block.attn.c_proj.bias),
            ln2_w=_np(block.ln_2.weight), ln2_b=_np(block.ln_2.bias),
            up_w=_np(block.mlp.c_fc.weight), up_b=_np(block.mlp.c_fc.bias),
            down_w=_np(block.mlp.c_proj.weight), down_b=_np(block.mlp.c_proj.bias),
        )

    weights = ModelWeights(
        embed=VocabMatrix(tr.wte.weight), lm_head=VocabMatrix(model.lm_head.weight),
        lm_head_b=_np(getattr(model.lm_head, "bias", None)),
        final_norm_w=_np(tr.ln_f.weight), final_norm_b=_np(tr.ln_f.bias),
        layers=LazyLayers(len(tr.h), one_layer), positions=_np(tr.wpe.weight)[:max_positions].copy(),
        tied=_same_tensor(model.lm_head.weight, tr.wte.weight),
    )
    return spec, weights


# ---------------------------------------------------------------------------------------------
# GPT-NeoX (parallel residual, partial rotary, per-head interleaved fused qkv)
# ---------------------------------------------------------------------------------------------


def _gpt_neox(model, family: str, max_positions: int) -> tuple[ArchSpec, ModelWeights]:
    cfg = model.config
    inner = model.gpt_neox
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    head_dim = hidden // heads
    rotary_dim = int(head_dim * _partial_rotary_factor(cfg))
    eos, bos, pad = _special_tokens(cfg)
    spec = ArchSpec(
        family=family, vocab_size=cfg.vocab_size, hidden_size=hidden,
        num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
        norm="layer", norm_eps=float(cfg.layer_norm_eps), activation=_module_activation(inner.layers[0].mlp, cfg.hidden_act),
        gated_mlp=False, positions="rope", rotary_dim=rotary_dim,
        parallel_residual=bool(cfg.use_parallel_residual), max_positions=max_positions,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        eos_token_ids=eos, bos_token_id=bos, pad_token_id=pad,
    )
    def one_layer(i: int) -> LayerWeights:
        layer = inner.layers[i]
        att = layer.attention
        w = _np(att.query_key_value.weight)  # [3*hidden, hidden], rows per head: q, k, v
        b = _np(att.query_key_value.bias)  # None when attention_bias=False
        w = w.reshape(heads, 3, head_dim, hidden)
        q_w, k_w, v_w = (w[:, i].reshape(heads * head_dim, hidden).T.copy() for i in range(3))
        q_b = k_b = v_b = None
        if b is not None:
            b = b.reshape(heads, 3, head_dim)
            q_b, k_b, v_b = (b[:, i].reshape(-1).copy() for i in range(3))
        return _layernorm_layer(layer, (q_w, q_b), (k_w, k_b), (v_w, v_b), _lin(att.dense),
                                _lin(layer.mlp.dense_h_to_4h), _lin(layer.mlp.dense_4h_to_h))

    # transformers 4.x calls the output projection embed_out, 5.x lm_head
    lm_head = model.embed_out if hasattr(model, "embed_out") else model.lm_head
    cos, sin = _rope_tables(model, rotary_dim, max_positions)
    weights = ModelWeights(
        embed=VocabMatrix(inner.embed_in.weight), lm_head=VocabMatrix(lm_head.weight),
        lm_head_b=_np(getattr(lm_head, "bias", None)),
        final_norm_w=_np(inner.final_layer_norm.weight), final_norm_b=_np(inner.final_layer_norm.bias),
        layers=LazyLayers(len(inner.layers), one_layer), rope_cos=cos, rope_sin=sin,
        tied=_same_tensor(lm_head.weight, inner.embed_in.weight),
    )
    return spec, weights


EXTRACTORS: dict[str, Callable] = {
    "llama": _llama_like,
    "mistral": _llama_like,
    "qwen2": _llama_like,
    "qwen3": _llama_like,
    "gemma": _llama_like,
    "gemma2": _llama_like,
    "gemma3_text": _llama_like,
    "granite": _llama_like,
    "phi3": _llama_like,
    "smollm3": _llama_like,
    "olmo2": _llama_like,
    "starcoder2": _starcoder2,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
}


def extract(model, max_positions: int) -> tuple[ArchSpec, ModelWeights]:
    """Read a loaded transformers causal LM into the canonical form."""
    family = getattr(model.config, "model_type", None)
    if family not in EXTRACTORS:
        raise UnsupportedArchitectureError(
            f"architecture '{family}' is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    cfg_max = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if cfg_max:
        max_positions = min(max_positions, int(cfg_max))
    return EXTRACTORS[family](model, family, max_positions)
