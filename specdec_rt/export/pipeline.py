"""Export a target/draft pair of Hugging Face checkpoints into a validated bundle."""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdec_rt.errors import ExportError  # noqa: F401 - defined there, re-exported here
from specdec_rt.export.arch import ArchSpec, UnsupportedArchitectureError, extract
from specdec_rt.export.graph import GraphOptions, build_model, save_model
from specdec_rt.runtime.bundle import (CONTRACT_VERSION, FORMAT_NAME, FORMAT_VERSION, MANIFEST,
                                       sha256_file)

DEFAULT_MAX_CONTEXT = 4096


@dataclass
class ExportOptions:
    dtype: str = "fp32"
    quantize: str | None = None
    quantize_roles: tuple[str, ...] = ("target", "draft")
    opset: int = 17
    max_context: int | None = None
    portable: bool = False
    validate: bool = True
    progress: bool = True

    def check(self) -> None:
        if self.dtype not in ("fp32", "fp16"):
            raise ExportError(f"--dtype must be fp32 or fp16, not '{self.dtype}'")
        if self.quantize not in (None, "int4", "int8"):
            raise ExportError(f"--quantize must be int4 or int8, not '{self.quantize}'")
        if not 14 <= self.opset <= 21:
            raise ExportError(f"--opset {self.opset} is outside the supported range 14..21")
        if self.max_context is not None and self.max_context < 16:
            raise ExportError("--max-context must be at least 16")


@dataclass
class ExportedModel:
    role: str
    spec: ArchSpec
    info: dict
    files: list[str] = field(default_factory=list)


class _Stages:
    """A progress bar over named stages (tqdm when available and wanted)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="stage", desc="export", leave=True)
            except ImportError:  # pragma: no cover - tqdm is in the export extra
                self.bar = None
        self.times: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def start(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(f"export: {name}")
        self._name, self._t0 = name, time.perf_counter()

    def done(self) -> None:
        self.times[self._name] = round(time.perf_counter() - self._t0, 3)
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_description("export: done")
            self.bar.close()


# -- checkpoint inspection -----------------------------------------------------------------------

def check_checkpoint(path: str | os.PathLike) -> Path:
    """Fail early and clearly on a folder that cannot be a causal-LM checkpoint."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"checkpoint folder '{p}' does not exist")
    if not p.is_dir():
        raise ExportError(f"'{p}' is not a folder; pass a Hugging Face checkpoint directory")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ExportError(f"'{p}' has no config.json; is it a Hugging Face checkpoint?")
    try:
        data = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{cfg} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ExportError(f"{cfg} has no 'model_type'; the config is corrupt or not a transformers config")
    from specdec_rt.export.arch import SUPPORTED_FAMILIES

    if data["model_type"] not in SUPPORTED_FAMILIES:
        raise UnsupportedArchitectureError(
            f"{p}: architecture '{data['model_type']}' is not supported; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    weights = list(p.glob("*.safetensors")) + list(p.glob("*.bin"))
    if not weights:
        raise ExportError(f"'{p}' has no weights (*.safetensors or *.bin)")
    return p


def load_tokenizer_json(path: Path):
    """The checkpoint's fast tokenizer as a ``tokenizers.Tokenizer`` (converted if needed)."""
    from tokenizers import Tokenizer

    tj = path / "tokenizer.json"
    if tj.is_file():
        return Tokenizer.from_file(str(tj))
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), use_fast=True)
        return tok.backend_tokenizer
    except Exception as exc:  # noqa: BLE001 - report any conversion failure plainly
        raise ExportError(f"'{path}' has no tokenizer.json and its tokenizer could not be converted: {exc}") from None


def vocab_digest(tokenizer) -> str:
    import hashlib

    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return hashlib.sha256(json.dumps(sorted(vocab.items()), separators=(",", ":")).encode()).hexdigest()


