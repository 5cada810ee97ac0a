"""The export at scale, checked on tiny models: bf16 checkpoints, streamed external data, weights
quantized as the graph is built, the embedding stored once (tied) and quantized, memory figures.

The scale runs themselves (Qwen2.5-0.5B / 1.5B configs) are a benchmark, not a test:
scripts/bench_scale.sh, docs/benchmarks.md ("Scale").
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_checkpoint  # noqa: E402
from test_architectures import VOCAB, _config  # noqa: E402

BF16_FAMILIES = ["llama", "qwen2", "gemma", "gemma3_text", "granite", "phi3_longrope", "phi4_mini", "olmo2",
                 "starcoder2", "gpt2", "gpt_neox"]


def _bf16_checkpoint(name: str, root: Path) -> Path:
    """A tiny checkpoint of family ``name`` saved in bfloat16 (as the hub ships most models)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = root / f"{name}_bf16"
    if not (out / "config.json").is_file():
        fp32 = make_checkpoint(_config(name), root / f"{name}_fp32", tokenizer_vocab=VOCAB)
        model = AutoModelForCausalLM.from_pretrained(str(fp32), dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(str(out))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (out / f).write_bytes((fp32 / f).read_bytes())
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scale")


@pytest.mark.filterwarnings("ignore:longrope")
@pytest.mark.parametrize("blockwise", [False, True], ids=["whole", "blockwise"])
@pytest.mark.parametrize("name", BF16_FAMILIES)
def test_bf16_model_computes_exactly_as_float32(root, name, blockwise, monkeypatch):
    """The exporter loads a bf16 checkpoint in bf16 (half the memory) and computes the validation
    reference in float32 one module at a time: bit for bit what a float32 load computes, also
    when large weights run as row blocks / looked-up rows instead of whole upcasts."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_rt.export import validate
    from specdec_rt.export.pipeline import _load_torch_model
    from specdec_rt.export.validate import float32_compute

    if blockwise:  # LM head, embedding and MLP weights in blocks of 32 rows (real: >= 512 rows);
        # measured bit for bit from 32 rows up, not for blocks of 16 or fewer (other BLAS kernels)
        monkeypatch.setattr(validate, "LARGE_WEIGHT", 8192)

    ckpt = _bf16_checkpoint(name, root)
    half = _load_torch_model(ckpt)
    assert next(half.parameters()).dtype == torch.bfloat16
    full = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    full.config._attn_implementation = "eager"
    ids = torch.tensor([[5, 17, 42, 99, 3, 7, 200, 1], [9, 8, 7, 6, 5, 4, 3, 2]])
    with torch.no_grad(), float32_compute(half):
        ours = half(ids).logits
    with torch.no_grad():
        ref = full(ids).logits
    assert ours.dtype == torch.float32
    assert torch.equal(ours, ref), float((ours - ref).abs().max())
    assert next(half.parameters()).dtype == torch.bfloat16  # put back after each module


def test_bf16_checkpoint_exports_exactly(root):
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    ckpt = _bf16_checkpoint("qwen2", root)
    manifest = export_pair(ckpt, None, root / "qwen2_bf16_bundle", ExportOptions(progress=False))
    info = manifest["models"]["target"]
    assert info["source"]["dtype"] == "bfloat16"
    assert info["validation"]["max_logit_error"] < 1e-4 and info["validation"]["top1_agreement"] == 1.0


def _graph(bundle: Path, role: str = "target"):
    import onnx

    return onnx.load(str(bundle / role / "model.onnx"), load_external_data=False)


def test_external_data_is_one_aligned_file_beside_the_graph(tiny_pair):
    """Initializers are streamed into one file, ``model.onnx.data``, at relative offsets; large ones
    64 KiB-aligned; the .onnx file itself holds only the graph and small constants."""
    from specdec_rt.runtime.core.bundle import external_data_locations

    bundle = Path(tiny_pair["bundle"])
    model = _graph(bundle)
    assert set(external_data_locations(bundle / "target" / "model.onnx")) == {"model.onnx.data"}
    data_size = (bundle / "target" / "model.onnx.data").stat().st_size
    external = 0
    for t in model.graph.initializer:
        entries = {e.key: e.value for e in t.external_data}
        if not entries:
            assert len(t.raw_data) < 1024
            continue
        external += 1
        offset, length = int(entries["offset"]), int(entries["length"])
        assert offset + length <= data_size
        if length >= 1 << 20:
            assert offset % (1 << 16) == 0
    assert external > 0
    assert (bundle / "target" / "model.onnx").stat().st_size < 64 * 1024


def test_tied_embedding_stored_once(root):
    """Tied embeddings (Qwen2.5-style): the LM head's matrix also serves the lookup (float graph:
    Gather on axis 1), so the graph holds V x hidden once; quantized: GatherBlockQuantized reads the
    LM head's packed int4 table."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    cfg = _config("qwen2")
    cfg.tie_word_embeddings = True
    ckpt = make_checkpoint(cfg, root / "qwen2_tied", tokenizer_vocab=VOCAB)
    sizes = {}
    for quant in (None, "int4"):
        out = root / f"qwen2_tied_{quant}"
        manifest = export_pair(ckpt, None, out, ExportOptions(progress=False, quantize=quant))
        info = manifest["models"]["target"]
        model = _graph(out)
        vocab_tables = [t for t in model.graph.initializer if VOCAB in t.dims]
        assert len(vocab_tables) == (1 if quant is None else 2), [t.name for t in vocab_tables]  # int4: table + scales
        ops = {n.op_type: n for n in model.graph.node}
        if quant is None:
            assert ops["Gather"].input[0] == [n for n in model.graph.node if n.name.startswith("lm_head")][0].input[1]
        else:
            gbq = ops["GatherBlockQuantized"]
            lm = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("lm_head")][0]
            assert gbq.input[0] == lm.input[1]
            assert info["validation"]["quantized"]["top1_agreement"] > 0.5
        sizes[quant] = info["size_bytes"]
    assert sizes["int4"] < 0.25 * sizes[None]


