"""Peer systems, run on the same Hugging Face checkpoints and prompt token ids as specdec-rt.

Four systems, all greedy, all forced to emit exactly ``max_new_tokens`` new tokens so the
outputs can be compared token for token and the timings side by side:

``transformers``            plain ``model.generate`` on the target (PyTorch, float32).
``transformers-assisted``   assisted generation (``assistant_model=draft``) with a fixed K:
                            ``num_assistant_tokens=K``, ``num_assistant_tokens_schedule="constant"``,
                            ``assistant_confidence_threshold=0``.
``ortgenai``                onnxruntime-genai, target only (model exported with its model builder).
``ortgenai-spec``           onnxruntime-genai's own draft-model speculative decoding.
                            (``ortgenai-spec-adaptive`` when its adaptive K is switched on.)

How onnxruntime-genai 0.18 configures draft-model speculative decoding (found by reading the
installed package: the builder, the ``GeneratorParams`` bindings and the strings in
``libonnxruntime-genai.so``):

* ``genai_config.json`` gets a ``model.draft`` section that has the same shape as
  ``model.decoder`` (``filename``, ``session_options``, ``inputs``, ``outputs``, head/layer
  counts). ``filename`` is resolved relative to the config's folder -- an absolute path is
  *joined* to it and fails -- so :func:`make_ortgenai_spec_dir` builds a new folder: the target's
  files symlinked (or copied) in, the draft's genai folder linked as ``draft/``.
* A top-level ``speculative`` section holds ``max_draft_tokens`` (K, 1..16), ``min_adaptive_k``
  (0 = fixed K; otherwise K adapts with this as its lower bound), ``cooldown`` (bool),
  ``ngram_size`` / ``ngram_chained_lookup`` (prompt-lookup, cannot be combined with a draft).
  The same keys can be set per request with ``GeneratorParams.set_speculative_options(**kw)``.
* ``Generator.get_speculative_stats()`` returns a dict (rounds, draft_tokens_proposed,
  draft_tokens_accepted, acceptance_rate, effective_k, forward-pass counts, timings, a histogram
  of accepted lengths, ...). It is all zeros for a model without a draft.
* Restrictions printed by the library: batch size 1, no beam search, no_repeat_ngram_size 0,
  no sliding-window KV, target and draft on the same execution provider with the same vocab.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from specdec_rt.bench.common import PeerUnavailable

__all__ = ["PeerRun", "PeerUnavailable", "run_transformers", "build_ortgenai_model", "build_ortgenai_models",
           "run_ortgenai", "make_ortgenai_spec_dir", "available_peers"]

_WARMUP_TOKENS = 8
# Counters of Generator.get_speculative_stats() copied to PeerRun.extra (the full dict goes under
# extra["speculative_stats"]).
_GENAI_STAT_KEYS = ("rounds", "draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate",
                    "effective_k", "target_forward_passes", "draft_forward_passes",
                    "mean_emitted_tokens_per_round", "adaptive_k_increases", "adaptive_k_decreases",
                    "full_accept_rounds", "zero_accept_rounds", "total_draft_ms", "total_target_ms")


@dataclass
class PeerRun:
    system: str  # "transformers", "transformers-assisted", "ortgenai", "ortgenai-spec", ...
    token_ids: list[int]  # new tokens only, not the prompt
    seconds: float  # wall time of the generation call(s) for this prompt, excluding model load
    tokens_per_second: float
    extra: dict = field(default_factory=dict)


def _make_run(system: str, tokens: list[int], seconds: float, extra: dict) -> PeerRun:
    tps = len(tokens) / seconds if seconds > 0 else float("inf")
    return PeerRun(system=system, token_ids=tokens, seconds=seconds, tokens_per_second=tps, extra=extra)


def _check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    out = [[int(t) for t in p] for p in prompts]
    if any(len(p) == 0 for p in out):
        raise ValueError("every prompt needs at least one token")
    return out


# --------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------

def _import_transformers():
    try:
        import torch
        import transformers
    except Exception as e:  # ImportError, or a broken install
        raise PeerUnavailable(f"transformers peer needs torch and transformers: {e!r}") from e
    return torch, transformers


def run_transformers(target_dir, prompts: list[list[int]], max_new_tokens: int, draft_dir=None,
                     num_draft_tokens: int = 4, threads: int | None = None,
                     warmup: bool = True, clock=time.perf_counter) -> list[PeerRun]:
    """Greedy ``generate`` on the target, or assisted generation with a fixed K when ``draft_dir``.

    Exactly ``max_new_tokens`` tokens per prompt (``min_new_tokens`` suppresses EOS), float32.
    ``extra`` holds forward-call counts (target, and draft for assisted) counted with hooks, and,
    for assisted, ``accepted`` = new tokens minus verify rounds (each round emits its accepted
    drafts plus one target token).
    """
    torch, transformers = _import_transformers()
    from transformers import AutoModelForCausalLM

    prompts = _check_prompts(prompts, max_new_tokens)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        draft = None
        if draft_dir is not None:
            if num_draft_tokens < 1:
                raise ValueError("num_draft_tokens must be >= 1")
            draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
            if draft.config.vocab_size != target.config.vocab_size:
                raise ValueError(f"target and draft vocab differ: {target.config.vocab_size} vs "
                                 f"{draft.config.vocab_size}")
            # The candidate generator reads these from the *assistant's* generation config;
            # generate() kwargs would only reach the target's.
            gc = draft.generation_config
            gc.num_assistant_tokens = int(num_draft_tokens)
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
        system = "transformers" if draft is None else "transformers-assisted"

        eos = target.generation_config.eos_token_id
        if eos is None:
            eos = target.config.eos_token_id
        pad = target.generation_config.pad_token_id
        if pad is None:
            pad = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)

        counts = {"target": 0, "draft": 0}

        def counter(name):
            def hook(module, args, kwargs=None):
                counts[name] += 1
            return hook

        handles = [target.register_forward_pre_hook(counter("target"))]
        if draft is not None:
            handles.append(draft.register_forward_pre_hook(counter("draft")))

        def generate(prompt: list[int], n: int) -> list[int]:
            ids = torch.tensor([prompt], dtype=torch.long)
            kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=pad)
            if draft is not None:
                kwargs["assistant_model"] = draft
            with torch.inference_mode():
                out = target.generate(ids, **kwargs)
            return out[0, len(prompt):].tolist()

        try:
            if warmup:
                generate(prompts[0], min(_WARMUP_TOKENS, max_new_tokens))
            runs = []
            for prompt in prompts:
                counts["target"] = counts["draft"] = 0
                t0 = clock()
                tokens = generate(prompt, max_new_tokens)
                seconds = clock() - t0
                extra = {"target_forwards": counts["target"]}
                if draft is not None:
                    # every target forward is one verify round (the first also does the prefill) and
                    # emits its accepted drafts plus one target token; every draft forward emits one
                    # proposed token (the first also does the draft's prefill)
                    rounds = counts["target"]
                    extra.update(num_draft_tokens=int(num_draft_tokens), rounds=rounds,
                                 draft_forwards=counts["draft"], proposed=counts["draft"],
                                 accepted=max(len(tokens) - rounds, 0))
                    if counts["draft"]:
                        extra["acceptance_rate"] = extra["accepted"] / counts["draft"]
                runs.append(_make_run(system, tokens, seconds, extra))
            return runs
        finally:
            for h in handles:
                h.remove()
    finally:
        torch.set_num_threads(old_threads)


# --------------------------------------------------------------------------------------------
# onnxruntime-genai
# --------------------------------------------------------------------------------------------

def _import_genai():
    try:
        import onnxruntime_genai as og
    except Exception as e:
        raise PeerUnavailable(f"onnxruntime-genai is not importable: {e!r}") from e
    return og


_HF_INPUT_GLOBS = ("config.json", "generation_config.json", "*.safetensors", "*.bin", "tokenizer*",
                   "*.model", "special_tokens_map.json")


def _newest_input_mtime(hf_dir: Path) -> float:
    newest = 0.0
    for pattern in _HF_INPUT_GLOBS:
        for f in hf_dir.glob(pattern):
            newest = max(newest, f.stat().st_mtime)
    return newest


def build_ortgenai_model(hf_dir, out_dir, precision: str = "fp32", execution_provider: str = "cpu",
                         extra_options: dict | None = None, timeout: float | None = None) -> Path:
    """Export an HF checkpoint folder with onnxruntime-genai's model builder (offline).

    Runs ``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p PRECISION -e EP -c CACHE``
    in a subprocess with the hub switched off (``-i`` reads the local folder; ``-m`` is not passed).
    Cached: nothing is done when ``out_dir/genai_config.json`` exists and is newer than the
    checkpoint's files. The export goes to a temporary sibling folder that replaces ``out_dir`` only
    when the builder succeeded, so an interrupted build never looks cached.
    """
    return build_ortgenai_models([(hf_dir, out_dir)], precision, execution_provider, extra_options, timeout)[0]


# Runs the builder's command line once per job in ONE interpreter: the builder's imports (torch,
# transformers, onnx: ~7 s) are paid once, and only the CLI contract is relied on.
_BUILD_DRIVER = """
import json, runpy, sys
for argv in json.loads(sys.argv[1]):
    sys.argv = ["builder"] + argv
    print("### building", argv, flush=True)
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
"""


def build_ortgenai_models(jobs: Sequence[tuple], precision: str = "fp32", execution_provider: str = "cpu",
                          extra_options: dict | None = None, timeout: float | None = None) -> list[Path]:
    """:func:`build_ortgenai_model` for several ``(hf_dir, out_dir)`` pairs in one builder process."""
    todo, outs, tmps = [], [], []
    for hf_dir, out_dir in jobs:
        hf_dir, out_dir = Path(hf_dir).resolve(), Path(out_dir).resolve()
        outs.append(out_dir)
        if not (hf_dir / "config.json").is_file():
            raise FileNotFoundError(f"{hf_dir} has no config.json (expected a Hugging Face checkpoint folder)")
        cfg = out_dir / "genai_config.json"
        if cfg.is_file() and cfg.stat().st_mtime >= _newest_input_mtime(hf_dir):
            continue
        todo.append((hf_dir, out_dir))
    if not todo:
        return outs
    if importlib.util.find_spec("onnxruntime_genai.models.builder") is None:
        raise PeerUnavailable("onnxruntime-genai's model builder (onnxruntime_genai.models.builder) is missing")

    argvs = []
    try:
        for hf_dir, out_dir in todo:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
            tmps.append(tmp)
            argv = ["-i", str(hf_dir), "-o", str(tmp / "model"), "-p", precision, "-e", execution_provider,
                    "-c", str(tmp / "cache")]
            if extra_options:
                argv += ["--extra_options"] + [f"{k}={_extra_value(v)}" for k, v in extra_options.items()]
            argvs.append(argv)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   TQDM_DISABLE="1")
        # cwd: a neutral folder, so nothing in the caller's cwd shadows an import
        proc = subprocess.run([sys.executable, "-c", _BUILD_DRIVER, json.dumps(argvs)], cwd=tmps[0], env=env,
                              capture_output=True, text=True, timeout=timeout)
        for (hf_dir, out_dir), tmp in zip(todo, tmps):
            if proc.returncode != 0 or not (tmp / "model" / "genai_config.json").is_file():
                tail = (proc.stdout + proc.stderr)[-4000:]
                raise RuntimeError(f"onnxruntime-genai builder failed (rc={proc.returncode}) for {hf_dir}:\n{tail}")
        for (hf_dir, out_dir), tmp in zip(todo, tmps):
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp / "model", out_dir)
    finally:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
    return outs


def _extra_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.symlink(src, dst, target_is_directory=src.is_dir())
    except OSError:  # no symlink permission (Windows)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)


def make_ortgenai_spec_dir(target_genai_dir, draft_genai_dir, out_dir, num_draft_tokens: int = 4,
                           min_adaptive_k: int = 0, cooldown: bool = False) -> Path:
    """A genai folder whose config runs the target with ``draft_genai_dir`` as its draft model.

    The target's files are linked into ``out_dir``, the draft's folder is linked as
    ``out_dir/draft``; the config is the target's plus ``model.draft`` (the draft's
    ``model.decoder`` section, filename prefixed with ``draft/``) and a ``speculative`` section.
    """
    target = Path(target_genai_dir).resolve()
    draft = Path(draft_genai_dir).resolve()
    out = Path(out_dir)
    t_cfg = json.loads((target / "genai_config.json").read_text())
    d_cfg = json.loads((draft / "genai_config.json").read_text())
    t_vocab, d_vocab = t_cfg["model"].get("vocab_size"), d_cfg["model"].get("vocab_size")
    if t_vocab != d_vocab:
        raise ValueError(f"target and draft vocab differ: {t_vocab} vs {d_vocab}")
    if not 1 <= int(num_draft_tokens) <= 16:
        raise ValueError("onnxruntime-genai takes max_draft_tokens in [1, 16]")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in target.iterdir():
        if f.name != "genai_config.json":
            _link_or_copy(f, out / f.name)
    _link_or_copy(draft, out / "draft")
    draft_section = json.loads(json.dumps(d_cfg["model"]["decoder"]))
    draft_section["filename"] = "draft/" + draft_section["filename"]
    t_cfg["model"]["draft"] = draft_section
    t_cfg["speculative"] = {"max_draft_tokens": int(num_draft_tokens),
                            "min_adaptive_k": int(min_adaptive_k), "cooldown": bool(cooldown)}
    (out / "genai_config.json").write_text(json.dumps(t_cfg, indent=4))
    return out


def run_ortgenai(target_genai_dir, prompts: list[list[int]], max_new_tokens: int, draft_genai_dir=None,
                 num_draft_tokens: int = 4, threads: int | None = None, warmup: bool = True,
                 adaptive: bool = False, min_adaptive_k: int = 1, clock=time.perf_counter) -> list[PeerRun]:
    """Greedy generation with onnxruntime-genai, target only or with its draft-model speculation.

    ``*_genai_dir`` are folders written by :func:`build_ortgenai_model`. With a draft, a temporary
    combined folder is made (:func:`make_ortgenai_spec_dir`) and K = ``num_draft_tokens`` is fixed
    (``min_adaptive_k=0``) unless ``adaptive``, in which case genai adapts K within
    [``min_adaptive_k``, ``num_draft_tokens``]. ``threads`` sets ``intra_op_num_threads`` of the
    decoder (and draft) sessions through a config overlay. Timing covers creating the generator,
    the prompt's prefill and the token loop. ``extra`` holds genai's speculative statistics.
    """
    prompts = _check_prompts(prompts, max_new_tokens)
    with OrtGenaiSession(target_genai_dir, max(len(p) for p in prompts) + max_new_tokens, draft_genai_dir,
                         num_draft_tokens, threads, adaptive, min_adaptive_k) as session:
        if warmup:
            session.generate(prompts[0], min(_WARMUP_TOKENS, max_new_tokens))
        runs = []
        for prompt in prompts:
            t0 = clock()
            tokens, extra = session.generate(prompt, max_new_tokens)
            runs.append(_make_run(session.system, tokens, clock() - t0, extra))
        return runs


class OrtGenaiSession:
    """One onnxruntime-genai model (target, or target + draft with a fixed or adaptive K) kept
    loaded, generating one prompt per call: :func:`run_ortgenai` runs a prompt list through it,
    and a head-to-head benchmark interleaves its calls with ours prompt by prompt
    (scripts/head_to_head.py). A context manager: the combined spec folder is temporary."""

    def __init__(self, target_genai_dir, longest: int, draft_genai_dir=None, num_draft_tokens: int = 4,
                 threads: int | None = None, adaptive: bool = False, min_adaptive_k: int = 1) -> None:
        self.og = og = _import_genai()
        target = Path(target_genai_dir)
        if not (target / "genai_config.json").is_file():
            raise FileNotFoundError(f"{target} has no genai_config.json; build it with build_ortgenai_model")
        context = json.loads((target / "genai_config.json").read_text())["model"].get("context_length")
        if context and longest > context:
            raise ValueError(f"prompt + max_new_tokens = {longest} exceeds the model's context_length {context}")
        self._tmp = tempfile.TemporaryDirectory(prefix="specdec-ortgenai-spec-")
        model_dir = target
        self.spec_opts: dict = {}
        self.num_draft_tokens = int(num_draft_tokens)
        if draft_genai_dir is not None:
            if not hasattr(og.GeneratorParams, "set_speculative_options"):
                self._tmp.cleanup()
                raise PeerUnavailable(f"onnxruntime-genai {getattr(og, '__version__', '?')} has no "
                                      "draft-model speculative decoding (GeneratorParams.set_speculative_options)")
            k_min = int(min_adaptive_k) if adaptive else 0
            if adaptive and not 1 <= k_min <= num_draft_tokens:
                self._tmp.cleanup()
                raise ValueError("min_adaptive_k must be in [1, num_draft_tokens]")
            model_dir = make_ortgenai_spec_dir(target, draft_genai_dir, Path(self._tmp.name) / "spec",
                                               num_draft_tokens=num_draft_tokens, min_adaptive_k=k_min)
            self.spec_opts = {"max_draft_tokens": int(num_draft_tokens), "min_adaptive_k": k_min}
        config = og.Config(str(model_dir))
        if threads:
            so = {"session_options": {"intra_op_num_threads": int(threads)}}
            overlay = {"model": {"decoder": so}}
            if draft_genai_dir is not None:
                overlay["model"]["draft"] = so
            config.overlay(json.dumps(overlay))
        self.model = og.Model(config)
        if draft_genai_dir is None:
            self.system = "ortgenai"
        else:
            self.system = "ortgenai-spec-adaptive" if adaptive else "ortgenai-spec"

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], dict]:
        """Greedy: exactly ``n`` new tokens; returns them and genai's speculative statistics."""
        import numpy as np

        og = self.og
        params = og.GeneratorParams(self.model)
        length = len(prompt) + n
        params.set_search_options(do_sample=False, max_length=length, min_length=length)
        if self.spec_opts:
            params.set_speculative_options(**self.spec_opts)
        gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.asarray(prompt, dtype=np.int32))
        ttft = None
        while not gen.is_done():
            gen.generate_next_token()
            if ttft is None:  # the prompt's forward pass and the first new token
                ttft = time.perf_counter() - t0
        tokens = [int(t) for t in gen.get_sequence(0)[len(prompt):]]
        extra: dict = {"ttft": ttft}
        if self.spec_opts:
            stats = dict(gen.get_speculative_stats())
            extra = {k: stats[k] for k in _GENAI_STAT_KEYS if k in stats}
            extra["num_draft_tokens"] = self.num_draft_tokens
            extra["accepted"] = stats.get("draft_tokens_accepted")
            extra["proposed"] = stats.get("draft_tokens_proposed")
            extra["speculative_stats"] = stats
        del gen
        return tokens, extra

    def __enter__(self) -> "OrtGenaiSession":
        return self

    def __exit__(self, *exc) -> None:
        self.model = None
        self._tmp.cleanup()


# --------------------------------------------------------------------------------------------

def available_peers() -> dict[str, str | None]:
    """``{system: None}`` when it can run here, else ``{system: reason}``."""
    peers: dict[str, str | None] = {}
    try:
        _import_transformers()
        reason = None
    except PeerUnavailable as e:
        reason = str(e)
    peers["transformers"] = reason
    peers["transformers-assisted"] = reason
    try:
        og = _import_genai()
        reason = None
        # find_spec, not import: importing the builder pulls in torch/transformers/onnx (~10 s)
        for mod in ("onnxruntime_genai.models.builder", "onnx", "onnx_ir", "safetensors", "torch", "transformers"):
            if importlib.util.find_spec(mod) is None:
                reason = f"onnxruntime-genai's model builder needs {mod!r}, which is not installed"
                break
        peers["ortgenai"] = reason
        if reason is None and not hasattr(og.GeneratorParams, "set_speculative_options"):
            reason = (f"onnxruntime-genai {getattr(og, '__version__', '?')} has no draft-model speculative "
                      "decoding (GeneratorParams.set_speculative_options missing)")
        peers["ortgenai-spec"] = reason
    except PeerUnavailable as e:
        peers["ortgenai"] = peers["ortgenai-spec"] = str(e)
    return peers
