"""Every supported family exports, validates against PyTorch and decodes greedily exactly.

For each family a tiny random-weight checkpoint (2 layers, hidden 64, vocab 320) is built from its
transformers config with the switches of a released model (named at each config), exported with the fused op set (target + the same checkpoint as draft) and,
for most families, with the portable op set. The exporter validates every graph against PyTorch
(prefill, chain verify, decode, tree); the tests then check that greedy decoding through the
runtime reproduces ``transformers``' own ``generate`` token for token, and that a draft identical
to the target is accepted 100% of the time. The last tests cover inputs the exporter must refuse.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_checkpoint, make_perturbed_copy, make_tokenizer  # noqa: E402

VOCAB = 320
BIG_VOCAB = 1024  # phi4_mini's model vocabulary; its tokenizer keeps VOCAB tokens
NEW_TOKENS = 24
MAX_ERROR = 1e-3
PROMPTS = [[5, 17, 42, 99, 3], [200, 201, 202, 7, 7, 7, 9, 310], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, **COMMON)


def _config(name: str):
    import transformers as tf

    if name == "llama":  # GQA 4:2
        return tf.LlamaConfig(num_key_value_heads=2, **LLAMA_LIKE)
    if name == "mistral":
        return tf.MistralConfig(num_key_value_heads=2, sliding_window=None, **LLAMA_LIKE)
    if name == "qwen2":  # q/k/v biases are always on in Qwen2
        return tf.Qwen2Config(num_key_value_heads=2, **LLAMA_LIKE)
    if name == "qwen3":  # per-head q/k RMSNorm, head_dim (24) independent of hidden / heads (16)
        return tf.Qwen3Config(num_key_value_heads=2, head_dim=24, **LLAMA_LIKE)
    if name == "gemma":  # MQA, head_dim 32 != 64 / 4, (1 + w) norms, sqrt(hidden) embedding scale;
        # activation fields as in the released Gemma configs (legacy "gelu" meaning the tanh form)
        return tf.GemmaConfig(num_key_value_heads=1, head_dim=32, hidden_act="gelu",
                              hidden_activation="gelu_pytorch_tanh", **LLAMA_LIKE)
    if name == "phi3":  # fused qkv / gate_up, half of each head rotated
        return tf.Phi3Config(num_key_value_heads=2, partial_rotary_factor=0.5,
                             original_max_position_embeddings=256, **LLAMA_LIKE)
    if name == "phi3_longrope":  # long/short rope factors switching at 64 positions (Phi-3 128k style)
        return tf.Phi3Config(num_key_value_heads=2, original_max_position_embeddings=64,
                             rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                           "long_factor": [2.0 + i for i in range(8)]}, **LLAMA_LIKE)
    if name == "phi3_5_mini":  # Phi-3.5-mini: MHA, longrope short/long factors, untied, sliding window
        # far beyond the context (262144)
        return tf.Phi3Config(num_key_value_heads=4, original_max_position_embeddings=64, sliding_window=262144,
                             rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                           "long_factor": [1.5 + i for i in range(8)]}, **LLAMA_LIKE)
    if name == "phi4_mini":  # Phi-4-mini: GQA, 3/4 of each head rotated, longrope over the rotated part,
        # tied embeddings, a model vocabulary (1024) padded beyond the tokenizer's 320 tokens
        return tf.Phi3Config(num_key_value_heads=2, partial_rotary_factor=0.75, tie_word_embeddings=True,
                             original_max_position_embeddings=64, sliding_window=262144,
                             rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                           "long_factor": [2.0 + i for i in range(6)]},
                             **{**LLAMA_LIKE, "vocab_size": BIG_VOCAB})
    if name == "gemma2":  # Gemma-2-2b-it's switches: sandwich norms, GQA, head_dim 32 != 64 / 4, query scale
        # from query_pre_attn_scalar (24 != head_dim, as in the 27b), sliding/full alternation with a tiny
        # window (8), tied embeddings. Soft caps lowered from 50 / 30 so that they bite on tiny weights.
        return tf.Gemma2Config(num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                               attn_logit_softcapping=1.5, final_logit_softcapping=3.0, **LLAMA_LIKE)
    if name == "gemma3_text":  # Gemma-3-1b/4b-it: per-head q/k norm, MQA, sliding then full layer, local
        # rope base 1e4 on the sliding layer, global base 1e6 with linear scaling (x8) on the full layer
        return tf.Gemma3TextConfig(num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                                   **LLAMA_LIKE)
    if name == "granite":  # granite-3.0-2b-instruct's multipliers, tied embeddings
        return tf.GraniteConfig(num_key_value_heads=2, embedding_multiplier=12.0, attention_multiplier=0.015625,
                                residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True,
                                **LLAMA_LIKE)
    if name == "smollm3":  # SmolLM3-3B: NoPE every no_rope_layer_interval-th layer (here the second), tied
        return tf.SmolLM3Config(num_key_value_heads=2, no_rope_layer_interval=2, tie_word_embeddings=True,
                                **LLAMA_LIKE)
    if name == "olmo2":  # OLMo-2: post-branch norms only, q/k RMSNorm over the whole projection (GQA as in 32B)
        return tf.Olmo2Config(num_key_value_heads=2, rms_norm_eps=1e-6, **LLAMA_LIKE)
    if name == "starcoder2":  # starcoder2-3b: LayerNorm + biases everywhere, plain gelu_tanh MLP, GQA, a sliding
        # window (8 here, 4096 there) on every layer, tied embeddings
        return tf.Starcoder2Config(num_key_value_heads=2, sliding_window=8, use_bias=True,
                                   hidden_act="gelu_pytorch_tanh", **LLAMA_LIKE)
    if name == "gpt2":  # learned positions, Conv1D, LayerNorm with bias
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **COMMON)
    if name in ("gpt_neox", "gpt_neox_sequential"):  # per-head fused qkv, a quarter of each head rotated
        return tf.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=256,
                                use_parallel_residual=(name == "gpt_neox"), **COMMON)
    raise KeyError(name)


NEW_FAMILIES = ["gemma2", "gemma3_text", "granite", "phi3_5_mini", "phi4_mini", "smollm3", "olmo2", "starcoder2"]
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "phi3_longrope", "gpt2", "gpt_neox",
            "gpt_neox_sequential"] + NEW_FAMILIES
PORTABLE = ["llama", "qwen3", "gemma", "phi3", "gpt2", "gpt_neox", "gemma2", "gemma3_text", "granite", "phi4_mini",
            "smollm3", "olmo2", "starcoder2"]
LONGROPE = ("phi3_longrope", "phi3_5_mini", "phi4_mini")  # capped at original_max_position_embeddings (64)
GRAPH_WINDOWS = ("gemma2", "gemma3_text")  # sliding and full layers: the graph applies the window


class _Store:
    """Checkpoints, bundles, loaded generators and reference outputs, each built once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict = {}

    def _once(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def checkpoint(self, name: str) -> Path:
        return self._once(("ckpt", name), lambda: make_checkpoint(_config(name), self.root / f"ckpt_{name}",
                                                                   tokenizer_vocab=VOCAB))

    def manifest(self, name: str, portable: bool = False) -> tuple[Path, dict]:
        """Fused: target and draft (the same checkpoint); portable: target only."""
        from specdec_rt.export.pipeline import ExportOptions, export_pair

        def build():
            ckpt = self.checkpoint(name)
            out = self.root / f"bundle_{name}_{'portable' if portable else 'fused'}"
            opts = ExportOptions(progress=False, portable=portable)
            if name in LONGROPE:
                with pytest.warns(UserWarning, match="longrope: max context capped from 256 to 64"):
                    manifest = export_pair(ckpt, None if portable else ckpt, out, opts)
            else:
                manifest = export_pair(ckpt, None if portable else ckpt, out, opts)
            return out, manifest

        return self._once(("bundle", name, portable), build)

    def generator(self, name: str):
        import specdec_rt

        return self._once(("gen", name), lambda: specdec_rt.load(self.manifest(name)[0], threads=1))

    def reference(self, name: str, prompt: list[int]) -> list[int]:
        """transformers' own greedy continuation (never stopping at EOS)."""
        import torch
        from transformers import AutoModelForCausalLM

        def model():
            return AutoModelForCausalLM.from_pretrained(str(self.checkpoint(name)), dtype=torch.float32).eval()

        def build():
            m = self._once(("hf", name), model)
            with torch.no_grad():
                out = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            ids = out[0, len(prompt):].tolist()
            assert len(ids) == NEW_TOKENS
            return ids

        return self._once(("ref", name, tuple(prompt)), build)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> _Store:
    return _Store(tmp_path_factory.mktemp("architectures"))


def _check_validation(info: dict) -> None:
    v = info["validation"]
    assert v, "the export did not validate"
    assert v["max_logit_error"] < MAX_ERROR, v
    assert v["max_kv_error"] < MAX_ERROR, v
    assert v["decode_vs_verify_error"] < MAX_ERROR, v
    assert v["tree_error"] < MAX_ERROR, v
    assert v["top1_agreement"] == 1.0, v


# -- export + validation ------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_fused_export_validates(store, name):
    _, manifest = store.manifest(name)
    cfg = _config(name)
    for role in ("target", "draft"):
        info = manifest["models"][role]
        assert info["family"] == cfg.model_type
        assert info["num_layers"] == 2 and info["vocab_size"] == cfg.vocab_size
        assert info["fused_ops"] is True
        _check_validation(info)


@pytest.mark.parametrize("name", PORTABLE)
def test_portable_export_validates(store, name):
    import onnx

    out, manifest = store.manifest(name, portable=True)
    info = manifest["models"]["target"]
    assert info["fused_ops"] is False
    _check_validation(info)
    graph = onnx.load(str(out / info["graph"]), load_external_data=False).graph
    assert {n.domain for n in graph.node} <= {"", "ai.onnx"}, "portable graph uses contrib ops"
    fused_nodes = store.manifest(name)[1]["models"]["target"]["num_nodes"]
    assert fused_nodes < info["num_nodes"]


@pytest.mark.parametrize("name", LONGROPE)
def test_longrope_context_is_capped_at_the_switch(store, name):
    """Beyond original_max_position_embeddings transformers swaps rope factors and recomputes the
    cache; the bundle stops at the switch, where the short-factor table is exact."""
    _, manifest = store.manifest(name)
    assert manifest["max_context"] == 64
    assert manifest["models"]["target"]["max_positions"] == 64


@pytest.mark.parametrize("name", GRAPH_WINDOWS)
def test_per_layer_windows_are_in_the_graph(store, name):
    """Sliding and full layers: the runtime gets no window (it would apply it to every layer), the
    graph applies it to the sliding layers, and validation ran a past longer than the window."""
    _, manifest = store.manifest(name)
    info = manifest["models"]["target"]
    assert info["sliding_window"] is None
    assert info["graph_windows"] == [8, None]
    cases = info["validation"]["cases"]
    assert {"prefill_P0_past_window", "verify_S4_past_window", "decode_S1_past_window", "tree_past_window"} <= set(cases)
    assert max(cases.values()) < MAX_ERROR


def test_shared_window_stays_in_the_runtime(store):
    """StarCoder2's window covers every layer: the runtime's masks apply it, as for Mistral."""
    info = store.manifest("starcoder2")[1]["models"]["target"]
    assert info["sliding_window"] == 8 and info["graph_windows"] is None
    assert "tree_past_window" in info["validation"]["cases"]


@pytest.mark.parametrize("name", GRAPH_WINDOWS + ("starcoder2",))
def test_context_past_the_window_matches_transformers(store, name):
    """A 26-token prompt and 24 new tokens with an 8-token window: target-only, chain and tree
    decoding all equal transformers' generate."""
    gen = store.generator(name)
    prompt = [(7 * i + 3) % VOCAB for i in range(26)]
    ref = store.reference(name, prompt)
    assert gen.generate_ids(prompt, max_new_tokens=NEW_TOKENS, drafter=None, ignore_eos=True) == ref
    assert gen.generate_ids(prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=3, ignore_eos=True) == ref
    assert gen.generate_ids(prompt, max_new_tokens=NEW_TOKENS, speculation="tree", num_draft_tokens=6,
                            ignore_eos=True) == ref


# -- greedy exactness end to end ----------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers(store, name):
    gen = store.generator(name)
    for prompt in PROMPTS:
        ours = gen.generate_ids(prompt, max_new_tokens=NEW_TOKENS, drafter=None, ignore_eos=True)
        assert ours == store.reference(name, prompt), prompt


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", FAMILIES)
def test_self_draft_accepts_everything(store, name, k):
    gen = store.generator(name)
    for prompt in PROMPTS:
        ours = gen.generate_ids(prompt, max_new_tokens=NEW_TOKENS, drafter="model", num_draft_tokens=k,
                                ignore_eos=True)
        assert ours == store.reference(name, prompt), prompt
        assert gen.last_stats.proposed > 0
        assert gen.last_stats.acceptance_rate == 1.0, (prompt, gen.last_stats.accepted, gen.last_stats.proposed)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_noisy_draft_is_rejected_and_output_stays_the_targets(store, name, tmp_path):
    """Every family with a draft that disagrees (the target plus weight noise): rejected drafts,
    rollbacks and resampled tokens in chains (fixed and "auto" K) and trees, and still
    transformers' greedy output token for token."""
    import specdec_rt
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    ckpt = store.checkpoint(name)
    for noise in (0.03, 0.08, 0.2, 1.0):  # a draft that agrees in part: how much noise that takes varies by family
        draft = make_perturbed_copy(ckpt, tmp_path / f"draft{noise}", noise=noise)
        out = tmp_path / f"bundle{noise}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # longrope's context cap, said by the test above
            export_pair(ckpt, draft, out, ExportOptions(progress=False, validate=False))
        gen = specdec_rt.load(out, threads=1)
        proposed = accepted = 0
        for prompt in PROMPTS:
            ref = store.reference(name, prompt)
            for kwargs in ({"num_draft_tokens": 3}, {"num_draft_tokens": "auto"},
                           {"speculation": "tree", "num_draft_tokens": 6}):
                ours = gen.generate_ids(prompt, max_new_tokens=NEW_TOKENS, drafter="model", ignore_eos=True, **kwargs)
                assert ours == ref, (noise, prompt, kwargs)
                proposed += gen.last_stats.proposed
                accepted += gen.last_stats.accepted
        if 0 < accepted < proposed:
            break
    assert 0 < accepted < proposed, (name, accepted, proposed)


# -- inputs the exporter refuses --------------------------------------------------------------------

def test_unsupported_model_type_in_config(tmp_path):
    from specdec_rt.export.arch import SUPPORTED_FAMILIES, UnsupportedArchitectureError
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    ckpt = tmp_path / "bert"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(UnsupportedArchitectureError) as err:
        export_pair(ckpt, None, tmp_path / "out", ExportOptions(progress=False))
    msg = str(err.value)
    assert "'bert'" in msg
    assert all(f in msg for f in SUPPORTED_FAMILIES)


def test_unsupported_loaded_model(tmp_path):
    """An OPT checkpoint: refused before loading, and by the extractor if it gets a loaded one."""
    import torch
    from transformers import AutoModelForCausalLM, OPTConfig

    from specdec_rt.export.arch import SUPPORTED_FAMILIES, UnsupportedArchitectureError, extract
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                    word_embed_proj_dim=16, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                    pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(UnsupportedArchitectureError) as err:
        extract(model, 64)
    assert "'opt'" in str(err.value) and all(f in str(err.value) for f in SUPPORTED_FAMILIES)

    ckpt = make_checkpoint(cfg, tmp_path / "opt")
    with pytest.raises(UnsupportedArchitectureError, match="'opt' is not supported; supported: llama"):
        export_pair(ckpt, None, tmp_path / "out", ExportOptions(progress=False))


def _tiny(name: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(name)).eval()


@pytest.mark.parametrize("name, overrides, field", [
    # transformers' Gemma 3 attention never applies it: there is no reference to be exact against
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    # sliding layers without use_sliding_window: eager masks slide, flash attention does not
    ("smollm3", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}, "use_sliding_window"),
    ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 10000.0}}, "rope_parameters.rope_type"),
    ("gemma3_text", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
])
def test_unimplemented_switch_is_refused(name, overrides, field):
    """A config switch without an implementation: one line naming the field, never a silent graph."""
    from specdec_rt.export.arch import UnsupportedArchitectureError, extract

    model = _tiny(name)
    for key, value in overrides.items():  # set after construction: transformers would reject some
        setattr(model.config, key, value)
    with pytest.raises(UnsupportedArchitectureError) as err:
        extract(model, 256)
    msg = str(err.value)
    assert field in msg and "\n" not in msg, msg


def test_missing_folder(tmp_path):
    from specdec_rt.export.pipeline import ExportError, ExportOptions, export_pair

    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(ExportError) as err:
        export_pair(missing, None, tmp_path / "out", ExportOptions(progress=False))
    assert str(missing) in str(err.value)
    assert not (tmp_path / "out").exists()


def test_corrupt_config(tmp_path):
    from specdec_rt.export.pipeline import ExportError, ExportOptions, export_pair

    ckpt = tmp_path / "broken"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')  # truncated
    with pytest.raises(ExportError, match="not valid JSON"):
        export_pair(ckpt, None, tmp_path / "out", ExportOptions(progress=False))


def test_mismatched_vocabularies(store, tmp_path):
    import shutil

    from specdec_rt.export.pipeline import ExportError, ExportOptions, export_pair

    target = store.checkpoint("llama")
    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    (draft / "tokenizer.json").unlink()
    make_tokenizer(300, draft)  # the draft's tokenizer was trained with a smaller vocabulary
    with pytest.raises(ExportError, match="vocabularies do not match") as err:
        export_pair(target, draft, tmp_path / "out", ExportOptions(progress=False))
    assert "target has 320 tokens, draft has 300" in str(err.value)
