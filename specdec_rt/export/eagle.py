"""EAGLE-3 feature heads in PyTorch: the reference definition that training, ONNX export and
validation share.

A head drafts from the target's own hidden states instead of running a second language model:
one decoder layer whose attention reads ``[norm(embed(token)), norm(hidden)]`` (2H wide), where
``hidden`` is the target's fused features (``fc`` over the residual streams after three of its
layers) at a verified position, or the head's own output at a drafted one. Its LM head covers a
reduced vocabulary (``d2t``: draft id -> target id offset, as EAGLE-3 publishes it).

Row convention (shared by training, the ONNX graph and the runtime): the head's row at position
``i`` pairs the target's feature of position ``i`` with the token at ``i + 1`` and predicts the
token at ``i + 2``; its K/V live at position ``i`` of the head's own cache, its rotary position
is ``i``.

The layout and the weight names are the published EAGLE-3 ones (``fc``, ``midlayer.*`` or
``layers.0.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; config.json with ``draft_vocab_size``,
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``), so a head trained
elsewhere loads here, and a head saved here loads there.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec_rt.errors import ExportError

HEAD_CONFIG = "config.json"
HEAD_WEIGHTS = "model.safetensors"


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose outputs a head fuses when its config does not say: vLLM's and
    SpecForge's choice (low, middle, high), as 0-based indices of the layer whose *output*
    (the residual stream after it) is taken."""
    picks = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(min(max(p, 0), num_layers - 1) for p in picks)  # type: ignore[return-value]


