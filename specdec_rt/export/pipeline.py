"""Export a target/draft pair of Hugging Face checkpoints into a validated bundle.

Memory at scale (docs/design.md, "Export at scale"): the torch model is loaded in its
checkpoint's dtype; PyTorch's reference outputs for validation are computed first (in float32,
one module upcast at a time); the graph is then written layer by layer straight to its
external-data file (quantized as it is built with ``--quantize``); the torch model is freed
before ONNX Runtime loads the graph to compare. The bundle is assembled in a sibling
``<out>.partial-<pid>`` folder and renamed into place only when complete.
"""
from __future__ import annotations

import errno
import gc
import json
import os
import resource
import shutil
import struct
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdec_rt.errors import ExportError  # noqa: F401 - defined there, re-exported here
from specdec_rt.export.arch import (SUPPORTED_ROPE_TYPES, ArchSpec, UnsupportedArchitectureError,
                                    extract)
from specdec_rt.export.config_files import read_json_config
from specdec_rt.export.draft_vocab import MIN_DRAFT_VOCAB, OUTPUT_IDS_FILE, draft_vocab_ids, prune_lm_head
from specdec_rt.export.gguf_source import resolve_checkpoint, source_record
from specdec_rt.export.graph import GraphOptions, write_model
from specdec_rt.export.quantize import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, QUANT_BITS, QUANT_SCHEMES, W8A8
from specdec_rt.runtime.core.bundle import (CONTRACT_VERSION, FORMAT_NAME, FORMAT_VERSION, MANIFEST,
                                            sha256_file)

DEFAULT_MAX_CONTEXT = 4096
DTYPES = ("fp32", "fp16")
BF16_REFUSED = ("--dtype bf16 is not supported: ONNX Runtime's CPU execution provider has no bfloat16 "
                "kernels for MatMul/Add/Mul (the graph would not load); bf16 checkpoints export exactly "
                "to --dtype fp32 (the default) or to --dtype fp16 (half the size)")


TARGET_ATTENTION = ("fp64", "native", "fused")
QUANTIZE_ROLES = ("target", "draft", "head")
HEAD_QUANTIZE = ("auto", "none", "int4", "int8", "w8a8")


