"""Bit-level exactness of verify rows: why greedy speculation can promise token identity.

A greedy speculative run equals target-only decoding only if the target computes every token's
logits (and K/V) bit for bit as it does one token at a time. Two things broke that at 0.5B
scale with int4 weights (issue 13: every tree run differed, chains did not):

1. Tree rows see their ancestors at other cache columns than sequential decoding does (masked
   siblings leave holes), and float32 Softmax / MatMul reductions group terms by column: the
   rows differ in the last bits. int4 MatMulNBits quantizes activations to int8 (accuracy level
   4), which turns last-bit differences into 1e-2 logit differences and flipped argmaxes.
   Fixed in the graph: attention sums over keys in float64 (``attention_accumulation``).
2. MatMulNBits runs a different kernel for one row than for several: target-only decoding
   (S = 1) and verification (S > 1) differ. Fixed at load: the runtime measures it and pads
   one-row calls to two rows (``probe_row_invariance``).

These tests check the rows themselves (deterministic, no reliance on near-ties), at the
smallest scale that showed both effects, plus the token-level outcome.
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers import make_tiny_vocab_checkpoint

VOCAB = 512


def _qwen2_config(hidden: int, layers: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=0)


@pytest.fixture(scope="module")
def quant_bundles(tmp_path_factory) -> dict:
    """A tiny Qwen2-shaped target (fp32, int4, w8a8) with a weak random draft."""
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    base = tmp_path_factory.mktemp("row_exactness")
    target = make_tiny_vocab_checkpoint(_qwen2_config(128, 2), base / "target", seed=11, scale=0.08)
    draft = make_tiny_vocab_checkpoint(_qwen2_config(64, 1), base / "draft", seed=12, scale=0.08)
    out = {}
    for name, quant, attention in (("fp32", None, "fp64"), ("int4", "int4", "fp64"), ("w8a8", "w8a8", "fp64"),
                                   ("fused", None, "fused")):
        out[name] = base / name
        # w8a8: the target's integer GEMMs with an int4 draft (--draft-quantize), as deployed
        export_pair(target, draft, out[name], ExportOptions(progress=False, quantize=quant, quantize_roles=("target",),
                                                            target_attention=attention,
                                                            draft_quantize="int4" if quant == "w8a8" else "auto"))
    return out


def _rows(engine, prompt, path, side):
    """Logits rows of ``path`` computed one token at a time, as a chain, and inside a tree whose
    backbone is ``path`` with a sibling (from ``side``) at every depth, interleaved (holes)."""
    from specdec_rt.runtime.core.masks import causal_mask, tree_mask
    from specdec_rt.runtime.loop.tree_step import TreeNode as _Node, tree_visibility as _tree_visibility

    n = len(prompt)
    engine.reset()
    pos = np.arange(n)
    engine.forward(np.array(prompt), pos, causal_mask(0, pos))
    engine.commit(n)
    sequential = []
    for tok in path:
        p = engine.length
        sequential.append(engine.forward(np.array([tok]), np.array([p]), causal_mask(p, np.array([p])))[0].copy())
        engine.commit(1)
    engine.rollback(n)
    pos = np.arange(n, n + len(path))
    chain = engine.forward(np.array(path), pos, causal_mask(n, pos)).copy()
    nodes, backbone = [_Node(path[0], -1, 0, 0.0)], [0]
    for d in range(1, len(path)):
        nodes.append(_Node(path[d], backbone[-1], d, 0.0))
        nodes.append(_Node(side[d - 1], backbone[-1], d, 0.0))
        backbone.append(len(nodes) - 2)
    depth = np.array([node.depth for node in nodes])
    mask = tree_mask(n, np.zeros((len(nodes), 0), bool), n + depth, None, new_block=_tree_visibility(nodes))
    tree = engine.forward(np.array([node.token for node in nodes]), n + depth, mask)[backbone].copy()
    engine.reset()
    return np.stack(sequential), chain, tree


@pytest.mark.parametrize("precision", ["fp32", "int4", "w8a8"])
def test_chain_and_tree_rows_equal_sequential_rows_bit_for_bit(quant_bundles, precision):
    import specdec_rt

    gen = specdec_rt.load(quant_bundles[precision], threads=1)
    rng = np.random.default_rng(5)
    for _ in range(3):
        prompt, path, side = (rng.integers(1, VOCAB, n).tolist() for n in (9, 6, 5))
        sequential, chain, tree = _rows(gen.target, prompt, path, side)
        assert np.array_equal(chain, sequential), np.abs(chain - sequential).max()
        assert np.array_equal(tree, sequential), np.abs(tree - sequential).max()


def test_probe_pads_one_row_calls_where_kernels_differ(quant_bundles):
    """Whatever this CPU's kernels do, after the probe a one-row call equals a verify row."""
    import specdec_rt
    from specdec_rt.runtime.core.masks import causal_mask

    gen = specdec_rt.load(quant_bundles["int4"], threads=1)
    eng = gen.target
    assert eng.min_rows in (1, 2)
    toks = np.array([3, 30, 300, 7, 70])
    eng.reset()
    eng.forward(toks[:3], np.arange(3), causal_mask(0, np.arange(3)))
    eng.commit(3)
    one = eng.forward(toks[3:4], np.array([3]), causal_mask(3, np.array([3])))[0].copy()
    two = eng.forward(toks[3:5], np.array([3, 4]), causal_mask(3, np.array([3, 4])))[0].copy()
    assert np.array_equal(one, two)
    # ... and the padding really is needed for int4 here (a probe that never pads would hide it)
    unprobed = specdec_rt.load(quant_bundles["int4"], threads=1, probe_rows=False)
    assert unprobed.target.min_rows == 1