def test_quantized_as_built_equals_onnxruntime_quantizer(root, monkeypatch):
    """Weights quantized while the graph is built (the LM head in vocabulary blocks, here of 4 KiB)
    are byte for byte what ONNX Runtime's MatMulNBitsQuantizer writes for the float graph (int4
    and int8, block 32, symmetric)."""
    from onnx import numpy_helper

    from specdec_rt.export import graph
    from specdec_rt.export.arch import extract
    from specdec_rt.export.graph import GraphOptions, build_model
    from specdec_rt.export.pipeline import _load_torch_model
    from specdec_rt.export.quantize import quantize_weights

    model = _load_torch_model(make_checkpoint(_config("llama"), root / "llama_q", tokenizer_vocab=VOCAB))
    for scheme in ("int4", "int8"):
        spec, weights = extract(model, 256)
        with monkeypatch.context() as m:
            m.setattr(graph, "VOCAB_BLOCK_BYTES", 4096)
            ours = build_model(spec, weights, GraphOptions(quantize=scheme, quantize_embedding=False))
        spec, weights = extract(model, 256)
        theirs = quantize_weights(build_model(spec, weights, GraphOptions()), scheme)

        def nbits(m):
            inits = {t.name: t for t in m.graph.initializer}
            return [({a.name: a.i for a in n.attribute},
                     [numpy_helper.to_array(inits[i]) for i in n.input[1:3]])
                    for n in m.graph.node if n.op_type == "MatMulNBits"]

        a, b = nbits(ours), nbits(theirs)
        assert len(a) == len(b) == 1 + 4 * spec.num_layers  # qkv, o, gate_up, down per layer + lm_head
        for (attrs_a, (qa, sa)), (attrs_b, (qb, sb)) in zip(a, b):  # graph order: same layers
            assert attrs_a == attrs_b
            assert np.array_equal(qa.reshape(qb.shape), qb) and np.array_equal(sa.reshape(sb.shape), sb)