@dataclass
class ExportOptions:
    dtype: str = "fp32"
    quantize: str | None = None
    quantize_roles: tuple[str, ...] = ("target", "draft", "head")
    opset: int = 17
    max_context: int | None = None
    portable: bool = False
    # the draft's attention as one ONNX Attention node per layer (opset 23, float32 sums); never
    # with ``portable``; False: the decomposed attention (the target's: ``target_attention``)
    draft_fused_attention: bool = True
    # "fp64": the target sums attention in float64 (tree rows bit-identical to sequential ones);
    # "native": float32 sums in the decomposed ops; "fused": one ONNX Attention node per layer
    # (opset 23, float32 sums, the fastest target calls). native/fused are exact for chains only
    # (the runtime then refuses speculation="tree"); fused relies on the load-time row probe
    target_attention: str = "fp64"
    validate: bool = True
    progress: bool = True
    # with ``quantize``: store the embedding table quantized too (False: in the graph dtype, as
    # before; for measuring what the embedding's quantization costs in accuracy)
    quantize_embedding: bool = True
    # where GGUF inputs are dequantised into checkpoint folders, once per file (None: the default,
    # ~/.cache/specdec-rt/gguf; see gguf_source)
    gguf_cache: str | os.PathLike | None = None
    # the draft's LM head cut to this many tokens (None: the whole vocabulary); see draft_vocab
    draft_vocab: int | None = None
    # with ``quantize``: weights per scale along K. On AVX-512 VNNI CPUs ONNX Runtime's one-row
    # int4 kernel gives the multi-row kernel's bits at 32 (the default); on AVX2-only CPUs only at
    # 16 (there 32 needs one-row calls padded to two rows). 64 / 128 are not even row-position
    # invariant at accuracy level 4 (docs/design.md, "Exactness")
    block_size: int = DEFAULT_BLOCK_SIZE
    # an EAGLE-3 feature head folder (config.json + weights, published names; eagle.load_head): the
    # target gets a ``features`` output for its layers and the head's graphs go to ``head/``
    # (specdec_rt.export.eagle_graph); with or without a draft model
    draft_head: str | os.PathLike | None = None
    # the head's weights: "auto" = int4 when nothing is quantized and the graphs may use ONNX
    # Runtime's contrib ops (not --portable): the head only proposes, so its precision never
    # changes the output, and int4 makes its calls ~2-3x cheaper in the loop (docs/design.md,
    # "EAGLE-3 heads: runtime"); else the --quantize scheme, or float when --quantize-models leaves
    # it out; "none" / "int4" / "int8" choose it outright
    head_quantize: str = "auto"
    # the draft model's weights when they should differ from ``quantize``: "auto" = as ``quantize``
    # (and ``quantize_roles``); "none" / "int4" / "int8" / "w8a8" outright. The draft only
    # proposes, so e.g. a w8a8 target (row-invariant, flat verify) with an int4 draft (half the
    # bytes per call) keeps the output exact (docs/design.md, "Exactness")
    draft_quantize: str = "auto"

    def check(self) -> None:
        if self.dtype == "bf16":
            raise ExportError(BF16_REFUSED)
        if self.dtype not in DTYPES:
            raise ExportError(f"--dtype must be fp32 or fp16, not '{self.dtype}'")
        if self.quantize not in (None, *QUANT_SCHEMES):
            raise ExportError(f"--quantize must be one of {', '.join(QUANT_SCHEMES)}, not '{self.quantize}'")
        if self.quantize == W8A8 and self.dtype != "fp32":
            raise ExportError("--quantize w8a8 needs --dtype fp32 (its integer GEMM outputs float32)")
        if not 14 <= self.opset <= 21:
            raise ExportError(f"--opset {self.opset} is outside the supported range 14..21")
        if self.target_attention not in TARGET_ATTENTION:
            raise ExportError(f"--target-attention must be one of {', '.join(TARGET_ATTENTION)}, "
                              f"not '{self.target_attention}'")
        if self.block_size not in BLOCK_SIZES:
            raise ExportError(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))}, not {self.block_size}")
        if self.draft_vocab is not None and self.draft_vocab < MIN_DRAFT_VOCAB:
            raise ExportError(f"--draft-vocab must be at least {MIN_DRAFT_VOCAB}, not {self.draft_vocab}")
        if self.draft_quantize not in HEAD_QUANTIZE:
            raise ExportError(f"--draft-quantize must be one of {', '.join(HEAD_QUANTIZE)}, not '{self.draft_quantize}'")
        if self.head_quantize not in HEAD_QUANTIZE:
            raise ExportError(f"--head-quantize must be one of {', '.join(HEAD_QUANTIZE)}, not '{self.head_quantize}'")
        if self.max_context is not None and self.max_context < 16:
            raise ExportError("--max-context must be at least 16")
        unknown = [r for r in self.quantize_roles if r not in QUANTIZE_ROLES]
        if unknown:
            raise ExportError(f"--quantize-models takes {', '.join(QUANTIZE_ROLES)}, not {', '.join(map(repr, unknown))}")