def test_w8a8_one_row_calls_need_no_padding(quant_bundles):
    """W8A8 multiplies integers (per-row int8 activations x int7 weights, int32 sums), so a
    row's logits cannot depend on the call's other rows: the probe must find one-row calls
    equal to verify rows on every CPU and leave them unpadded (int4's tax, gone)."""
    import specdec_rt
    from specdec_rt.runtime.core.masks import causal_mask

    gen = specdec_rt.load(quant_bundles["w8a8"], threads=2)
    eng = gen.target
    assert eng.min_rows == 1
    toks = np.array([3, 30, 300, 7, 70, 77, 400])
    eng.reset()
    eng.forward(toks[:3], np.arange(3), causal_mask(0, np.arange(3)))
    eng.commit(3)
    one = eng.forward(toks[3:4], np.array([3]), causal_mask(3, np.array([3])))[0].copy()
    for width in (2, 4):
        pos = np.arange(3, 3 + width)
        assert np.array_equal(one, eng.forward(toks[3:3 + width], pos, causal_mask(3, pos))[0])


@pytest.mark.parametrize("precision", ["fp32", "int4", "w8a8", "fused"])
def test_prefill_keeps_only_the_last_rows_and_their_bits(quant_bundles, precision):
    """``logits_to_keep`` (a prefill computes its last rows' logits only): the kept rows are the
    bits of the same rows in a full call, the optional input's default keeps every row, and
    ``extend`` (a prompt, in chunks) ends on the logits a full call gives its last token."""
    import specdec_rt
    from specdec_rt.runtime.core.masks import causal_mask

    gen = specdec_rt.load(quant_bundles[precision], threads=1)
    for eng in (gen.target, gen.draft_engine):
        assert eng.keeps_last_rows
        toks = np.array([3, 30, 300, 7, 70, 77, 400, 5, 50])
        pos = np.arange(len(toks))
        eng.reset()
        full = eng.forward(toks, pos, causal_mask(0, pos)).copy()
        assert full.shape[0] == len(toks)  # the default: every row
        # (an unprobed int4 draft's one-row kernel gives other bits: the draft only proposes)
        for rows in sorted({max(1, eng.min_rows) if eng is gen.target else 2, 2, 4}):
            kept = eng.forward_last(toks, pos, causal_mask(0, pos), rows).copy()
            assert kept.shape[0] == rows
            assert np.array_equal(kept, full[-rows:]), (eng.info.role, rows)
        eng.reset()
        row = eng.extend(toks)
        assert eng.length == len(toks)
        if eng is not gen.target:  # one kept row of an int4 draft: its one-row kernel's bits
            assert np.allclose(row, full[-1], atol=1e-3 * np.abs(full[-1]).max())
            continue
        assert np.array_equal(row, full[-1])
        eng.reset()  # in chunks: the last chunk's kept row is its row in a full call of that chunk
        eng.forward(toks[:5], pos[:5], causal_mask(0, pos[:5]))
        eng.commit(5)
        last = eng.forward(toks[5:], pos[5:], causal_mask(5, pos[5:]))[-1].copy()
        eng.reset()
        assert np.array_equal(eng.extend(toks, chunk=5), last)
        eng.reset()


