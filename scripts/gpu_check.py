#!/usr/bin/env python
"""Run every backend present against the CPU reference: exactness, logit error, speed.

    python scripts/gpu_check.py                      # export specdec_rt/data/reference/{target,draft}
    python scripts/gpu_check.py --bundle DIR         # an existing (portable) bundle
    python scripts/gpu_check.py --target T --draft D # export this pair (portable) first
    python scripts/gpu_check.py --tiny               # a tiny random pair (needs torch, tests/)

Backends: cpu (always), cuda EP, tensorrt EP, native trt (tensorrt + cuda-python), and the draft
on cpu with the target on cuda. Missing ones are reported as "not available: <reason>", so the
script runs (and is useful) on a CPU-only machine. Greedy exactness: the backend's target-only
and speculative (K=4) token ids must equal CPU target-only greedy for every prompt.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_PROMPTS = ["def fill(self, text):\n", "import heapq\n\nclass Queue:\n", "The quick brown fox"]


def _prompts(n: int) -> list[str]:
    path = ROOT / "specdec_rt" / "data" / "reference" / "eval_prompts.jsonl"
    if path.is_file():
        rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
        return rows[:n] or DEFAULT_PROMPTS[:n]
    return DEFAULT_PROMPTS[:n]


def make_bundle(args, tmp: Path) -> tuple[Path, bool]:
    """The bundle to check and whether this script made it (then engines may be built into it)."""
    if args.bundle:
        return Path(args.bundle), False
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers import llama_config, make_checkpoint, make_perturbed_copy

        target = make_checkpoint(llama_config(), tmp / "target", seed=0)
        draft = make_perturbed_copy(target, tmp / "draft", noise=0.03)
    else:
        target = Path(args.target or ROOT / "specdec_rt" / "data" / "reference" / "target")
        draft = Path(args.draft) if args.draft else (None if args.target else ROOT / "specdec_rt" / "data" / "reference" / "draft")
        if not target.is_dir():
            raise SystemExit(f"gpu_check: no checkpoint at {target}; pass --bundle DIR, --target DIR "
                             "[--draft DIR], or --tiny")
    bundle = tmp / "bundle"
    export_pair(target, draft, bundle, ExportOptions(portable=True, progress=False))
    return bundle, True


def backends(bundle: Path, own_bundle: bool, build: bool) -> list[tuple[str, dict | None, str]]:
    """(name, load kwargs or None, reason it is unavailable)."""
    import onnxruntime as ort

    avail = ort.get_available_providers()
    out: list[tuple[str, dict | None, str]] = [("cpu", {"provider": "cpu"}, "")]
    cuda = "CUDAExecutionProvider" in avail
    why_cuda = f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)"
    out.append(("cuda-ep", {"provider": "cuda"} if cuda else None, "" if cuda else why_cuda))
    trt_ep = "TensorrtExecutionProvider" in avail
    out.append(("tensorrt-ep", {"provider": "tensorrt"} if trt_ep else None,
                "" if trt_ep else f"onnxruntime {ort.__version__} has no TensorrtExecutionProvider"))
    out.append(("trt-native", *_native(bundle, own_bundle, build)))
    out.append(("draft-cpu/target-cuda", {"provider": "cuda", "draft_provider": "cpu"} if cuda else None,
                "" if cuda else why_cuda))
    return out


def _native(bundle: Path, own_bundle: bool, build: bool) -> tuple[dict | None, str]:
    from specdec_rt.runtime.engines.providers import BackendUnavailableError
    from specdec_rt.runtime.engines.trt import Cuda, import_tensorrt

    try:
        trt = import_tensorrt()
        Cuda().close()
    except BackendUnavailableError as exc:
        return None, str(exc).split(". Import error")[0]
    if not (bundle / "target.engine").is_file():
        if not (own_bundle or build):
            return None, f"bundle has no engines; build them: python -m specdec_rt.export.tensorrt {bundle}"
        from specdec_rt.export.tensorrt import build_engines

        try:
            build_engines(bundle)
        except Exception as exc:  # noqa: BLE001 - report, check the other backends
            return None, f"engine build failed with TensorRT {trt.__version__}: {exc}"
    return {"provider": "trt"}, ""


def check_one(bundle: Path, kwargs: dict, prompts: list[str], max_new: int, ref: dict | None,
              threads: int | None) -> dict:
    import specdec_rt
    from specdec_rt.runtime.core.masks import causal_mask

    gen = specdec_rt.load(bundle, threads=threads, **kwargs)
    ids = [gen.tokenizer.encode(p) for p in prompts]
    # one prefill call's logits on the target
    eng = gen.target
    eng.reset()
    pos = np.arange(len(ids[0]), dtype=np.int64)
    logits = np.array(eng.forward(np.asarray(ids[0], dtype=np.int64), pos, causal_mask(0, pos)), copy=True)
    eng.reset()
    common = dict(max_new_tokens=max_new, ignore_eos=True, temperature=0.0)
    has_draft = gen.draft_engine is not None
    spec_kw = dict(common, num_draft_tokens=4, drafter="model" if has_draft else "prompt_lookup")
    base_kw = dict(common, num_draft_tokens=0, drafter=None)
    gen.generate_ids(ids[0], **dict(base_kw, max_new_tokens=4))  # warm-up (TensorRT EP builds here)
    target_only, spec, t_base, t_spec, n_base, n_spec = [], [], 0.0, 0.0, 0, 0
    for p in ids:
        t0 = time.perf_counter()
        target_only.append(gen.generate_ids(p, **base_kw))
        t_base += time.perf_counter() - t0
        n_base += len(target_only[-1])
        t0 = time.perf_counter()
        spec.append(gen.generate_ids(p, **spec_kw))
        t_spec += time.perf_counter() - t0
        n_spec += len(spec[-1])
    out = {"ran": True, "logits": logits, "target_only": target_only,
           "tok_s_target_only": n_base / t_base, "tok_s_spec": n_spec / t_spec,
           "drafter": spec_kw["drafter"]}
    reference = ref or out
    exact = sum(a == r and b == r for a, b, r in zip(target_only, spec, reference["target_only"]))
    out["exact"] = f"{exact}/{len(prompts)}"
    out["max_logit_err"] = float(np.max(np.abs(logits - reference["logits"])))
    return out


def check_head_training(tmp: Path, steps: int = 3) -> dict:
    """``specdec-train-head --device cuda`` against cpu: a few float32 steps of the reference
    head's shape from the shipped target, same seed and windows; the per-step losses must agree
    to 1e-3 relative (summation order differs between the devices, nothing else)."""
    try:
        import torch
    except ImportError:
        return {"ran": False, "why": "not available: torch is not installed"}
    if not torch.cuda.is_available():
        return {"ran": False, "why": "not available: torch sees no CUDA device"}
    from transformers import AutoTokenizer

    from specdec_rt.export import eagle_train as et

    target = ROOT / "specdec_rt" / "data" / "reference" / "target"
    text = "".join((ROOT / "specdec_rt" / "runtime" / f).read_text() for f in ("engine.py", "eagle.py"))
    stream = np.asarray(AutoTokenizer.from_pretrained(str(target))(text)["input_ids"], dtype=np.int64)
    losses, seconds = {}, {}
    for device in ("cpu", "cuda"):
        cfg = et.TrainConfig(steps=steps, seq_len=128, batch=4, warmup=1, ttt_steps=3, device=device, seed=7)
        t0 = time.perf_counter()
        log = et.train_head(target, stream, tmp / f"head-{device}", cfg, progress=False)
        seconds[device] = round(time.perf_counter() - t0, 2)
        losses[device] = [s["loss"] for s in log["steps"]]
    worst = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(losses["cpu"], losses["cuda"]))
    return {"ran": True, "losses": losses, "max_rel_diff": worst, "seconds": seconds, "ok": worst < 1e-3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", help="existing bundle (portable, for the TensorRT backends)")
    ap.add_argument("--target", help="target checkpoint to export (default specdec_rt/data/reference/target)")
    ap.add_argument("--draft", help="draft checkpoint to export")
    ap.add_argument("--tiny", action="store_true", help="export a tiny random pair (tests/helpers.py)")
    ap.add_argument("--build-engines", action="store_true",
                    help="build native TensorRT engines into --bundle if missing (modifies it)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_path", help="write the results here")
    ap.add_argument("--head-training", action="store_true",
                    help="also train the reference EAGLE-3 head's shape for a few steps on cuda and on cpu "
                         "(specdec-train-head --device; needs torch with CUDA and transformers)")
    args = ap.parse_args(argv)

    from specdec_rt.errors import USER_ERRORS

    prompts = _prompts(args.prompts)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        bundle, own = make_bundle(args, Path(tmp))
        ref = None
        for name, kwargs, why in backends(bundle, own, args.build_engines):
            if kwargs is None:
                rows[name] = {"ran": False, "why": f"not available: {why}"}
                continue
            try:
                res = check_one(bundle, kwargs, prompts, args.max_new_tokens, ref, args.threads)
            except USER_ERRORS as exc:
                rows[name] = {"ran": False, "why": f"not available: {exc}"}
                continue
            except Exception as exc:  # noqa: BLE001 - a broken backend must not hide the others
                rows[name] = {"ran": False, "why": f"failed: {type(exc).__name__}: {exc}"}
                continue
            if name == "cpu":
                ref = res
            rows[name] = {k: v for k, v in res.items() if k not in ("logits", "target_only")}

    print(f"{'backend':<22} | {'ran? / why not':<14} | {'exact':<5} | {'max logit err':>13} | "
          f"{'tok/s target':>12} | {'tok/s spec K=4':>14}")
    print("-" * 98)
    for name, r in rows.items():
        if not r["ran"]:
            print(f"{name:<22} | {r['why']}")
            continue
        print(f"{name:<22} | {'yes':<14} | {r['exact']:<5} | {r['max_logit_err']:>13.3g} | "
              f"{r['tok_s_target_only']:>12.1f} | {r['tok_s_spec']:>14.1f}")
    training = None
    if args.head_training:
        with tempfile.TemporaryDirectory(prefix="gpu_check_head_") as tmp:
            training = check_head_training(Path(tmp))
        print(f"head training cuda vs cpu: {training}")
    if args.json_path:
        meta = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                "reference": "cpu target-only greedy", "bundle": None if own else str(bundle)}
        Path(args.json_path).write_text(json.dumps({"meta": meta, "backends": rows, "head_training": training},
                                                   indent=2))
    ok = all(r["exact"] == f"{len(prompts)}/{len(prompts)}" for r in rows.values() if r["ran"])
    return 0 if ok and (training is None or not training["ran"] or training["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
