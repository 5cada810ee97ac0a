"""The bundle: a self-describing directory the runtime loads with nothing else.

Loading refuses anything it cannot trust before a single ONNX Runtime session is created:
unknown format versions, missing files, checksum mismatches, draft/target vocabularies that
disagree, and ONNX external-data locations that escape the bundle directory (ONNX external data
has had path-traversal CVEs; the runtime has no ``onnx`` package, so a minimal protobuf reader
below extracts the locations).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from specdec_rt.errors import BundleError  # noqa: F401 - defined there, re-exported here

FORMAT_NAME = "specdec-rt-bundle"
FORMAT_VERSION = 1
CONTRACT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass
class ModelInfo:
    """What the runtime needs to know about one graph of the bundle."""

    role: str
    graph: str
    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int
    dtype: str
    kv_dtype: str
    max_positions: int
    sliding_window: int | None = None
    quantization: str | None = None
    opset: int = 17
    fused_ops: bool = True
    fused_attention: bool = False  # one ONNX Attention node per layer (opset 23; drafts since issue 12)
    num_parameters: int = 0
    validation: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)
    # EAGLE-3 heads (issue 22): the target's extra ``features`` output (0-based layers whose
    # outputs it concatenates); the head's fc graph, draft vocabulary and features width
    feature_layers: list[int] | None = None
    fc_graph: str | None = None
    draft_vocab_size: int | None = None
    features_dim: int | None = None

    @classmethod
    def from_dict(cls, role: str, d: dict) -> "ModelInfo":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "role"}
        try:
            return cls(role=role, **known)
        except TypeError as exc:
            raise BundleError(f"manifest entry for '{role}' is incomplete: {exc}") from None


@dataclass
class Bundle:
    root: Path
    manifest: dict
    target: ModelInfo
    draft: ModelInfo | None
    max_context: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    # chat: the target tokenizer's template (one string, or {name: template}), the special-token
    # strings templates refer to (bos_token, eos_token, ...), and generation_config.json as a dict.
    # All None / empty for bundles exported before they were recorded.
    chat_template: str | dict[str, str] | None = None
    special_token_strings: dict = field(default_factory=dict)
    generation_config: dict | None = None
    head: ModelInfo | None = None  # an EAGLE-3 feature head (drafter="eagle"), if exported with one

    @property
    def tokenizer_path(self) -> Path:
        return self.root / self.manifest["tokenizer"]

    def graph_path(self, role: str) -> Path:
        info = {"target": self.target, "draft": self.draft, "head": self.head}.get(role)
        if info is None:
            raise BundleError(f"this bundle has no {role} model")
        return self.root / info.graph


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


# -- minimal protobuf reader for ONNX external-data locations ---------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise BundleError("truncated protobuf in ONNX graph")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes):
    """Yield (field_number, wire_type, value) of one protobuf message."""
    pos = 0
    n = len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, pos = _varint(buf, pos)
        elif wire == 1:
            val, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            val, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            val, pos = buf[pos:pos + 4], pos + 4
        else:
            raise BundleError(f"unsupported protobuf wire type {wire} in ONNX graph")
        if pos > n:
            raise BundleError("truncated protobuf in ONNX graph")
        yield num, wire, val


def _tensor_locations(tensor: bytes, out: list[str]) -> None:
    # TensorProto.external_data = 13 (StringStringEntryProto: key = 1, value = 2)
    for num, wire, val in _fields(tensor):
        if num == 13 and wire == 2:
            entry = dict((k, v) for k, _, v in _fields(val))
            if entry.get(1) == b"location" and 2 in entry:
                out.append(entry[2].decode("utf-8", "replace"))


def _graph_locations(graph: bytes, out: list[str]) -> None:
    # GraphProto.initializer = 5, node = 1 (NodeProto.attribute = 5: AttributeProto.t = 5,
    # .g = 6, .tensors = 10, .graphs = 11)
    for num, wire, val in _fields(graph):
        if wire != 2:
            continue
        if num == 5:
            _tensor_locations(val, out)
        elif num == 1:
            for anum, awire, aval in _fields(val):
                if anum == 5 and awire == 2:
                    for fnum, fwire, fval in _fields(aval):
                        if fwire == 2 and fnum in (5, 10):
                            _tensor_locations(fval, out)
                        elif fwire == 2 and fnum in (6, 11):
                            _graph_locations(fval, out)


def external_data_locations(onnx_path: Path) -> list[str]:
    """All external-data file locations referenced by an ONNX model file."""
    data = Path(onnx_path).read_bytes()
    out: list[str] = []
    for num, wire, val in _fields(data):
        if num == 7 and wire == 2:  # ModelProto.graph
            _graph_locations(val, out)
    return out


def check_external_data(onnx_path: Path, root: Path) -> None:
    base = Path(onnx_path).parent.resolve()
    root = root.resolve()
    for loc in set(external_data_locations(onnx_path)):
        target = (base / loc).resolve()
        if os.path.isabs(loc) or root not in target.parents:
            raise BundleError(
                f"{Path(onnx_path).name}: external data location '{loc}' points outside the bundle "
                f"directory {root}; refusing to load (possible path traversal)"
            )
        if not target.is_file():
            raise BundleError(f"{Path(onnx_path).name}: external data file '{loc}' is missing")


# -- loading -----------------------------------------------------------------------------------

def load_bundle(path: str | os.PathLike, verify_checksums: bool = True) -> Bundle:
    """Read and validate a bundle directory; raise :class:`BundleError` with the reason."""
    root = Path(path)
    if not root.is_dir():
        raise BundleError(f"bundle directory '{root}' does not exist")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise BundleError(f"'{root}' is not a specdec-rt bundle: {MANIFEST} is missing")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{mpath} is not valid JSON: {exc}") from None
    if manifest.get("format") != FORMAT_NAME:
        raise BundleError(f"{mpath}: not a specdec-rt manifest (format={manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise BundleError(
            f"{mpath}: bundle format version {manifest.get('format_version')} is not supported "
            f"by this runtime (expects {FORMAT_VERSION}); re-export with this version of specdec-rt"
        )
    if manifest.get("contract_version") != CONTRACT_VERSION:
        raise BundleError(f"{mpath}: graph contract version {manifest.get('contract_version')} != {CONTRACT_VERSION}")

    files: dict[str, str] = manifest.get("files", {})
    for rel, digest in files.items():
        fpath = (root / rel).resolve()
        if root.resolve() not in fpath.parents:
            raise BundleError(f"manifest lists '{rel}', which lies outside the bundle")
        if not fpath.is_file():
            raise BundleError(f"bundle file '{rel}' is missing")
        if verify_checksums and sha256_file(fpath) != digest:
            raise BundleError(f"bundle file '{rel}' does not match its sha256 in the manifest "
                              "(corrupt or modified); re-export the bundle")

    models = manifest.get("models", {})
    if "target" not in models:
        raise BundleError(f"{mpath}: no target model in the manifest")
    target = ModelInfo.from_dict("target", models["target"])
    draft = ModelInfo.from_dict("draft", models["draft"]) if models.get("draft") else None
    head = ModelInfo.from_dict("head", models["head"]) if models.get("head") else None
    if head is not None:
        check_head(target, head)
    for info in filter(None, (target, draft, head)):
        for graph in filter(None, (info.graph, info.fc_graph)):
            if graph not in files:
                raise BundleError(f"graph '{graph}' is not covered by the manifest's checksums")
            check_external_data(root / graph, root)
    if draft is not None and manifest.get("tokenizer_hashes", {}).get("draft") not in (
            None, manifest.get("tokenizer_hashes", {}).get("target")):
        raise BundleError("draft and target tokenizers differ; this bundle cannot be used")
    tok = manifest.get("tokenizer")
    if not tok or tok not in files:
        raise BundleError(f"{mpath}: tokenizer file missing from the manifest")
    special = manifest.get("special_tokens", {})
    chat = manifest.get("chat") or {}
    if not isinstance(chat, dict):
        raise BundleError(f"{mpath}: 'chat' must be an object")
    template = chat.get("template")
    if isinstance(template, str):
        chat_template = _read_text(root, files, template, "chat template")
    elif isinstance(template, dict):
        chat_template = {str(name): _read_text(root, files, rel, f"chat template '{name}'")
                         for name, rel in template.items()}
    elif template is None:
        chat_template = None
    else:
        raise BundleError(f"{mpath}: chat.template must be a file name or an object of them")
    strings = chat.get("special_tokens", {})
    if not isinstance(strings, dict):
        raise BundleError(f"{mpath}: chat.special_tokens must be an object")
    gen_config = None
    if manifest.get("generation_config"):
        text = _read_text(root, files, manifest["generation_config"], "generation config")
        try:
            gen_config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BundleError(f"{manifest['generation_config']} is not valid JSON: {exc}") from None
        if not isinstance(gen_config, dict):
            raise BundleError(f"{manifest['generation_config']} must hold a JSON object")
    return Bundle(
        root=root, manifest=manifest, target=target, draft=draft,
        max_context=int(manifest["max_context"]),
        eos_token_ids=list(special.get("eos_token_ids", [])),
        bos_token_id=special.get("bos_token_id"), pad_token_id=special.get("pad_token_id"),
        chat_template=chat_template, special_token_strings=dict(strings), generation_config=gen_config,
        head=head,
    )


def check_head(target: ModelInfo, head: ModelInfo) -> None:
    """A head entry must fit its target: same vocabulary, the features the target outputs."""
    if not head.fc_graph:
        raise BundleError("manifest entry for 'head' names no fc_graph")
    if head.vocab_size != target.vocab_size:
        raise BundleError(f"the EAGLE-3 head's vocabulary ({head.vocab_size}) differs from the target's "
                          f"({target.vocab_size})")
    if not target.feature_layers or list(target.feature_layers) != list(head.feature_layers or []):
        raise BundleError(f"the target graph outputs features of layers {target.feature_layers}, the head "
                          f"reads layers {head.feature_layers}; re-export with specdec-export --draft-head")
    want = len(target.feature_layers) * target.hidden_size
    if head.features_dim not in (None, want):
        raise BundleError(f"the head reads {head.features_dim} feature values per token, the target "
                          f"outputs {want}")


def _read_text(root: Path, files: dict[str, str], rel: object, what: str) -> str:
    """A small text file of the bundle; it must be covered by the manifest's checksums."""
    if not isinstance(rel, str) or rel not in files:
        raise BundleError(f"{what} file {rel!r} is not covered by the manifest's checksums")
    try:
        return (root / rel).read_bytes().decode("utf-8")  # bytes as written: no newline translation
    except UnicodeDecodeError as exc:
        raise BundleError(f"bundle file '{rel}' is not UTF-8 text: {exc}") from None
