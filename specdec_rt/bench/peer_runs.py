"""Run the peer systems on the bundle's source checkpoints and compare with our runs."""
from __future__ import annotations

import time

from pathlib import Path

from specdec_rt.bench import llama_cpp_peer
from specdec_rt.bench import peers as P
from specdec_rt.bench.common import NO_SPIN, UNPADDED


def _source_dirs(gen) -> tuple[Path, Path | None]:
    models = gen.bundle.manifest["models"]
    target = Path(models["target"]["source"]["checkpoint"])
    draft = Path(models["draft"]["source"]["checkpoint"]) if "draft" in models else None
    return target, draft


# onnxruntime-genai builder settings matching our --quantize: MatMulNBits, symmetric, block 32,
# accuracy level 4 (int8 activations), as specdec_rt.export.quantize writes them
GENAI_PRECISION = {None: ("fp32", None), "int4": ("int4", {"int4_accuracy_level": 4, "int4_block_size": 32})}


def genai_models(cfg, gen) -> dict[str, Path]:
    """onnxruntime-genai exports of the bundle's source checkpoints (cached in cfg.peer_cache), in
    the precision of each of our graphs (fp32, or int4 when the bundle's model is int4)."""
    target_dir, draft_dir = _source_dirs(gen)
    cache = Path(cfg.peer_cache)
    models = gen.bundle.manifest["models"]
    built = {}
    for role, src in (("target", target_dir), ("draft", draft_dir)):
        if src is None:
            continue
        quant = models[role].get("quantization")
        if quant not in GENAI_PRECISION:
            raise P.PeerUnavailable(f"no onnxruntime-genai builder setting for {quant} (ours: {role})")
        precision, extra = GENAI_PRECISION[quant]
        out = cache / (role if precision == "fp32" else f"{role}-{precision}")
        built[role] = P.build_ortgenai_models([(src, out)], precision=precision, extra_options=extra)[0]
    return built


def _summarize(runs: list, system: str, k, base_outputs: dict, our_tps: float, our_k_tps: dict) -> dict:
    tokens = sum(len(r.token_ids) for r in runs)
    seconds = sum(r.seconds for r in runs)
    tps = tokens / seconds if seconds else 0.0
    identical = all(r.token_ids == base_outputs[i] for i, r in enumerate(runs))
    row = {"system": system, "k": k, "tokens_per_second": tps,
           "identical_to_target_only": identical,
           "ours_best_over_peer": our_tps / tps if tps else None}
    if k in our_k_tps:
        row["ours_same_k_over_peer"] = our_k_tps[k] / tps if tps else None
    proposed = sum(r.extra.get("proposed", 0) or 0 for r in runs)
    accepted = sum(r.extra.get("accepted", 0) or 0 for r in runs)
    if proposed:
        row["alpha"] = accepted / proposed
    if not identical:
        first = next(i for i, r in enumerate(runs) if r.token_ids != base_outputs[i])
        a, b = runs[first].token_ids, base_outputs[first]
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        row["first_divergence"] = {"prompt": first, "position": pos}
    return row


def run_peers(cfg, gen, prompts: list[list[int]], base: dict, acc: dict, extras: dict | None = None) -> list[dict]:
    """Peers on the same checkpoints, prompts and thread count; each row says what ran. A peer's
    details beyond its rows (llama.cpp's texts and T(S) curve) go into ``extras``."""
    from tqdm import tqdm

    target_dir, draft_dir = _source_dirs(gen)
    base_outputs = base["outputs"]
    def k_of(name: str) -> int | str:  # "model K=4" -> 4, "model K=auto" -> "auto"
        k = name.split("=", 1)[1]
        return int(k) if k.isdigit() else k

    our_k_tps = {k_of(name): a["tokens"] / a["seconds"] for name, a in acc.items()
                 if name.startswith("model K=")}
    best = max(a["tokens"] / a["seconds"] for a in acc.values())
    avail = P.available_peers()
    # the clock ours ran on: with --clock cpu (one thread), this process's CPU time for the peers
    # too (they run in this process), so other jobs on a shared machine distort neither side
    clock = time.process_time if cfg.clock == "cpu" else time.perf_counter
    out: list[dict] = []
    n = cfg.max_new_tokens
    ks = [k for k in cfg.ks if 1 <= k <= 16]
    bar = tqdm(total=len(cfg.peers), desc="peers", unit="system") if cfg.progress else None
    for peer in cfg.peers:
        try:
            if peer == "transformers":
                if avail.get("transformers"):
                    raise P.PeerUnavailable(avail["transformers"])
                runs = P.run_transformers(target_dir, prompts, n, threads=cfg.threads, clock=clock)
                out.append(_summarize(runs, "transformers generate", 0, base_outputs, best, our_k_tps))
                if draft_dir is not None:
                    k = 4 if 4 in ks else ks[0]
                    runs = P.run_transformers(target_dir, prompts, n, draft_dir=draft_dir,
                                              num_draft_tokens=k, threads=cfg.threads, clock=clock)
                    out.append(_summarize(runs, "transformers assisted", k, base_outputs, best, our_k_tps))
            elif peer in ("onnxruntime-genai", "ortgenai"):
                if avail.get("ortgenai"):
                    raise P.PeerUnavailable(avail["ortgenai"])
                built = list(genai_models(cfg, gen).values())
                runs = P.run_ortgenai(built[0], prompts, n, threads=cfg.threads, clock=clock)
                out.append(_summarize(runs, "onnxruntime-genai", 0, base_outputs, best, our_k_tps))
                if draft_dir is not None:
                    for k in ks:
                        runs = P.run_ortgenai(built[0], prompts, n, draft_genai_dir=built[1],
                                              num_draft_tokens=k, threads=cfg.threads, clock=clock)
                        out.append(_summarize(runs, "onnxruntime-genai spec", k, base_outputs, best, our_k_tps))
                    kmax = max(ks)
                    runs = P.run_ortgenai(built[0], prompts, n, draft_genai_dir=built[1],
                                          num_draft_tokens=kmax, threads=cfg.threads, adaptive=True,
                                          min_adaptive_k=1, clock=clock)
                    row = _summarize(runs, "onnxruntime-genai spec adaptive", "auto", base_outputs, best, our_k_tps)
                    row["max_k"] = kmax
                    out.append(row)
            elif llama_cpp_peer.is_llama_cpp(peer):
                out += _llama_cpp(cfg, gen, acc, extras)
            else:
                out.append({"system": peer, "ran": False, "reason": "unknown peer"})
        except P.PeerUnavailable as exc:
            out.append({"system": peer, "ran": False, "reason": str(exc)})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    for row in out:
        row.setdefault("ran", True)
    return out


def _llama_cpp(cfg, gen, acc: dict, extras: dict | None) -> list[dict]:
    """llama.cpp on the same prompt texts (its own tokenizer), max_new_tokens and threads."""
    plan = llama_cpp_peer.plan(cfg, gen.bundle.manifest, gen.max_length)
    rows, details = llama_cpp_peer.run(plan, list(cfg.prompts), cfg.max_new_tokens, repeats=cfg.repeats,
                                       seed=cfg.seed, progress=cfg.progress)
    bases = [acc[n] for n in ("target-only", UNPADDED, NO_SPIN) if n in acc and acc[n]["seconds"]]
    fastest = min(bases, key=lambda a: a["seconds"], default=None)
    llama_cpp_peer.compare_with_ours(rows, acc, fastest["tokens"] / fastest["seconds"] if fastest else None)
    if extras is not None:
        extras["llama_cpp"] = details
    return rows
