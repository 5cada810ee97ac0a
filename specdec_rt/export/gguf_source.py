"""GGUF files (llama.cpp's format) as export input, dequantised once into a cached checkpoint folder.

The exporter reads Hugging Face checkpoint folders. A GGUF file is turned into one with
transformers' own GGUF loader (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``
and ``AutoTokenizer``), which dequantises the weights and rebuilds config and tokenizer from the
file's metadata; the folder is written once into a cache and every later export of the same file
reuses it, so the normal export path runs unchanged on it. The weights are saved in float32
(a Q4_K value is a float32 product of scales and codes: bfloat16 would round it) unless the file
holds plain half-precision tensors that all survive the round trip. The folder records where it
came from (:data:`SOURCE_FILE`), which the manifest copies (``models[role]["source"]``).

The file is checked before the slow load: magic bytes, a readable header, tensor data that fits
in the file, a single (not split) file, and an architecture that transformers reads and the
exporter exports, so a bad input fails in seconds with one line.
"""
from __future__ import annotations

import errno
import gc
import hashlib
import importlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec_rt.errors import GGUFError, UnsupportedGGUFError

GGUF_MAGIC = b"GGUF"
# written last into a converted folder: the source record, and the mark of a complete conversion
SOURCE_FILE = "specdec_gguf_source.json"
# part of the cache key: bump it when the folder's layout or content changes, so old folders go unused
CONVERTER_VERSION = 1
INSTALL_HINT = "pip install 'specdec-rt[export]'"

# llama.cpp's architecture names where transformers' model_type differs (the rest are the same)
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# control tokens llama.cpp ends generation on besides the declared eos/eot/eom ids (the texts its
# vocabulary loader looks for): a Qwen file declares only <|im_end|>, and llama.cpp (like the
# checkpoint's generation_config.json) also stops at <|endoftext|>
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
             "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")