@dataclass
class ExportedModel:
    role: str
    spec: ArchSpec
    info: dict
    files: list[str] = field(default_factory=list)
    sha256: dict[str, str] = field(default_factory=dict)  # file -> digest, computed while writing
    # the target's EAGLE-3 head (eagle.EagleHead, loaded with its embedding table), handed to
    # eagle_graph.export_head by the pair's export and dropped there
    eagle_head: object | None = None


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
        self.peak_rss: dict[str, int] = {}  # sampled per stage (Linux); see _RssSampler
        self._rss = _RssSampler()
        self._t0 = time.perf_counter()

    def start(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(f"export: {name}")
        self._rss.restart()
        self._name, self._t0 = name, time.perf_counter()

    def done(self) -> None:
        self.times[self._name] = round(time.perf_counter() - self._t0, 3)
        peak = self._rss.peak()
        if peak:
            self.peak_rss[self._name] = peak
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        self._rss.stop()
        if self.bar is not None:
            self.bar.set_description("export: done")
            self.bar.close()


class _RssSampler:
    """Peak resident memory per stage, sampled every 20 ms from /proc/self/statm by a daemon thread.

    Sampling, not the kernel's high-water mark: resetting that (clear_refs) would also reset
    ``ru_maxrss``, which must stay the exact peak of the whole export. Off where /proc is absent.
    """

    def __init__(self, interval: float = 0.02) -> None:
        import threading

        self._max = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._ok = os.path.exists("/proc/self/statm")
        if self._ok:
            self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
            self._thread.start()

    def _now(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return 0

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._max = max(self._max, self._now())

    def restart(self) -> None:
        self._max = self._now()

    def peak(self) -> int:
        return max(self._max, self._now()) if self._ok else 0

    def stop(self) -> None:
        self._stop.set()


# -- checkpoint inspection -----------------------------------------------------------------------

def check_checkpoint(path: str | os.PathLike) -> Path:
    """Fail early and clearly on a folder that cannot be a causal-LM checkpoint."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"checkpoint folder '{p}' does not exist")
    if not p.is_dir():
        raise ExportError(f"'{p}' is not a folder; pass a Hugging Face checkpoint directory or a .gguf file")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ExportError(f"'{p}' has no config.json; is it a Hugging Face checkpoint?")
    data = read_json_config(cfg, "transformers config")
    if "model_type" not in data:
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
    check_config_features(data, cfg)
    check_weight_files(p)
    return p


def check_config_features(data: dict, cfg_path: Path) -> None:
    """Config switches of a known family that the exporter (or transformers) cannot honour, read
    from config.json before anything is loaded (transformers may fail on them with a long trace)."""
    family = data.get("model_type")
    for key in ("hidden_act", "hidden_activation", "activation_function"):
        value = data.get(key)
        if isinstance(value, str):
            from transformers.activations import ACT2FN

            if value not in ACT2FN:
                raise UnsupportedArchitectureError(
                    f"{cfg_path}: {family}: {key}={value!r} is not an activation transformers implements")
    for key in ("rope_parameters", "rope_scaling"):
        params = data.get(key)
        if not isinstance(params, dict):
            continue
        nested = params and all(isinstance(v, dict) for v in params.values())
        for where, entry in (params.items() if nested else [(None, params)]):
            rope_type = entry.get("rope_type") or entry.get("type") or "default"
            if rope_type not in SUPPORTED_ROPE_TYPES:
                field_name = key + (f"['{where}']" if where else "") + (".type" if "rope_type" not in entry else ".rope_type")
                raise UnsupportedArchitectureError(
                    f"{cfg_path}: {family}: rope type '{rope_type}' ({field_name}) is not supported; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file (header read only), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes, no header)"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"is truncated ({size} bytes; its header alone needs {8 + n})"
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "is not a valid safetensors file (unreadable header)"
    if not isinstance(header, dict):
        return "is not a valid safetensors file (unreadable header)"
    end = max((v["data_offsets"][1] for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end > size:
        return f"is truncated ({size} bytes; its header describes {8 + n + end})"
    return None


def check_weight_files(p: Path) -> None:
    """Every shard an index lists exists, and no weight file is cut short (headers only)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = p / index_name
        if not index.is_file():
            continue
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise ExportError(f"{index} is not a valid weight index (no readable 'weight_map')") from None
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ExportError(f"{p / missing[0]} is missing{more}: {index_name} lists "
                              f"{len(shards)} shards; the checkpoint is incomplete")
    for f in sorted(p.glob("*.safetensors")):
        problem = _safetensors_problem(f)
        if problem:
            raise ExportError(f"{f} {problem}; re-download or re-save the checkpoint")
    for f in sorted(p.glob("*.bin")):
        with open(f, "rb") as fh:
            is_zip = fh.read(2) == b"PK"
        if is_zip:
            try:
                zipfile.ZipFile(f).close()
            except (zipfile.BadZipFile, OSError):
                raise ExportError(f"{f} is truncated or corrupt (unreadable zip archive); "
                                  "re-download or re-save the checkpoint") from None


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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _load_torch_model(path: Path):
    """The checkpoint in its own dtype (bf16 stays bf16: half the memory of float32; the
    validation's reference computes in float32 anyway, see validate.float32_compute)."""
    from transformers import AutoModelForCausalLM

    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype="auto")
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype="auto")
    except MemoryError:
        raise ExportError(f"out of memory loading the checkpoint in '{path}'") from None
    except Exception as exc:  # noqa: BLE001 - transformers/safetensors raise many types; one line each
        raise ExportError(f"could not load the checkpoint in '{path}': {_one_line(exc)}") from None
    model.eval()
    if hasattr(model.config, "_attn_implementation"):
        try:
            model.config._attn_implementation = "eager"
        except Exception:  # noqa: BLE001
            pass
    return model


def attention_accumulation(role: str, portable: bool, target_attention: str = "fp64") -> str:
    """float64 attention sums for the target (what makes its tree rows bit-identical to sequential
    decoding, docs/design.md) unless ``target_attention`` is "native" or "fused", the faster
    float32 sums (exact for chains, not trees); the draft only proposes, so it keeps the cheaper float32
    sums, and the portable op set (TensorRT) has no float64."""
    return "fp64" if role == "target" and not portable and target_attention == "fp64" else "native"


