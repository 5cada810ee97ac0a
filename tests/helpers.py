"""Tiny random-weight checkpoints built from configs, and a real BPE tokenizer for them."""
from __future__ import annotations

import json
import sysconfig
from functools import lru_cache
from pathlib import Path

TEXT_FILES = ("textwrap.py", "shlex.py", "heapq.py")


@lru_cache(maxsize=None)
def _corpus() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((stdlib / f).read_text(encoding="utf-8") for f in TEXT_FILES)


def make_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A byte-level BPE with exactly ``vocab_size`` tokens; id 0 is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_corpus()], trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))


def make_checkpoint(config, out_dir: Path, seed: int = 0, tokenizer_vocab: int | None = None) -> Path:
    """Save a random-weight model for ``config`` plus a matching tokenizer.

    ``tokenizer_vocab``: a tokenizer smaller than the model's vocabulary (padded embedding tables,
    as in Phi-3's 32064 rows for 32011 tokens).
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger-than-default weights give peaky, input-dependent outputs
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.eval().save_pretrained(str(out_dir))
    make_tokenizer(tokenizer_vocab or config.vocab_size, out_dir)
    return out_dir


def make_wordlevel_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """A word-level tokenizer "t0".."t{V-1}" for tiny-vocabulary models (sampling tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def make_tiny_vocab_checkpoint(config, out_dir: Path, seed: int = 0, scale: float = 0.3) -> Path:
    """Random model over a tiny vocabulary with a word-level tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, scale)
    model.eval().save_pretrained(str(out_dir))
    make_wordlevel_tokenizer(config.vocab_size, out_dir)
    return out_dir


def llama_config(vocab_size=320, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, max_pos=256):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_pos, eos_token_id=0, bos_token_id=0, pad_token_id=0)


def make_perturbed_copy(src: Path, out_dir: Path, noise: float, seed: int = 7) -> Path:
    """The ``src`` checkpoint with Gaussian noise on its weights: a draft that agrees partly."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn_like(p) * noise)
    model.eval().save_pretrained(str(out_dir))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out_dir / name)
    return out_dir


def make_chat_tokenizer(out_dir: Path, style: str, vocab_size: int = 320, template_file: bool = False) -> Path:
    """A byte-level BPE with the special tokens of several chat formats and a chat template of
    ``style`` (tests/chat_templates.py) in tokenizer_config.json (or in chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from chat_templates import SPECIAL_TOKENS, STYLES

    spec = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_corpus()], trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    if spec["post_bos"]:
        bos = spec["post_bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    cfg.update({k: v for k, v in spec["config"].items() if v is not None})
    if template_file:
        assert isinstance(spec["template"], str)
        (out_dir / "chat_template.jinja").write_text(spec["template"])
    else:
        cfg["chat_template"] = spec["template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def make_chat_checkpoint(out_dir: Path, style: str, generation_config: dict | None = None, seed: int = 0,
                         template_file: bool = False) -> Path:
    """A tiny random Llama with a chat tokenizer and (optionally) a given generation_config.json."""
    cfg = llama_config()
    make_checkpoint(cfg, out_dir, seed=seed)
    make_chat_tokenizer(out_dir, style, cfg.vocab_size, template_file=template_file)
    if generation_config is not None:
        (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return out_dir


def assert_runs_without(code: str, exact: tuple[str, ...] = (), prefixes: tuple[str, ...] = (),
                        timeout: float = 120) -> None:
    """Run ``code`` in a fresh interpreter; fail if afterwards a module named in ``exact``, or one
    whose name starts with any of ``prefixes``, is loaded."""
    import subprocess
    import sys

    check = (f"\nbad = [m for m in sys.modules if m in {exact!r} or m.startswith({prefixes!r})]\n"
             "print('LOADED', bad)\nsys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", "import sys\n" + code + check], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# what the runtime (a Jetson's install) must never import: torch, transformers, onnx, the exporter
RUNTIME_FORBIDDEN = dict(exact=("torch", "transformers", "onnx"),
                         prefixes=("torch.", "transformers.", "onnx.", "specdec_rt.export"))


def windowed_mistral_bundle(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny Mistral whose sliding window (6) is shorter than the tests' generations, exported
    with itself as draft: (checkpoint, bundle)."""
    from transformers import MistralConfig

    from specdec_rt.export.pipeline import ExportOptions, export_pair

    cfg = MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=6, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    ckpt = make_checkpoint(cfg, tmp_path / "mistral")
    export_pair(ckpt, ckpt, tmp_path / "bundle", ExportOptions(progress=False))
    return ckpt, tmp_path / "bundle"


def make_certificate(tmp_path):
    """A self-signed certificate for 127.0.0.1 / localhost and its key (PEM files): the test's CA."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specdec-rt test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file