def test_prefix_reuse_is_on_only_where_it_changes_no_bit(quant_bundles):
    """The prefix cache per precision: where the probe turns it on, a conversation's next turn
    (reusing its history's K/V, written while it was decoded) decodes the same tokens as a fresh
    prefill, greedy and speculative; where it does not, nothing is reused."""
    import specdec_rt

    on = []
    for precision in ("fp32", "int4", "w8a8", "fused"):
        gen = specdec_rt.load(quant_bundles[precision], threads=1)
        fresh = specdec_rt.load(quant_bundles[precision], threads=1, prefix_cache=False)
        if gen.prefix_cache:
            on.append(precision)
        for kw in (dict(drafter=None), dict(num_draft_tokens=4)):
            gen.clear_prefix_cache()
            ids = [3, 30, 300, 7, 70, 77, 400, 5, 50]
            for turn in range(3):
                out = gen.generate_ids(ids, max_new_tokens=20, temperature=0.0, ignore_eos=True, **kw)
                cached = gen.last_stats.cached_prompt_tokens
                assert out == fresh.generate_ids(ids, max_new_tokens=20, temperature=0.0, ignore_eos=True, **kw), \
                    (precision, kw, turn)
                # the history but its last token (whose K/V the next call writes), or all of it
                # where a step's accepted drafts ran past max_new_tokens
                want = {0} if turn == 0 or not gen.prefix_cache else {len(ids) - 5, len(ids) - 4}
                assert cached in want, (precision, kw, turn, cached)
                ids = ids + out + [11, 111, 211, 311]
    assert "fp32" in on and "w8a8" in on, on  # the invariant graphs on every x86 CPU measured