def test_quantized_embedding_matches_dequantized_table(root):
    """GatherBlockQuantized returns the dequantized rows of the packed table (untied model)."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from specdec_rt.export.pipeline import ExportOptions, export_pair
    from specdec_rt.export.quantize import dequantize_blockwise

    ckpt = make_checkpoint(_config("llama"), root / "llama_emb", tokenizer_vocab=VOCAB)
    out = root / "llama_emb_int4"
    export_pair(ckpt, None, out, ExportOptions(progress=False, quantize="int4", validate=False))
    model = _graph(out)
    gbq = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    embed_out = next(n for n in model.graph.node if n.input and n.input[0] == gbq.output[0]).output[0]
    model.graph.output.insert(0, helper.make_tensor_value_info(embed_out, 1, None))
    import onnx

    onnx.save(model, str(out / "target" / "probe.onnx"))
    from specdec_rt.runtime.engines.sessions import session_options  # the shared pool, if a test made one

    sess = ort.InferenceSession(str(out / "target" / "probe.onnx"), session_options(),
                                providers=["CPUExecutionProvider"])
    onnx.load_external_data_for_model(model, str(out / "target"))
    inits = {t.name: t for t in model.graph.initializer}
    packed = numpy_helper.to_array(inits[gbq.input[0]])
    scales_name = next(n for n in model.graph.node if n.output[0] == gbq.input[2]).input[0]
    table = dequantize_blockwise(packed, numpy_helper.to_array(inits[scales_name]), 4, 64).T  # [V, hidden]
    ids = np.array([[0, 5, 319, 42]])
    feed = {"input_ids": ids, "position_ids": np.arange(4)[None], "attention_mask": np.zeros((1, 1, 4, 4), np.float32)}
    for i in range(2):
        for kind in ("key", "value"):
            feed[f"past_{kind}.{i}"] = np.zeros((1, 0, 2, 16), np.float32)
    rows = sess.run([embed_out], feed)[0]
    assert np.allclose(rows[0], table[ids[0]], atol=1e-6)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(ckpt)).model.embed_tokens.weight.detach().numpy()
    # symmetric int4, 16 levels of max|block| / 8: at most one step off (the top level clips)
    assert np.abs(table - ref).max() <= np.abs(ref).max() / 8 + 1e-6


def test_fp16_overflow_is_refused(root):
    """A weight beyond float16's range cannot become an fp16 graph silently (it would be inf)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_rt.export.pipeline import ExportError, ExportOptions, export_pair

    src = make_checkpoint(_config("llama"), root / "llama_big", tokenizer_vocab=VOCAB)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = 1e5
    big = root / "llama_big_bf16"
    model.to(torch.bfloat16).save_pretrained(str(big))
    (big / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    with pytest.raises(ExportError, match=r"l1_down.*float16.*--dtype fp32") as err:
        export_pair(big, None, root / "big_out", ExportOptions(progress=False, dtype="fp16"))
    assert "\n" not in str(err.value)


def test_manifest_records_memory_and_stage_times(tiny_pair):
    manifest = json.loads((Path(tiny_pair["bundle"]) / "manifest.json").read_text())
    assert manifest["export_peak_rss_bytes"] > 50 * 2**20
    for role in ("target", "draft"):
        info = manifest["models"][role]
        assert 0 < info["export_peak_rss_bytes"] <= manifest["export_peak_rss_bytes"] * 1.05
        assert set(info["validation"]["seconds"]) == {"reference", "session", "cases"}
    assert {"load target", "reference target", "build target", "validate target"} <= set(manifest["stage_seconds"])
    assert set(manifest["stage_peak_rss_bytes"]) == set(manifest["stage_seconds"])


@pytest.mark.parametrize("quant", [None, "int4"])
@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "granite"])
def test_vocabulary_blocks_write_the_same_bytes(root, name, quant, monkeypatch):
    """Embedding and LM head converted (and quantized) in blocks of rows / columns: the external
    data is byte for byte the same as in one block (untied, tied, tied with a folded multiplier)."""
    from specdec_rt.export import graph
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    cfg = _config("qwen2" if name == "qwen2_tied" else name)
    cfg.tie_word_embeddings = name != "llama"
    ckpt = make_checkpoint(cfg, root / f"blocks_{name}", tokenizer_vocab=VOCAB)
    data = []
    for block_bytes in (1 << 30, 4096):
        monkeypatch.setattr(graph, "VOCAB_BLOCK_BYTES", block_bytes)
        out = root / f"blocks_{name}_{quant}_{block_bytes}"
        export_pair(ckpt, None, out, ExportOptions(progress=False, quantize=quant, validate=False))
        data.append((out / "target" / "model.onnx.data").read_bytes())
    assert data[0] == data[1]