@dataclass
class EagleConfig:
    """Shapes of one head and the target it reads (``vocab_size``, ``target_hidden_size``,
    ``feature_layers``: 0-based layers whose outputs are fused, low to high)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    # the layer's residual is the normed hidden input (``hidden_norm(hidden)``), not the input:
    # Red Hat's speculators heads (and vLLM's ``norm_before_residual``); EAGLE's own heads: False
    norm_before_residual: bool = False
    # Llama 3.1's frequency-dependent rope scaling (``{"factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}``), which speculators heads copy
    # from their Llama-3.1 verifier; None: plain rope
    rope_scaling: dict | None = None

    def to_json(self) -> dict:
        """config.json in the published EAGLE-3 form; ``eagle_aux_hidden_state_layer_ids`` there
        names the layer whose *input* is taken (vLLM's reading), i.e. ours + 1."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.feature_layers]},
            **({"norm_before_residual": True} if self.norm_before_residual else {}),
            **({"rope_scaling": {"rope_type": "llama3", **self.rope_scaling}} if self.rope_scaling else {}),
        }

    @classmethod
    def from_json(cls, d: dict, target_layers: int | None = None) -> "EagleConfig":
        """Read a published (or our) config.json; ``target_layers`` gives the default feature
        layers when the file names none. Two layouts: EAGLE's (the decoder layer's fields at the
        top level) and Red Hat's speculators (them in ``transformer_layer_config``, the head's
        own fields beside it; ``norm_before_residual`` then defaults to true, as vLLM reads it)."""
        nested = isinstance(d.get("transformer_layer_config"), dict)
        layer = {**d["transformer_layer_config"], **{k: d[k] for k in HEAD_FIELDS if k in d}} if nested else d
        for switch in ("norm_before_fc", "fc_norm", "norm_output"):
            if layer.get(switch):
                raise ExportError(f"this EAGLE-3 head sets {switch} (an extra normalization of its inputs or "
                                  "outputs), which is not supported: heads with norm_before_residual either way are")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ExportError(f"EAGLE-3 heads with {layer.get('num_hidden_layers')} decoder layers are not supported "
                              "(one layer, as published)")
        if layer.get("hidden_act", "silu") != "silu":
            raise ExportError(f"head activation {layer.get('hidden_act')!r} is not supported (silu)")
        scaling = None
        for key in ("rope_scaling", "rope_parameters"):  # transformers 4.x / 5.x names
            rope = layer.get(key) or {}
            kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
            if kind == "llama3":
                missing = [k for k in LLAMA3_ROPE_KEYS if k not in rope]
                if missing:
                    raise ExportError(f"the head's llama3 {key} lacks {', '.join(missing)}")
                scaling = {k: float(rope[k]) for k in LLAMA3_ROPE_KEYS}
            elif kind != "default":
                raise ExportError(f"head {key} {rope!r} is not supported (default or llama3 rope)")
        try:
            hidden = int(layer["hidden_size"])
            heads = int(layer["num_attention_heads"])
            ids = layer.get("eagle_aux_hidden_state_layer_ids") or (layer.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids")
            if ids:
                layers = tuple(int(i) - 1 for i in ids)
            elif target_layers is not None:
                layers = default_feature_layers(target_layers)
            else:
                raise ExportError("the head's config.json names no feature layers "
                                  "(eagle_config.eagle_aux_hidden_state_layer_ids) and no target is given")
            return cls(
                hidden_size=hidden,
                intermediate_size=int(layer["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(layer.get("num_key_value_heads", heads)),
                head_dim=int(layer.get("head_dim") or hidden // heads),
                vocab_size=int(layer["vocab_size"]),
                draft_vocab_size=int(layer.get("draft_vocab_size") or layer["vocab_size"]),
                target_hidden_size=int(layer.get("target_hidden_size") or hidden),
                feature_layers=layers,
                rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                rope_theta=float(layer.get("rope_theta",
                                           (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
                norm_before_residual=bool(layer.get("norm_before_residual", nested)),
                rope_scaling=scaling,
            )
        except KeyError as exc:
            raise ExportError(f"the head's config.json lacks {exc.args[0]!r}") from None


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# the head's own fields of a speculators config.json (the decoder layer's are nested)
HEAD_FIELDS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "eagle_config",
               "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """Rotary frequencies; with ``scaling`` Llama 3.1's: wavelengths beyond the original context
    / low_freq_factor are stretched by ``factor``, those below it / high_freq_factor kept, and
    the band between blended smoothly (Meta's reference, transformers' "llama3")."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if not scaling:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    stretched = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    between = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(between, blended, stretched)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[..., head_dim]`` for integer ``positions`` (rotate-half layout, as Llama)."""
    inv = rope_inv_freq(head_dim, theta, scaling, positions.device)
    freqs = positions.to(torch.float32)[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class EagleLayer(nn.Module):
    """The head's decoder layer (``midlayer``): attention over ``[norm(emb), norm(hidden)]``."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        attn.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        attn.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        attn.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.mlp = mlp

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Rotated q ``[B, nh, S, d]`` and k, v ``[B, nkv, S, d]`` of rows ``[B, S]``."""
        cfg = self.cfg
        b, s, _ = hidden.shape
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        a = self.self_attn
        q = a.q_proj(x).view(b, s, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = cos[:, None], sin[:, None]
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def residual(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the attention output is added to: the hidden input, or (``norm_before_residual``)
        its normed form."""
        return self.hidden_norm(hidden) if self.cfg.norm_before_residual else hidden

    def finish(self, hidden: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """The layer's output rows: attention of ``q`` over ``keys``/``values`` ([B, nkv, T, d])
        under the additive ``mask`` ([B or 1, 1, S, T]), then the residual and the MLP."""
        cfg = self.cfg
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        scores = q @ keys.transpose(-1, -2) / (cfg.head_dim ** 0.5) + mask
        attn = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ values
        b, _, s, _ = attn.shape
        attn = self.self_attn.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        x = self.residual(hidden) + attn
        m = self.mlp
        y = self.post_attention_layernorm(x)
        return x + m.down_proj(nn.functional.silu(m.gate_proj(y)) * m.up_proj(y))


class EagleHead(nn.Module):
    """fc + one :class:`EagleLayer` + norm + reduced LM head; ``embed`` is the target's table
    (frozen, not saved unless the head brings its own)."""

    def __init__(self, cfg: EagleConfig, embed: torch.Tensor) -> None:
        super().__init__()
        if embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ExportError(f"the head needs a [{cfg.vocab_size}, {cfg.hidden_size}] token embedding "
                              f"(the target's), got {list(embed.shape)}")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(embed.float(), freeze=True)
        self.fc = nn.Linear(len(cfg.feature_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = EagleLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft-vocabulary slot."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the layer's output rows."""
        return self.lm_head(self.norm(hidden_out))

    def target_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary: -inf outside the draft vocabulary."""
        small = self.logits(hidden_out)
        full = torch.full((*small.shape[:-1], self.cfg.vocab_size), float("-inf"), dtype=small.dtype,
                          device=small.device)
        full[..., self.draft_ids()] = small
        return full

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             past: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None):
        """One call as the ONNX graph makes it: rows ``[B, S]`` of tokens and H-wide hidden
        (``fc(features)`` or a previous ``hidden_out``) against ``past`` K/V ([B, nkv, P, d]).
        Returns (target-vocabulary logits, hidden_out, (k, v) of the new rows). ``mask``: additive
        [B, 1, S, P + S], causal by default."""
        layer = self.midlayer
        emb = self.embed_tokens(input_ids)
        q, k, v = layer.qkv(emb, hidden, positions)
        keys = k if past is None else torch.cat([past[0], k], dim=2)
        values = v if past is None else torch.cat([past[1], v], dim=2)
        if mask is None:
            s, t = q.shape[2], keys.shape[2]
            mask = torch.full((s, t), float("-inf"), device=q.device).triu(t - s + 1)[None, None]
        out = layer.finish(hidden, q, keys, values, mask)
        return self.target_logits(out), out, (k, v)


def feature_hooks(model, layers: tuple[int, ...]):
    """Register hooks on a Hugging Face causal LM that keep the residual stream after each of
    ``layers``; returns (store list filled per forward, handles to remove)."""
    store: dict[int, torch.Tensor] = {}
    blocks = model.model.layers
    handles = []
    for i in layers:
        def hook(_mod, _inp, out, i=i):
            store[i] = out[0] if isinstance(out, tuple) else out
        handles.append(blocks[i].register_forward_hook(hook))
    return store, handles


def target_features(model, input_ids: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [B, S, len(layers) * H] float32, logits [B, S, V] float32) of one forward of a
    Hugging Face causal LM: the graph's ``features`` output, by definition."""
    store, handles = feature_hooks(model, layers)
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits.float()
    finally:
        for h in handles:
            h.remove()
    return torch.cat([store[i].float() for i in layers], dim=-1), logits


def load_head(folder: str | Path, embed: torch.Tensor, target_layers: int) -> EagleHead:
    """A head folder (config.json + model.safetensors or pytorch_model.bin), published EAGLE-3
    names (``midlayer.*`` or ``layers.0.*``) accepted; ``embed`` is the target's token table,
    used unless the folder brings its own ``embed_tokens.weight``."""
    folder = Path(folder)
    cfg_path = folder / HEAD_CONFIG
    if not cfg_path.is_file():
        raise ExportError(f"'{folder}' is not an EAGLE-3 head folder: {HEAD_CONFIG} is missing")
    try:
        cfg = EagleConfig.from_json(json.loads(cfg_path.read_text()), target_layers)
    except json.JSONDecodeError as exc:
        raise ExportError(f"{cfg_path} is not valid JSON: {exc}") from None
    if (folder / HEAD_WEIGHTS).is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / HEAD_WEIGHTS))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ExportError(f"'{folder}' holds no head weights ({HEAD_WEIGHTS} or pytorch_model.bin)")
    state = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v for k, v in state.items()}
    own = state.pop("embed_tokens.weight", None)
    head = EagleHead(cfg, own if own is not None else embed)
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                for k, v in state.items()}, strict=False)
    missing = [k for k in missing if k not in ("embed_tokens.weight", "t2d")]
    if missing or unexpected:
        raise ExportError(f"head weights in '{folder}' do not match its config: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    return head.eval()


def save_head(head: EagleHead, folder: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write config.json + model.safetensors in the published layout (no embedding table)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
             for k, v in head.state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, str(folder / HEAD_WEIGHTS))
    (folder / HEAD_CONFIG).write_text(json.dumps(head.cfg.to_json(), indent=2) + "\n")


def check_head_matches(cfg: EagleConfig, target_vocab: int, target_hidden: int, target_layers: int) -> None:
    """One clear error when a head was trained for another target."""
    problems = []
    if cfg.vocab_size != target_vocab:
        problems.append(f"vocabulary {cfg.vocab_size} != the target's {target_vocab}")
    if cfg.target_hidden_size != target_hidden:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != the target's hidden size {target_hidden}")
    if cfg.hidden_size != target_hidden:
        problems.append(f"hidden_size {cfg.hidden_size} != the target's embedding width {target_hidden}")
    bad = [i for i in cfg.feature_layers if not 0 <= i < target_layers]
    if bad:
        problems.append(f"feature layers {bad} outside the target's {target_layers} layers")
    if problems:
        raise ExportError("this EAGLE-3 head does not match the target: " + "; ".join(problems))