def test_w8a8_graph_is_what_it_claims(quant_bundles):
    """The W8A8 target: integer GEMMs (no MatMulNBits), its decode and verify rows bit-equal at
    export validation, and closer to the PyTorch model than the int4 graph of the same weights."""
    import json

    import onnx

    manifest = json.loads((quant_bundles["w8a8"] / "manifest.json").read_text())
    target = manifest["models"]["target"]
    model = onnx.load(str(quant_bundles["w8a8"] / "target" / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert "MatMulIntegerToFloat" in ops and "MatMulNBits" not in ops
    assert "QuantizeLinear" in ops and "Round" not in ops  # rows quantized by one blocked op each
    assert (target["quantization"], manifest["models"]["draft"]["quantization"]) == ("w8a8", "int4")
    assert target["quant_block_size"] is None  # one scale per output channel
    quality = target["validation"]["quantized"]
    int4 = json.loads((quant_bundles["int4"] / "manifest.json").read_text())["models"]["target"]["validation"]["quantized"]
    assert quality["decode_vs_verify_error"] == 0.0
    assert quality["max_logit_error"] < int4["max_logit_error"]
    assert target["size_bytes"] < 0.4 * target["size_bytes_unquantized"]


def test_blocked_quantize_linear_gives_the_bits_of_div_round_add_cast():
    """W8A8 rows are quantized by one QuantizeLinear whose block is the whole row (opset 21); it
    must give exactly what round(x / scale) + 128 in separate ops gave: ties to even included."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specdec_rt.runtime.engines.sessions import session_options

    rng = np.random.default_rng(3)
    k = 96
    x = rng.standard_normal((2, 5, k)).astype(np.float32) * 4
    scale = (np.abs(x).max(axis=-1, keepdims=True) / 127).astype(np.float32)
    x[0, 0, :8] = (np.arange(8) + 0.5) * scale[0, 0]  # exact halves: round half to even
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k]),
              helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["b", "s", 1])]
    out = [helper.make_tensor_value_info("q", TensorProto.UINT8, ["b", "s", k])]
    blocked = helper.make_graph(
        [helper.make_node("Shape", ["scale"], ["rows"]),
         helper.make_node("Expand", ["zero", "rows"], ["zp"]),
         helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], axis=-1, block_size=k)],
        "blocked", inputs, out, [numpy_helper.from_array(np.array([128], np.uint8), "zero")])
    chain = helper.make_graph(
        [helper.make_node("Div", ["x", "scale"], ["d"]), helper.make_node("Round", ["d"], ["r"]),
         helper.make_node("Add", ["r", "c128"], ["a"]), helper.make_node("Cast", ["a"], ["q"], to=TensorProto.UINT8)],
        "chain", inputs, out, [numpy_helper.from_array(np.array(128, np.float32), "c128")])
    got = []
    for graph in (blocked, chain):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        model.ir_version = 10
        sess = ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])
        got.append(sess.run(None, {"x": x, "scale": scale})[0])
    assert np.array_equal(got[0], got[1])


def test_fused_target_attention_chain_rows_equal_sequential_rows_bit_for_bit(quant_bundles):
    """--target-attention fused: ONNX Runtime's Attention kernel computes a one-row call another
    way than a verify call (measured on x86 AVX2: every row differed in the last bits); the probe
    pads one-row calls, after which chain rows equal sequential rows. Tree rows are not claimed
    (float32 sums over holes) and the runtime refuses trees on such a bundle."""
    import warnings

    import specdec_rt
    from specdec_rt.runtime.engines.probes import RowInvarianceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", RowInvarianceWarning)  # nothing to say before a batch is asked for
        gen = specdec_rt.load(quant_bundles["fused"], threads=1)
    assert gen.bundle.target.fused_attention and not gen.exact_trees
    rng = np.random.default_rng(6)
    for _ in range(3):
        prompt, path, side = (rng.integers(1, VOCAB, n).tolist() for n in (9, 6, 5))
        sequential, chain, _ = _rows(gen.target, prompt, path, side)
        assert np.array_equal(chain, sequential), np.abs(chain - sequential).max()
    for _ in range(3):
        prompt = rng.integers(1, VOCAB, 10).tolist()
        base = gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
        for n in (1, 4, "auto"):
            assert gen.generate_ids(prompt, max_new_tokens=40, num_draft_tokens=n, ignore_eos=True) == base, n
    # batches: the Attention kernel's rows depend on the call's other rows here; where the probe
    # finds that, batches run one sequence per call (exact) and say so once, at the first batch
    prompts = [rng.integers(1, VOCAB, 8).tolist() for _ in range(3)]
    alone = [gen.generate_ids(p, max_new_tokens=20, ignore_eos=True) for p in prompts]
    if not gen.target.batch_calls:
        with pytest.warns(RowInvarianceWarning, match="one sequence per call"):
            batch = gen.generate_batch(prompts, max_new_tokens=20, ignore_eos=True)
    else:
        batch = gen.generate_batch(prompts, max_new_tokens=20, ignore_eos=True)
    assert [r.token_ids for r in batch] == alone


@pytest.mark.parametrize("precision", ["fp32", "int4", "w8a8"])
def test_quantized_greedy_chain_and_tree_identical_to_target_only(quant_bundles, precision):
    import specdec_rt

    gen = specdec_rt.load(quant_bundles[precision], threads=1)
    rng = np.random.default_rng(9)
    for _ in range(4):
        prompt = rng.integers(1, VOCAB, 10).tolist()
        base = gen.generate_ids(prompt, max_new_tokens=40, drafter=None, ignore_eos=True)
        for mode, n in (("chain", 4), ("chain", "auto"), ("tree", 7), ("tree", 15)):
            out = gen.generate_ids(prompt, max_new_tokens=40, speculation=mode, num_draft_tokens=n,
                                   ignore_eos=True)
            assert out == base, (mode, n)


def test_only_the_target_pays_for_float64_attention(quant_bundles):
    import json

    models = json.loads((quant_bundles["fp32"] / "manifest.json").read_text())["models"]
    assert models["target"]["attention_accumulation"] == "fp64"
    assert models["draft"]["attention_accumulation"] == "native"  # proposals need no exactness


@pytest.mark.parametrize("precision", ["fp32", "int4", "w8a8"])
def test_batched_rows_equal_rows_alone_bit_for_bit(quant_bundles, precision):
    """Batching pads: masked past columns (rows at other lengths), pad rows (rows proposing fewer
    tokens) and more rows per call. None of it may change a row's bits, including int4's, where
    a one-row call runs another kernel: a batched call always has several rows, and the row
    alone is padded to ``min_rows`` by the probe."""
    import specdec_rt
    from specdec_rt.runtime.core.masks import causal_mask

    gen = specdec_rt.load(quant_bundles[precision], threads=1, max_batch=4)
    assert gen.target.batch_calls  # the load-time probe found no dependence on the batch
    eng = gen.target
    rng = np.random.default_rng(3)
    lengths, widths = [9, 3, 17, 6], [1, 4, 2, 1]
    eng.reset()
    args, alone = [], []
    for q, (p, s) in enumerate(zip(lengths, widths)):
        toks = rng.integers(1, VOCAB, p + s)
        eng.extend(toks[:p], seq=q)
        pos = np.arange(p, p + s)
        args.append((toks[p:], pos, causal_mask(p, pos)))
        alone.append(eng.forward(*args[-1], seq=q).copy())
    rows = eng.forward_rows([0, 1, 2, 3], *map(list, zip(*args)))
    for row, ref in zip(rows, alone):
        assert np.array_equal(row, ref), np.abs(row - ref).max()
    eng.reset()
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (4, 11, 7, 15, 9)]
    base = [gen.generate_ids(p, max_new_tokens=30, drafter=None, ignore_eos=True) for p in prompts]
    for k in (3, "auto"):
        out = gen.generate_batch(prompts, max_new_tokens=30, batch_size=4, num_draft_tokens=k, ignore_eos=True)
        assert [r.token_ids for r in out] == base, k


def test_portable_w8a8_is_standard_onnx_and_row_invariant(tmp_path):
    """--portable --quantize w8a8: MatMulInteger + Cast + Mul (standard ONNX, e.g. for TensorRT
    or other runtimes) instead of the contrib op, with the same row invariance."""
    import onnx

    import specdec_rt
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    target = make_tiny_vocab_checkpoint(_qwen2_config(64, 1), tmp_path / "t", seed=21, scale=0.08)
    out = tmp_path / "bundle"
    export_pair(target, target, out, ExportOptions(progress=False, quantize="w8a8", portable=True,
                                                    quantize_roles=("target",)))
    model = onnx.load(str(out / "target" / "model.onnx"), load_external_data=False)
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    assert "MatMulInteger" in {n.op_type for n in model.graph.node}
    gen = specdec_rt.load(out, threads=2)
    assert gen.target.min_rows == 1
    prompt = list(range(5, 15))
    base = gen.generate_ids(prompt, max_new_tokens=24, drafter=None, ignore_eos=True)
    assert gen.generate_ids(prompt, max_new_tokens=24, num_draft_tokens=3, ignore_eos=True) == base