# llama.cpp's token types: CONTROL and USER_DEFINED tokens are the special ones
SPECIAL_TOKEN_TYPES = (3, 4)
# general.sampling.* (what convert_hf_to_gguf.py copies from generation_config.json) -> HF names
SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                 "general.sampling.top_p": "top_p"}


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/specdec-rt/gguf`` (``~/.cache/specdec-rt/gguf`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "specdec-rt" / "gguf"


def looks_like_gguf(path: str | os.PathLike) -> bool:
    """A ``.gguf`` name, or a file starting with the GGUF magic bytes (a model saved without the
    suffix). A folder is never one: folders are Hugging Face checkpoints."""
    p = Path(path)
    if p.is_dir():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


@dataclass
class GGUFInfo:
    """What the export needs from a GGUF file's header (its tensors are not read)."""

    path: Path  # absolute
    size: int
    architecture: str  # general.architecture
    file_type: str | None  # general.file_type as llama.cpp names it (Q4_K_M, F16, ...)
    tensor_types: set[str] = field(default_factory=set)  # ggml types of the tensors (F32, Q4_K, ...)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | list[dict] | None = None
    sampling: dict = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return MODEL_TYPES.get(self.architecture, self.architecture)

    def source(self) -> dict:
        """The manifest's ``models[role]["source"]`` entry (read by the llama.cpp benchmark)."""
        return {"format": "gguf", "path": str(self.path), "bytes": self.size, "file_type": self.file_type,
                "architecture": self.architecture}


# -- packages ---------------------------------------------------------------------------------------

def require_package(module: str, purpose: str) -> None:
    """Fail with the extra to install, not an ImportError deep inside transformers."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise GGUFError(f"{purpose} needs the '{module}' package, which is not installed: {INSTALL_HINT}") from None


# -- reading and checking the header ----------------------------------------------------------------

def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def _value(reader, key: str):
    """A metadata value as Python (str, int, float, bool or a list of them); None when absent."""
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None or not f.types:
        return None

    def one(part, kind):
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part.tolist()[0]

    if f.types[0] == GGUFValueType.ARRAY:
        return [one(f.parts[i], f.types[-1]) for i in f.data]
    return one(f.parts[f.data[0]], f.types[0])


def _file_type_name(value) -> str | None:
    """llama.cpp's name for ``general.file_type`` without its prefix: 15 -> "Q4_K_M", 1 -> "F16"."""
    if not isinstance(value, int):
        return None
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(value).name
    except ValueError:
        return f"file_type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _open_reader(p: Path, size: int):
    """``gguf.GGUFReader`` over the file, a cut or damaged file reported in one line (the reader
    itself fails with numpy reshape and dtype errors that do not say so)."""
    from gguf import GGUFReader

    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"'{p}' is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(str(p))
    except MemoryError:
        raise GGUFError(f"out of memory reading the header of '{p}'") from None
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError/IndexError/... on damage
        raise GGUFError(f"'{p}' is truncated or corrupt ({size} bytes; the GGUF header cannot be read: "
                        f"{_one_line(exc)}); re-download it") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"'{p}' is truncated ({size} bytes; its tensors need {end}); re-download it")
    return reader


def _end_of_generation_ids(reader) -> list[int]:
    """eos, then eot/eom, then the special tokens whose text llama.cpp also stops at (EOG_TEXTS)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _value(reader, key)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    tokens, types = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None and len(tokens.data) == len(types.data):
        for i, (ti, tt) in enumerate(zip(tokens.data, types.data)):
            if int(types.parts[tt][0]) in SPECIAL_TOKEN_TYPES and i not in ids:
                if bytes(tokens.parts[ti]).decode("utf-8", errors="replace") in EOG_TEXTS:
                    ids.append(i)
    return ids


def _chat_template(reader) -> str | list[dict] | None:
    """``tokenizer.chat_template``, plus named ones (``tokenizer.chat_template.<name>``) as the
    list of ``{"name", "template"}`` that tokenizer_config.json uses for several."""
    default = _value(reader, "tokenizer.chat_template")
    names = _value(reader, "tokenizer.chat_templates")
    named = [{"name": n, "template": _value(reader, f"tokenizer.chat_template.{n}")}
             for n in (names if isinstance(names, list) else [])]
    named = [t for t in named if isinstance(t["template"], str)]
    if not named:
        return default if isinstance(default, str) else None
    return ([{"name": "default", "template": default}] if isinstance(default, str) else []) + named


def read_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Read and check a GGUF file's header: fails fast, before any weight is dequantised."""
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise GGUFError(f"GGUF file '{p}' does not exist")
    if not p.is_file():
        raise GGUFError(f"'{p}' is not a file")
    require_package("gguf", "reading GGUF files")
    size = p.stat().st_size
    reader = _open_reader(p, size)
    count = _value(reader, "split.count")
    if isinstance(count, int) and count > 1:
        raise GGUFError(f"'{p}' is one of {count} split GGUF files; merge them first "
                        "(llama-gguf-split --merge) and export the merged file")
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"'{p}' has no general.architecture in its metadata; is it a model file?")
    sampling = {hf: v for key, hf in SAMPLING_KEYS.items() if (v := _value(reader, key)) is not None}
    eos = _end_of_generation_ids(reader)
    info = GGUFInfo(path=p, size=size, architecture=arch, file_type=_file_type_name(_value(reader, "general.file_type")),
                    tensor_types={t.tensor_type.name for t in reader.tensors}, eos_token_ids=eos,
                    bos_token_id=_value(reader, "tokenizer.ggml.bos_token_id"),
                    pad_token_id=_value(reader, "tokenizer.ggml.padding_token_id"),
                    chat_template=_chat_template(reader), sampling=sampling)
    del reader
    check_supported(info)
    return info


def transformers_gguf_architectures() -> set[str]:
    """The GGUF architectures this transformers' loader reads (its legacy table and, in 5.x,
    the architectures its newer loader handles)."""
    archs: set[str] = set()
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        archs.update(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    except ImportError:
        pass
    try:
        from transformers.integrations.gguf import GGUF_ARCHS

        archs.update(GGUF_ARCHS)
    except (ImportError, AttributeError):
        pass
    return archs


def supported_architectures() -> list[str]:
    """GGUF architectures both transformers loads and the exporter exports."""
    from specdec_rt.export.arch import SUPPORTED_FAMILIES

    return sorted(a for a in transformers_gguf_architectures() if MODEL_TYPES.get(a, a) in SUPPORTED_FAMILIES)


def check_supported(info: GGUFInfo) -> None:
    """Name the architecture and the supported ones, rather than letting transformers fail later."""
    from specdec_rt.export.arch import SUPPORTED_FAMILIES

    supported = ", ".join(supported_architectures())
    if info.architecture not in transformers_gguf_architectures():
        import transformers

        raise UnsupportedGGUFError(
            f"'{info.path}': GGUF architecture '{info.architecture}' cannot be loaded by transformers "
            f"{transformers.__version__}; supported GGUF architectures: {supported}")
    if info.model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedGGUFError(
            f"'{info.path}': GGUF architecture '{info.architecture}' (transformers model_type "
            f"'{info.model_type}') is not supported by the exporter; supported GGUF architectures: {supported}")


# -- the cache ------------------------------------------------------------------------------------

def cache_key(path: Path) -> str:
    """``<stem>-<digest>`` of the absolute path, size and mtime (a replaced or edited file gets a
    new folder) and of the converter and transformers versions (a new loader may read differently).
    Computed from ``stat`` alone: a cache hit never reads the file."""
    import transformers

    st = path.stat()
    ident = json.dumps([str(path), st.st_size, st.st_mtime_ns, CONVERTER_VERSION, transformers.__version__])
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in path.stem)[:60] or "model"
    return f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def read_source_record(folder: Path) -> dict | None:
    """The record a conversion left in ``folder`` (None for an ordinary checkpoint folder)."""
    f = Path(folder) / SOURCE_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return None


def source_record(checkpoint: str | os.PathLike) -> dict:
    """The manifest's ``source`` entry for a checkpoint folder: the GGUF file it was converted from
    (format "gguf", with its conversion time) or the folder itself (format "hf")."""
    folder = Path(checkpoint).absolute()
    record = read_source_record(folder)
    if record and isinstance(record.get("source"), dict):
        return {**record["source"], "convert_seconds": record.get("convert_seconds")}
    return {"format": "hf", "path": str(folder.resolve())}


def resolve_checkpoint(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                       progress: bool = True) -> Path:
    """The checkpoint folder to export: ``path`` itself, or for a GGUF file its cached conversion
    (made now on the first export of the file)."""
    if not looks_like_gguf(path):
        return Path(path)
    p = Path(path).expanduser().absolute()
    if not p.is_file():
        read_gguf(p)  # raises: does not exist / not a file
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    dest = root.absolute() / cache_key(p)
    if read_source_record(dest) is not None and (dest / "config.json").is_file():
        return dest
    info = read_gguf(p)
    require_package("accelerate", "loading a GGUF file with transformers")
    if progress:
        print(f"specdec-export: converting {p.name} ({info.file_type or 'GGUF'}, {info.architecture}) to a "
              f"float checkpoint in {dest} (once; later exports reuse it)", file=sys.stderr, flush=True)
    convert(info, dest)
    return dest


# -- the conversion -------------------------------------------------------------------------------

def convert(info: GGUFInfo, dest: Path) -> None:
    """Write the checkpoint folder into a temporary sibling and rename it into place: an interrupted
    conversion leaves no folder that a later export would take for a finished one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(dest)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        t0 = time.perf_counter()
        dtype = write_checkpoint(info, tmp)
        record = {"converter_version": CONVERTER_VERSION, "source": info.source(), "dtype": dtype,
                  "mtime_ns": info.path.stat().st_mtime_ns, "convert_seconds": round(time.perf_counter() - t0, 2)}
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2))  # last: the folder is complete
        try:
            tmp.rename(dest)
        except OSError:
            if read_source_record(dest) is None:  # not a concurrent export that finished first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise GGUFError(f"no space left on the device converting '{info.path}' into {dest.parent}; "
                            "free space or choose another --gguf-cache") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's process
        return True
    return True


def remove_stale_temporaries(dest: Path) -> None:
    """Temporary folders of conversions whose process is gone (killed, out of memory): never
    reused, but they hold gigabytes. A live process's folder is left alone (a concurrent export)."""
    for tmp in dest.parent.glob(f".{dest.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def write_checkpoint(info: GGUFInfo, out: Path) -> str:
    """Dequantise the model and tokenizer into ``out`` (config.json, safetensors, tokenizer.json,
    tokenizer_config.json with the chat template, generation_config.json); return the weights' dtype."""
    model = load_model(info)
    dtype = exact_dtype(model, info)
    _drop_quantizer(model)
    if dtype != "float32":
        import torch

        model.to(getattr(torch, dtype))
    model.config.dtype = dtype  # what the export's dtype="auto" load then reads
    # shards bound the transient copy safetensors makes of the tensors it writes
    model.save_pretrained(str(out), max_shard_size="1GB")
    del model
    gc.collect()
    write_tokenizer(info, out)
    write_generation_config(info, out)
    return dtype


def load_model(info: GGUFInfo):
    """The dequantised model in float32: exact for every GGUF tensor type (the quantised types
    dequantise to float32 products, F16 and BF16 widen exactly)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(info.path.parent), gguf_file=str(info.path),
                                                    dtype=torch.float32).eval()
    except MemoryError:
        raise GGUFError(f"out of memory dequantising '{info.path}'") from None
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; one line each
        raise GGUFError(f"transformers could not load '{info.path}': {_one_line(exc)}") from None


def exact_dtype(model, info: GGUFInfo) -> str:
    """float32, or the file's half type (F16/BF16) when the file has no quantised tensors and every
    weight survives the round trip to it (half the cache's size, nothing rounded)."""
    import torch

    if info.tensor_types - {"F32", "F16", "BF16"}:
        return "float32"
    half = "bfloat16" if "BF16" in info.tensor_types else "float16" if "F16" in info.tensor_types else None
    if half is None:
        return "float32"
    t = getattr(torch, half)
    with torch.no_grad():
        for p in model.state_dict().values():
            if p.is_floating_point() and not torch.equal(p.to(t).to(p.dtype), p):
                return "float32"
    return half


def _drop_quantizer(model) -> None:
    """transformers 5 marks a model loaded from GGUF as quantised by its GGUF quantizer and then
    refuses ``save_pretrained``; the weights are already dense floats, so the marks are dropped
    (and config.json must not ask the export's load for a GGUF file)."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)


def write_tokenizer(info: GGUFInfo, out: Path) -> None:
    """tokenizer.json as transformers converts the file's vocabulary, and tokenizer_config.json
    holding the file's chat template(s): one place, whatever this transformers' save layout."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(info.path.parent), gguf_file=str(info.path))
    except Exception as exc:  # noqa: BLE001 - an unsupported tokenizer.ggml.model, a damaged vocabulary, ...
        raise GGUFError(f"transformers could not build the tokenizer of '{info.path}': {_one_line(exc)}") from None
    tok.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        raise GGUFError(f"the tokenizer of '{info.path}' has no fast (tokenizer.json) form")
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    (out / "chat_template.jinja").unlink(missing_ok=True)
    shutil.rmtree(out / "additional_chat_templates", ignore_errors=True)
    cfg.pop("chat_template", None)
    if info.chat_template is not None:
        cfg["chat_template"] = info.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")


def write_generation_config(info: GGUFInfo, out: Path) -> None:
    """generation_config.json from the file: every end-of-generation id llama.cpp stops at, and
    the sampling defaults when the file carries them (general.sampling.*)."""
    gen: dict = {}
    prev = out / "generation_config.json"
    if prev.is_file():  # what transformers derived from the config; ours overrides the ids
        gen = {k: v for k, v in json.loads(prev.read_text()).items() if k in ("bos_token_id", "pad_token_id")}
    if info.bos_token_id is not None:
        gen["bos_token_id"] = info.bos_token_id
    if info.pad_token_id is not None:
        gen["pad_token_id"] = info.pad_token_id
    if info.eos_token_ids:
        gen["eos_token_id"] = info.eos_token_ids[0] if len(info.eos_token_ids) == 1 else info.eos_token_ids
    if info.sampling:
        gen.update(do_sample=True, **info.sampling)
    prev.write_text(json.dumps(gen, indent=2))
