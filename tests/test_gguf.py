"""GGUF files as export input: tiny random models written as GGUF (llama.cpp's tensor names and
metadata, the tests' BPE tokenizer), exported, and compared with transformers on the same file."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from chat_templates import CHATML
from helpers import make_chat_tokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

PROMPTS = [[5, 17, 42, 99, 3], [200, 201, 202, 7, 7, 7, 9, 310]]
VOCAB = 320
# transformers' module names -> llama.cpp's (convert_hf_to_gguf.py)
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    parts = hf_name.split(".")  # model.layers.<i>.<module...>.<weight|bias>
    return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: llama.cpp rotates interleaved pairs, HF halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    cfg = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=0, pad_token_id=0,
              tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # peaky outputs; norms away from 1 so a mix-up would show
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.08)
    return model


def write_gguf(model, tok_dir, path, arch: str, matrix_type: str = "F32") -> None:
    """``model`` as llama.cpp would write it: 1-D tensors in F32, matrices in ``matrix_type``
    (F32, F16 or Q8_0), Llama's q/k rows permuted, the tokenizer as a gpt2 (byte-level BPE) vocabulary."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[matrix_type])

    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    tokens = [""] * VOCAB
    for text, i in tj["model"]["vocab"].items():
        tokens[i] = text
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(VOCAB)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHATML)

    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            a = llama_permute(a, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if a.ndim == 1 or matrix_type == "F32" or name == "model.embed_tokens.weight":
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
        elif matrix_type == "F16":
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a, dtype=np.float16))
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(a), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_greedy_from_gguf(path, prompt, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> dict:
    """A tiny Qwen2 GGUF (Q8_0 matrices) exported as target and draft into a bundle."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("gguf_qwen")
    tok = make_chat_tokenizer(base / "tok", "chatml", VOCAB)
    path = base / "tiny-qwen2-q8_0.gguf"
    write_gguf(random_model("qwen2"), tok, path, "qwen2", "Q8_0")
    cache = base / "cache"
    manifest = export_pair(path, path, base / "bundle", ExportOptions(progress=False, gguf_cache=cache))
    return {"path": path, "cache": cache, "bundle": base / "bundle", "manifest": manifest, "base": base}


def test_qwen2_gguf_bundle_matches_transformers(qwen):
    import specdec_rt

    gen = specdec_rt.load(qwen["bundle"], threads=1)
    for prompt in PROMPTS:
        ref = hf_greedy_from_gguf(qwen["path"], prompt, 24)
        assert gen.generate_ids(prompt, max_new_tokens=24, drafter=None, ignore_eos=True) == ref
        assert gen.generate_ids(prompt, max_new_tokens=24, num_draft_tokens=3, drafter="model", ignore_eos=True) == ref
    assert gen.last_stats.acceptance_rate == 1.0  # the draft is the same file


def test_manifest_records_the_gguf_source(qwen):
    from specdec_rt.export.gguf_source import SOURCE_FILE

    for role in ("target", "draft"):
        src = qwen["manifest"]["models"][role]["source"]
        assert src["format"] == "gguf"
        assert src["path"] == str(qwen["path"].absolute())
        assert src["bytes"] == qwen["path"].stat().st_size
        assert src["file_type"] == "Q8_0"
        assert src["architecture"] == "qwen2"
        assert src["dtype"] == "float32"  # Q8_0 values are float32 products: never rounded to a half type
    (folder,) = [p for p in qwen["cache"].iterdir()]  # one conversion for both roles, no temp left over
    assert (folder / SOURCE_FILE).is_file() and not folder.name.startswith(".")
    assert qwen["manifest"]["models"]["target"]["source"]["checkpoint"] == str(folder.resolve())


def test_chat_template_and_end_of_generation_ids_come_from_the_file(qwen):
    tok = json.loads((qwen["bundle"] / "tokenizer.json").read_text())
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    manifest = qwen["manifest"]
    eos = manifest["special_tokens"]["eos_token_ids"]
    assert eos[0] == ids["<|im_end|>"] and ids["<|endoftext|>"] in eos  # llama.cpp stops at both
    assert (qwen["bundle"] / manifest["chat"]["template"]).read_text() == CHATML
    import specdec_rt

    gen = specdec_rt.load(qwen["bundle"], threads=1)
    text = gen.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_second_export_reuses_the_cache(qwen, monkeypatch):
    from specdec_rt.export import gguf_source
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(gguf_source, "convert", no_conversion)
    monkeypatch.setattr(gguf_source, "read_gguf", no_conversion)  # a cache hit does not even read the header
    manifest = export_pair(qwen["path"], None, qwen["base"] / "bundle2",
                           ExportOptions(progress=False, validate=False, gguf_cache=qwen["cache"]))
    assert manifest["models"]["target"]["source"]["path"] == str(qwen["path"].absolute())


def test_llama_f16_gguf_unpermutes_and_stays_half(tmp_path):
    """Llama's q/k rows are permuted in the file; the converted folder holds the original weights,
    in float16 (every weight of an F16 file survives the round trip), and the bundle matches transformers."""
    import specdec_rt
    from transformers import AutoModelForCausalLM

    from specdec_rt.export.pipeline import ExportOptions, export_pair

    model = random_model("llama", seed=1)
    with torch.no_grad():  # values an F16 file holds exactly, so the folder can be compared bit for bit
        for p in model.parameters():
            p.copy_(p.half().float())
    tok = make_chat_tokenizer(tmp_path / "tok", "chatml", VOCAB)
    path = tmp_path / "tiny-llama-f16.gguf"
    write_gguf(model, tok, path, "llama", "F16")
    manifest = export_pair(path, None, tmp_path / "bundle", ExportOptions(progress=False, gguf_cache=tmp_path / "c"))
    src = manifest["models"]["target"]["source"]
    assert (src["format"], src["file_type"], src["architecture"], src["dtype"]) == ("gguf", "F16", "llama", "float16")
    converted = AutoModelForCausalLM.from_pretrained(src["checkpoint"], dtype=torch.float32)
    for name, t in model.state_dict().items():
        assert torch.equal(converted.state_dict()[name], t), name
    gen = specdec_rt.load(tmp_path / "bundle", threads=1)
    assert gen.generate_ids(PROMPTS[0], max_new_tokens=20, drafter=None, ignore_eos=True) == \
        hf_greedy_from_gguf(path, PROMPTS[0], 20)


def test_interrupted_conversion_is_never_reused(qwen, tmp_path, monkeypatch):
    """A conversion killed half-way leaves no folder an export would take for a finished one: the
    next export converts again (and clears a dead process's temporary folder)."""
    from specdec_rt.export import gguf_source

    cache = tmp_path / "cache"
    real = gguf_source.write_checkpoint

    def interrupted(info, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_source, "write_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_source.resolve_checkpoint(qwen["path"], cache, progress=False)
    assert list(cache.iterdir()) == []
    dest = cache / gguf_source.cache_key(qwen["path"].absolute())
    stale = cache / f".{dest.name}.tmp-999999999"  # a killed process's leftovers
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_source, "write_checkpoint", real)
    assert gguf_source.resolve_checkpoint(qwen["path"], cache, progress=False) == dest
    assert sorted(p.name for p in cache.iterdir()) == [dest.name]
    assert gguf_source.read_source_record(dest)["source"]["path"] == str(qwen["path"].absolute())


# -- errors -------------------------------------------------------------------------------------------

def _export_cli(capsys, *args) -> tuple[int, str]:
    from specdec_rt.cli.export_cli import main

    rc = main(["--quiet", *map(str, args)])
    return rc, capsys.readouterr().err


def test_truncated_gguf_is_one_clear_error(qwen, tmp_path, capsys):
    from specdec_rt.errors import ExportError, GGUFError
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    data = qwen["path"].read_bytes()
    for cut in (40, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut-{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated or corrupt|is truncated"):
            export_pair(bad, None, tmp_path / "out", ExportOptions(progress=False, gguf_cache=tmp_path / "c"))
    rc, err = _export_cli(capsys, "--target", bad, "--out", tmp_path / "out", "--gguf-cache", tmp_path / "c")
    assert rc == 1 and err.startswith("error: ") and "truncated" in err and err.count("\n") == 1
    assert issubclass(GGUFError, ExportError)
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").iterdir())  # nothing cached


def test_not_a_gguf_file(tmp_path):
    from specdec_rt.errors import GGUFError
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        export_pair(bad, None, tmp_path / "out", ExportOptions(progress=False, gguf_cache=tmp_path / "c"))
    with pytest.raises(GGUFError, match="does not exist"):
        export_pair(tmp_path / "missing.gguf", None, tmp_path / "out", ExportOptions(progress=False))


def _header_only_gguf(path, arch: str) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch, why", [("mamba", "not supported by the exporter"),
                                       ("rwkv6", "cannot be loaded by transformers")])
def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path, capsys, arch, why):
    from specdec_rt.errors import ExportError, UnsupportedArchitectureError
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    path = tmp_path / f"{arch}.gguf"
    _header_only_gguf(path, arch)
    with pytest.raises(ExportError) as info:
        export_pair(path, None, tmp_path / "out", ExportOptions(progress=False, gguf_cache=tmp_path / "c"))
    msg = str(info.value)
    assert f"'{arch}'" in msg and why in msg and "qwen2" in msg and "llama" in msg
    assert isinstance(info.value, UnsupportedArchitectureError)
    rc, err = _export_cli(capsys, "--target", path, "--out", tmp_path / "out", "--gguf-cache", tmp_path / "c")
    assert rc == 1 and err.count("\n") == 1 and why in err


def test_missing_package_names_the_extra(qwen, tmp_path, monkeypatch):
    from specdec_rt.errors import GGUFError
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate -> ImportError
    with pytest.raises(GGUFError, match=r"'accelerate' package.*specdec-rt\[export\]"):
        export_pair(qwen["path"], None, tmp_path / "out", ExportOptions(progress=False, gguf_cache=tmp_path / "c"))
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(GGUFError, match=r"'gguf' package.*specdec-rt\[export\]"):
        export_pair(qwen["path"], None, tmp_path / "out", ExportOptions(progress=False, gguf_cache=tmp_path / "c"))