def compare_vocabularies(target_tok, draft_tok) -> None:
    """Refuse a pair whose tokenizers map tokens differently: say what differs."""
    tv = target_tok.get_vocab(with_added_tokens=True)
    dv = draft_tok.get_vocab(with_added_tokens=True)
    if tv == dv:
        return
    only_t = sorted(set(tv) - set(dv))
    only_d = sorted(set(dv) - set(tv))
    moved = sorted(k for k in set(tv) & set(dv) if tv[k] != dv[k])
    parts = [f"target has {len(tv)} tokens, draft has {len(dv)}"]
    if only_t:
        parts.append(f"{len(only_t)} only in target (e.g. {only_t[:3]!r})")
    if only_d:
        parts.append(f"{len(only_d)} only in draft (e.g. {only_d[:3]!r})")
    if moved:
        k = moved[0]
        parts.append(f"{len(moved)} with different ids (e.g. {k!r}: target {tv[k]}, draft {dv[k]})")
    raise ExportError("draft and target vocabularies do not match: " + "; ".join(parts))


SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                            "mask_token")


def _token_string(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # a serialized AddedToken
        return value["content"]
    return None


def read_chat_files(path: Path) -> tuple[str | dict[str, str] | None, dict[str, str]]:
    """Chat template(s) and special-token strings read from the tokenizer's files.

    Same precedence as transformers' ``from_pretrained``: ``chat_template.jinja`` (and
    ``additional_chat_templates/*.jinja``) over ``tokenizer_config.json``'s ``chat_template``,
    which may be a string or a list of ``{"name", "template"}``.
    """
    cfg: dict = {}
    tc = path / "tokenizer_config.json"
    if tc.is_file():
        try:
            cfg = json.loads(tc.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ExportError(f"{tc} is not valid JSON ({exc})") from None
    named: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        named["default"] = (path / "chat_template.jinja").read_bytes().decode("utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            named[f.name.removesuffix(".jinja")] = f.read_bytes().decode("utf-8")
    template: str | dict[str, str] | None
    if list(named) == ["default"]:
        template = named["default"]
    elif named:
        template = named
    else:
        raw = cfg.get("chat_template")
        if isinstance(raw, (list, tuple)):
            template = {t["name"]: t["template"] for t in raw}
        else:
            template = raw if isinstance(raw, str) else None
    special: dict[str, str] = {}
    stm = path / "special_tokens_map.json"
    legacy = json.loads(stm.read_text(encoding="utf-8")) if stm.is_file() else {}
    for attr in SPECIAL_TOKEN_ATTRIBUTES:
        value = _token_string(cfg.get(attr))
        if value is None:
            value = _token_string(legacy.get(attr))
        if value is not None:
            special[attr] = value
    return template, special


def chat_assets(path: Path) -> tuple[str | dict[str, str] | None, dict[str, str]]:
    """The checkpoint's chat template(s) and special-token strings as transformers loads them.

    The tokenizer is loaded with transformers (``tokenizer.chat_template`` and
    ``tokenizer.special_tokens_map``, exactly what ``apply_chat_template`` renders with); if that
    fails, the files are read directly (:func:`read_chat_files`).
    """
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        template = tok.chat_template
        special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, (str, list))}
    except Exception:  # noqa: BLE001 - an unusual tokenizer class: fall back to the files
        return read_chat_files(path)
    if isinstance(template, dict):
        template = dict(template)
    return template, special


def write_chat_assets(ckpt: Path, out: Path) -> tuple[dict, str | None, list[str]]:
    """Write the target's chat template(s) and generation config into the bundle.

    Returns the manifest's ``chat`` entry, its ``generation_config`` entry and the files written.
    """
    import re

    template, special = chat_assets(ckpt)
    files: list[str] = []
    chat: dict = {"special_tokens": special}
    if isinstance(template, str):
        (out / "chat_template.jinja").write_bytes(template.encode("utf-8"))
        chat["template"] = "chat_template.jinja"
        files.append("chat_template.jinja")
    elif isinstance(template, dict) and template:
        (out / "chat_templates").mkdir()
        chat["template"] = {}
        for name, source in template.items():
            stem = re.sub(r"[^A-Za-z0-9_.-]", "_", str(name)).lstrip(".") or "template"
            rel = f"chat_templates/{stem}.jinja"
            n = 1
            while rel in files:
                n += 1
                rel = f"chat_templates/{stem}-{n}.jinja"
            (out / rel).write_bytes(str(source).encode("utf-8"))
            chat["template"][str(name)] = rel
            files.append(rel)
    gen_config = None
    src = ckpt / "generation_config.json"
    if src.is_file():
        try:
            json.loads(src.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ExportError(f"{src} is not valid JSON ({exc})") from None
        shutil.copyfile(src, out / "generation_config.json")
        gen_config = "generation_config.json"
        files.append(gen_config)
    return chat, gen_config, files


def _eos_ids(path: Path, config_eos) -> list[int]:
    gen = path / "generation_config.json"
    ids = config_eos
    if gen.is_file():
        try:
            ids = json.loads(gen.read_text()).get("eos_token_id", config_eos)
        except json.JSONDecodeError:
            pass
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _load_torch_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"could not load the checkpoint in '{path}': {exc}") from None
    model.eval()
    if hasattr(model.config, "_attn_implementation"):
        try:
            model.config._attn_implementation = "eager"
        except Exception:  # noqa: BLE001
            pass
    return model


def attention_accumulation(role: str, portable: bool) -> str:
    """float64 attention sums for the target (what makes its tree rows bit-identical to sequential
    decoding, docs/design.md); the draft only proposes, so it keeps the cheaper float32 sums, and
    the portable op set (TensorRT) has no float64."""
    return "fp64" if role == "target" and not portable else "native"


# -- one model --------------------------------------------------------------------------------------

def export_model(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, role: str,
                 options: ExportOptions, stages: _Stages | None = None,
                 max_context: int | None = None) -> ExportedModel:
    """Export one checkpoint into ``out_dir/<role>/model.onnx`` (+ external data)."""
    options.check()
    ckpt = check_checkpoint(checkpoint)
    stages = stages or _Stages(5, False)
    out = Path(out_dir) / role
    out.mkdir(parents=True, exist_ok=True)

    stages.start(f"load {role}")
    model = _load_torch_model(ckpt)
    ctx = max_context or options.max_context or DEFAULT_MAX_CONTEXT
    spec, weights = extract(model, ctx)
    spec.eos_token_ids = _eos_ids(ckpt, spec.eos_token_ids or None)
    stages.done()

    stages.start(f"build {role}")
    graph_opts = GraphOptions(dtype=options.dtype, opset=options.opset, fused=not options.portable,
                              attention_accumulation=attention_accumulation(role, options.portable))
    proto = build_model(spec, weights, graph_opts)
    num_params = int(sum(np.prod(t.dims) for t in proto.graph.initializer))
    path = out / "model.onnx"
    files = save_model(proto, str(path))
    fp_bytes = sum(os.path.getsize(f) for f in files)
    stages.done()

    kv_dtype = np.float16 if options.dtype == "fp16" else np.float32
    validation: dict = {}
    stages.start(f"validate {role}")
    if options.validate:
        from specdec_rt.export.validate import validate

        tol = None if options.dtype == "fp32" else 5e-2 * 30
        report = validate(model, str(path), spec, kv_dtype=kv_dtype, tolerance=tol)
        validation = report.to_dict()
    stages.done()

    quant = options.quantize if role in options.quantize_roles else None
    stages.start(f"quantize {role}" if quant else f"save {role}")
    if quant:
        from specdec_rt.export.quantize import quantize_weights
        from specdec_rt.export.validate import validate

        import onnx

        qproto = quantize_weights(onnx.load(str(path)), quant)
        files = save_model(qproto, str(path))
        if options.validate:
            qreport = validate(model, str(path), spec, kv_dtype=kv_dtype, enforce=False)
            validation["quantized"] = qreport.to_dict()
    stages.done()

    size = sum(os.path.getsize(f) for f in files)
    info = {
        "graph": f"{role}/model.onnx",
        "family": spec.family,
        "num_layers": spec.num_layers,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "dtype": options.dtype,
        "kv_dtype": "float16" if options.dtype == "fp16" else "float32",
        "max_positions": spec.max_positions,
        "sliding_window": spec.sliding_window,  # the runtime's masks apply it (every layer)
        "graph_windows": spec.layer_windows,  # per-layer windows the graph applies itself; informational
        "quantization": quant,
        "opset": options.opset,
        "fused_ops": not options.portable,
        "attention_accumulation": graph_opts.attention_accumulation,
        "num_parameters": num_params,
        "num_nodes": len(proto.graph.node),
        "size_bytes": size,
        "size_bytes_unquantized": fp_bytes,
        "validation": validation,
        "source": {"checkpoint": str(ckpt.resolve()), "architectures": getattr(model.config, "architectures", None)},
    }
    del model
    return ExportedModel(role=role, spec=spec, info=info,
                         files=[str(Path(f).relative_to(out_dir)) for f in files])


# -- the pair -------------------------------------------------------------------------------------

def export_pair(target: str | os.PathLike, draft: str | os.PathLike | None, out: str | os.PathLike,
                options: ExportOptions | None = None) -> dict:
    """Export target (and draft) into a bundle directory; return the manifest written.

    The draft is optional: a target-only bundle still serves target-only and prompt-lookup
    decoding.
    """
    options = options or ExportOptions()
    options.check()
    t_ckpt = check_checkpoint(target)
    d_ckpt = check_checkpoint(draft) if draft is not None else None
    t_tok = load_tokenizer_json(t_ckpt)
    hashes = {"target": vocab_digest(t_tok)}
    if d_ckpt is not None:
        d_tok = load_tokenizer_json(d_ckpt)
        compare_vocabularies(t_tok, d_tok)
        hashes["draft"] = vocab_digest(d_tok)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("target", "draft", "chat_templates"):
        if (out / stale).is_dir():
            shutil.rmtree(out / stale)
    for stale in ("chat_template.jinja", "generation_config.json"):
        if (out / stale).is_file():
            (out / stale).unlink()
    roles = [("target", t_ckpt)] + ([("draft", d_ckpt)] if d_ckpt is not None else [])
    stages = _Stages(4 * len(roles) + 1, options.progress)
    t0 = time.perf_counter()
    exported = {}
    max_ctx = None
    for role, ckpt in roles:
        em = export_model(ckpt, out, role, options, stages, max_context=max_ctx)
        if role == "target":
            max_ctx = em.spec.max_positions
        exported[role] = em

    stages.start("write bundle")
    target_spec = exported["target"].spec
    if "draft" in exported:
        dspec = exported["draft"].spec
        if dspec.vocab_size < t_tok.get_vocab_size(with_added_tokens=True) and dspec.vocab_size != target_spec.vocab_size:
            raise ExportError(
                f"draft model vocab size {dspec.vocab_size} is smaller than the tokenizer's "
                f"{t_tok.get_vocab_size(with_added_tokens=True)} tokens"
            )
    max_context = min(em.spec.max_positions for em in exported.values())
    t_tok.save(str(out / "tokenizer.json"))
    chat, gen_config, chat_files = write_chat_assets(t_ckpt, out)
    files = ["tokenizer.json"] + chat_files + [f for em in exported.values() for f in em.files]
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "contract_version": CONTRACT_VERSION,
        "created_by": "specdec-rt 0.1.0",
        "max_context": max_context,
        "tokenizer": "tokenizer.json",
        "tokenizer_hashes": hashes,
        "special_tokens": {
            "eos_token_ids": target_spec.eos_token_ids,
            "bos_token_id": target_spec.bos_token_id,
            "pad_token_id": target_spec.pad_token_id,
        },
        "chat": chat,
        "generation_config": gen_config,
        "models": {role: em.info for role, em in exported.items()},
        "export_seconds": round(time.perf_counter() - t0, 2),
        "stage_seconds": stages.times,
        "files": {f: sha256_file(out / f) for f in files},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    stages.done()
    stages.close()
    return manifest