def fused_attention(role: str, portable: bool, draft_fused_attention: bool = True,
                    target_attention: str = "fp64") -> bool:
    """One ONNX ``Attention`` node per layer (GraphBuilder._fused_attention): the draft's default,
    the target's only with ``target_attention="fused"``. The kernel sums over keys in float32 in
    its own grouping, so a tree node's row (masked siblings between its keys) is not bit-identical
    to the same token decoded alone; the draft can afford that (the target verifies every token it
    proposes), a target only for chains, whose rows keep their keys in the sequential columns
    (ONNX Runtime's kernel takes another path for a 1-row call, which the runtime's row probe
    detects and pads, docs/design.md). The portable op set keeps plain ops for TensorRT."""
    if portable:
        return False
    return draft_fused_attention if role == "draft" else target_attention == "fused"


# -- one model --------------------------------------------------------------------------------------

def process_peak_rss() -> int:
    """``getrusage(RUSAGE_SELF).ru_maxrss`` in bytes: the process's peak since it started."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def export_model(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, role: str,
                 options: ExportOptions, stages: _Stages | None = None,
                 max_context: int | None = None, tokenizer=None, head_dir=None) -> ExportedModel:
    """Export one checkpoint into ``out_dir/<role>/model.onnx`` + ``model.onnx.data``.

    ``tokenizer`` (the pair's, a ``tokenizers.Tokenizer``) picks the tokens a draft exported with
    ``options.draft_vocab`` keeps (default: the checkpoint's own tokenizer.json). ``head_dir``
    (target only): an EAGLE-3 head folder, checked against the loaded target and loaded with its
    embedding table; the graph then outputs ``features`` for the head's layers (validated against
    eagle.target_features) and the head comes back as ``eagle_head``."""
    options.check()
    ckpt = check_checkpoint(resolve_checkpoint(checkpoint, options.gguf_cache, options.progress))
    own_stages = stages is None
    stages = stages or _Stages(4, False)
    out = Path(out_dir) / role
    out.mkdir(parents=True, exist_ok=True)
    quant = role_quantization(options, role)

    stages.start(f"load {role}")
    model = _load_torch_model(ckpt)
    ctx = max_context or options.max_context or DEFAULT_MAX_CONTEXT
    spec, weights = extract(model, ctx)
    spec.eos_token_ids = _eos_ids(ckpt, spec.eos_token_ids or None)
    torch_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    architectures = getattr(model.config, "architectures", None)
    stages.done()
    head = None
    if head_dir is not None:
        from specdec_rt.export.eagle_graph import load_target_head

        stages.start("load head")
        head = load_target_head(head_dir, model, spec)
        stages.done()
    feature_layers = tuple(head.cfg.feature_layers) if head is not None else None

    output_ids = None
    if role == "draft" and options.draft_vocab:
        output_ids = draft_vocab_ids(tokenizer or load_tokenizer_json(ckpt), spec.vocab_size, options.draft_vocab,
                                     spec.eos_token_ids)
    refs = None
    if options.validate:
        from specdec_rt.export.validate import reference_outputs, restrict_vocab

        stages.start(f"reference {role}")
        refs = reference_outputs(model, spec, feature_layers=feature_layers)
        if output_ids is not None:
            refs = restrict_vocab(refs, output_ids)
        stages.done()
    if output_ids is not None:
        prune_lm_head(weights, output_ids)

    stages.start(f"build {role}")
    graph_opts = GraphOptions(dtype=options.dtype, opset=options.opset, fused=not options.portable,
                              attention_accumulation=attention_accumulation(role, options.portable, options.target_attention),
                              fused_attention=fused_attention(role, options.portable, options.draft_fused_attention,
                                                              options.target_attention),
                              quantize=quant, quantize_embedding=options.quantize_embedding,
                              block_size=options.block_size,
                              output_ids=output_ids, feature_layers=feature_layers)
    path = out / "model.onnx"
    written = write_model(spec, weights, graph_opts, str(path))
    if output_ids is not None:  # the record of what the draft may propose (the graph holds them too)
        ids_path = out / OUTPUT_IDS_FILE
        np.save(ids_path, output_ids)
        written.files.append(str(ids_path))
        written.sha256[str(ids_path)] = sha256_file(ids_path)
    del weights, model
    gc.collect()
    stages.done()

    kv_dtype = "float16" if options.dtype == "fp16" else "float32"
    validation: dict = {}
    stages.start(f"validate {role}")
    if refs is not None:
        from specdec_rt.export.validate import compare

        if quant:  # the float graph is never built: the quantized one is compared, not enforced
            validation = {"quantized": compare(str(path), spec, refs, kv_dtype=kv_dtype, enforce=False,
                                               columns=output_ids).to_dict()}
        else:
            tol = None if options.dtype == "fp32" else 5e-2 * 30
            validation = compare(str(path), spec, refs, kv_dtype=kv_dtype, tolerance=tol, prepack=False,
                                 columns=output_ids).to_dict()
    stages.done()
    peak = max((v for k, v in stages.peak_rss.items() if k.endswith(f" {role}")), default=None)

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
        "kv_dtype": kv_dtype,
        "max_positions": spec.max_positions,
        "sliding_window": spec.sliding_window,  # the runtime's masks apply it (every layer)
        "graph_windows": spec.layer_windows,  # per-layer windows the graph applies itself; informational
        "quantization": quant,
        "quant_block_size": graph_opts.block_size if quant in QUANT_BITS else None,  # w8a8: per channel
        # a draft whose LM head was cut: the tokens it may propose (int64 .npy beside the graph;
        # the graph's logits stay [B, S, V], -inf outside them)
        "output_ids": None if output_ids is None else f"{role}/{OUTPUT_IDS_FILE}",
        "output_vocab": spec.vocab_size if output_ids is None else len(output_ids),
        "opset": written.opset,
        "fused_ops": not options.portable,
        "attention_accumulation": graph_opts.attention_accumulation,
        "fused_attention": graph_opts.fused_attention,
        "num_parameters": written.num_params,
        "num_nodes": written.num_nodes,
        "size_bytes": written.size_bytes,
        # the graph's initializers without quantization (computed; a quantized export never writes them)
        "size_bytes_unquantized": written.unquantized_bytes if quant else written.size_bytes,
        "validation": validation,
        "export_peak_rss_bytes": peak,  # sampled: the highest of this model's stages
        **({"feature_layers": list(feature_layers)} if feature_layers else {}),  # the ``features`` output
        # format "gguf": the file it was converted from (path, bytes, file_type, architecture); "hf": the folder
        "source": {**source_record(ckpt), "checkpoint": str(ckpt.resolve()), "architectures": architectures,
                   "dtype": torch_dtype},
    }
    if own_stages:
        stages.close()
    sha = {str(Path(f).relative_to(out_dir)): d for f, d in written.sha256.items()}
    return ExportedModel(role=role, spec=spec, info=info, files=list(sha), sha256=sha, eagle_head=head)


# -- the pair -------------------------------------------------------------------------------------

def export_pair(target: str | os.PathLike, draft: str | os.PathLike | None, out: str | os.PathLike,
                options: ExportOptions | None = None) -> dict:
    """Export target (and draft) into a bundle directory; return the manifest written.

    The draft is optional: a target-only bundle still serves target-only and prompt-lookup
    decoding.
    """
    options = options or ExportOptions()
    options.check()
    if draft is None and options.draft_vocab is not None:  # it cuts the draft model's LM head only
        raise ExportError("--draft-vocab cuts the draft model's LM head: give --draft too (a head's vocabulary is "
                          "its training's: specdec-train-head --draft-vocab)")
    if draft is None and options.draft_quantize != "auto":
        raise ExportError("--draft-quantize sets the draft model's weights: give --draft too")
    # a GGUF file becomes its cached checkpoint folder here (converted on its first export)
    target, draft = (None if p is None else resolve_checkpoint(p, options.gguf_cache, options.progress)
                     for p in (target, draft))
    t_ckpt = check_checkpoint(target)
    d_ckpt = check_checkpoint(draft) if draft is not None else None
    if options.draft_head is not None:  # fail in seconds on a broken head folder, before any loading
        from specdec_rt.export.eagle_graph import check_head_folder

        check_head_folder(options.draft_head, t_ckpt)
    t_tok = load_tokenizer_json(t_ckpt)
    hashes = {"target": vocab_digest(t_tok)}
    if d_ckpt is not None:
        d_tok = load_tokenizer_json(d_ckpt)
        compare_vocabularies(t_tok, d_tok)
        hashes["draft"] = vocab_digest(d_tok)

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out '{out}' exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ExportError(f"--out '{out}' is a non-empty folder without {MANIFEST} (not a specdec-rt bundle); "
                          "refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    # everything is written into a sibling folder and renamed into place once complete: a failed
    # or interrupted export never leaves a bundle that looks finished (nor breaks the previous one)
    work = out.parent / f"{out.name}.partial-{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    try:
        manifest = _export_into(work, t_ckpt, d_ckpt, t_tok, hashes, options)
        _replace_dir(work, out)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise ExportError(f"no space left on the device writing {exc.filename or work}; "
                              "free space or choose another --out") from None
        raise
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


def role_quantization(options: ExportOptions, role: str) -> str | None:
    """The scheme a target's or draft's weights get (``quantize``, ``quantize_roles``, ``draft_quantize``)."""
    if role == "draft" and options.draft_quantize != "auto":
        return None if options.draft_quantize == "none" else options.draft_quantize
    return options.quantize if role in options.quantize_roles else None


def head_quantization(options: ExportOptions) -> str | None:
    """The scheme the head's weights get (see ExportOptions.head_quantize)."""
    if options.head_quantize != "auto":
        return None if options.head_quantize == "none" else options.head_quantize
    if options.quantize is None:
        return None if options.portable else "int4"  # MatMulNBits is a contrib op
    return options.quantize if "head" in options.quantize_roles else None


def _export_head(target: ExportedModel, out: Path, options: ExportOptions, stages: _Stages) -> ExportedModel:
    """The EAGLE-3 head loaded with ``target`` into ``out/head/`` (eagle_graph.export_head)."""
    from specdec_rt.export.eagle_graph import export_head

    head, target.eagle_head = target.eagle_head, None
    hx = export_head(head, str(options.draft_head), out, max_positions=target.spec.max_positions,
                     fused=not options.portable, opset=options.opset, quantize=head_quantization(options),
                     block_size=options.block_size, quantize_embedding=options.quantize_embedding,
                     fused_attention=options.draft_fused_attention and not options.portable,
                     validate=options.validate, stages=stages)
    hx.info["export_peak_rss_bytes"] = max((v for k, v in stages.peak_rss.items() if k.endswith(" head")), default=None)
    return ExportedModel(role="head", spec=hx.spec, info=hx.info, files=list(hx.sha256), sha256=hx.sha256)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished bundle ``src`` to ``dst``, replacing a previous bundle there."""
    old = None
    if dst.exists():
        old = dst.parent / f"{dst.name}.old-{os.getpid()}"
        dst.rename(old)
    src.rename(dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _export_into(out: Path, t_ckpt: Path, d_ckpt: Path | None, t_tok, hashes: dict,
                 options: ExportOptions) -> dict:
    roles = [("target", t_ckpt)] + ([("draft", d_ckpt)] if d_ckpt is not None else [])
    models = len(roles) + (options.draft_head is not None)
    stages = _Stages((4 if options.validate else 3) * models + 1, options.progress)
    try:
        return _export_roles(out, roles, t_tok, hashes, options, stages)
    finally:
        stages.close()


def _export_roles(out: Path, roles: list, t_tok, hashes: dict, options: ExportOptions, stages: _Stages) -> dict:
    t0 = time.perf_counter()
    exported = {}
    max_ctx = None
    for role, ckpt in roles:
        em = export_model(ckpt, out, role, options, stages, max_context=max_ctx, tokenizer=t_tok,
                          head_dir=options.draft_head if role == "target" else None)
        if em.eagle_head is not None:  # right after its target: the head holds the embedding table
            exported["head"] = _export_head(em, out, options, stages)
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
    chat, gen_config, chat_files = write_chat_assets(roles[0][1], out)  # the target's
    digests = {f: sha256_file(out / f) for f in ["tokenizer.json"] + chat_files}
    for em in exported.values():
        digests.update(em.sha256)
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
        "models": {role: exported[role].info for role in ("target", "draft", "head") if role in exported},
        "export_seconds": round(time.perf_counter() - t0, 2),
        "stage_seconds": stages.times,
        "stage_peak_rss_bytes": stages.peak_rss,
        # getrusage(RUSAGE_SELF).ru_maxrss: the exporting process's peak since it started
        "export_peak_rss_bytes": process_peak_rss(),
        "files": digests,
    }
    stages.done()
    manifest["stage_seconds"] = stages.times
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))  # last: the bundle is complete
    return manifest
