"""Benchmark outputs: results.json, a markdown table and PNG plots."""
from __future__ import annotations

import json
from pathlib import Path

from specdec_rt.bench.runner import ideal_speedup


def _f(x, fmt="{:.2f}") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return fmt.format(x)


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, onnxruntime {m['onnxruntime']}, Python {m['python']}.",
        f"Settings: {results['settings']}. Target-only: "
        f"{_f(results['target_only_tokens_per_second'], '{:.1f}')} tok/s; c (draft step / target step) = "
        f"{results['c']:.3f}; peak RSS {results['peak_rss_mb']:.0f} MB.",
        "",
        "| configuration | tok/s | speedup | alpha | tokens/call | T(S)/T(1) | ideal | efficiency | loop overhead | identical | look-ahead hits |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['name']} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | {_f(r['alpha'])} | "
            f"{r['tokens_per_target_call']:.2f} | {r['t_ratio']:.2f} | {_f(r['ideal_speedup'])} | "
            f"{_f(r['efficiency'])} | {r['loop_overhead_share']:.1%} | {_f(r['identical_to_target_only'])} | "
            f"{_f(r.get('lookahead_hit_rate'))} |"
        )
    others = [p for p in results.get("peers", []) if not str(p.get("system", "")).startswith("llama.cpp")]
    if others:
        lines += ["", "| peer | K | tok/s | alpha | our best / peer | ours at same K / peer | identical |",
                  "|---|---|---|---|---|---|---|"]
        for p in others:
            if not p.get("ran", True):
                lines.append(f"| {p['system']} | - | not run: {p.get('reason')} | | | | |")
                continue
            lines.append(
                f"| {p['system']} | {p['k'] or '-'} | {p['tokens_per_second']:.1f} | {_f(p.get('alpha'))} | "
                f"{_f(p.get('ours_best_over_peer'))}x | {_f(p.get('ours_same_k_over_peer'))} | "
                f"{_f(p['identical_to_target_only'])} |"
            )
    lines += _llama_cpp_lines(results)
    if results.get("graphs"):
        sizes = sorted(int(k[len("ratio_S"):]) for k in results["graphs"][0] if k.startswith("ratio_S"))
        lines += ["", "| graph | nodes ours / genai | " + " | ".join(f"S={s} ms ours / genai" for s in sizes)
                  + " | latency ratio " + ", ".join(f"S={s}" for s in sizes) + " |",
                  "|---|---|" + "---|" * len(sizes) + "---|"]
        for g in results["graphs"]:
            name = g["role"] + (f" {g['quantization']}" if g.get("quantization") else "")
            pad = " (1-row calls padded)" if g.get("min_rows_ours", 1) > 1 else ""
            lines.append(
                f"| {name}{pad} (P={g['past']}) | {g['nodes_ours']} / {g['nodes_genai']} | "
                + " | ".join(f"{g[f'ms_ours_S{s}']:.3f} / {g[f'ms_genai_S{s}']:.3f}" for s in sizes)
                + " | " + ", ".join(f"{g[f'ratio_S{s}']:.2f}" for s in sizes) + " |")
    curve = results["target_time_curve"]
    lines += ["", "Target time T(S)/T(1): " + ", ".join(f"S={s}: {r:.2f}" for s, r in zip(curve["S"], curve["ratio"]))]
    if results.get("target_min_rows", 1) > 1:
        lines.append(f"(one-row target calls padded to {results['target_min_rows']} rows for exactness: "
                     "T(1) is the padded cost)")
    if results.get("predicted_speedup"):
        lines += ["", "Predicted chain speedup from this cost model: " + "; ".join(
            f"alpha {p['alpha']}: {p['speedup']:.2f}x at K={p['best_k']}" for p in results["predicted_speedup"])]
    return "\n".join(lines) + "\n"


def _llama_cpp_lines(results: dict) -> list[str]:
    """llama.cpp's rows (its own speeds and identity) and its T(S) curve beside ours."""
    rows = [p for p in results.get("peers", []) if str(p.get("system", "")).startswith("llama.cpp")]
    if not rows:
        return []
    lines = ["", "| llama.cpp | K | tok/s | decode tok/s | prompt tok/s | alpha | speedup over its target-only | "
             "our best / it | ours at same K / it | output == its own plain decode |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in rows:
        if not p.get("ran", True):
            lines.append(f"| {p['system']} | - | not run: {p.get('reason')} | | | | | | | |")
            continue
        lines.append(
            f"| {p['system']} | {p['k'] or '-'} | {_f(p['tokens_per_second'], '{:.1f}')} | "
            f"{_f(p.get('decode_tokens_per_second'), '{:.1f}')} | {_f(p.get('prompt_tokens_per_second'), '{:.1f}')} | "
            f"{_f(p.get('alpha'))} | {_f(p.get('speedup_over_own_target_only'))}x | "
            f"{_f(p.get('ours_best_over_peer'))}x | {_f(p.get('ours_same_k_over_peer'))} | "
            f"{_f(p.get('identical_to_own_target_only'))} |")
    curve = (results.get("llama_cpp") or {}).get("time_curve")
    if curve:
        ours = dict(zip(results["target_time_curve"]["S"], results["target_time_curve"]["ratio"]))
        sizes = curve["S"]
        lines += ["", f"T(S)/T(1), S tokens per call after {curve.get('depth', 0)} past tokens "
                  f"(llama.cpp: llama-bench, {curve.get('repeats')} repeats):", "",
                  "| | " + " | ".join(f"S={s}" for s in sizes) + " |", "|---|" + "---|" * len(sizes),
                  "| ours | " + " | ".join(_f(ours.get(s)) for s in sizes) + " |",
                  "| llama.cpp | " + " | ".join(_f(r) for r in curve["ratio"]) + " |"]
    return lines


def plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    rows = results["rows"]
    curve = results["target_time_curve"]
    ratio = curve["ratio"]

    # speedup vs K, measured and ideal from measured alpha and costs
    fig, ax = plt.subplots(figsize=(6, 4))
    for drafter in ("model", "prompt_lookup"):
        pts = [(r["k"], r["speedup"], r["alpha"], r["c"], r["ideal_speedup"]) for r in rows
               if r["drafter"] == drafter and r["speculation"] == "chain" and isinstance(r["k"], int)
               and not r.get("overlap")]
        if not pts:
            continue
        pts.sort()
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{drafter}: measured")
        ax.plot([p[0] for p in pts], [p[4] for p in pts], "x:", color=line.get_color(),
                label=f"{drafter}: ideal from measured tokens/call and costs")
        if drafter == "model" and pts[0][0] == 1:
            # Leviathan et al.'s i.i.d. model, alpha = per-token acceptance measured at K = 1
            alpha, c = pts[0][2], pts[0][3]
            ks = list(range(1, 17))
            ax.plot(ks, [ideal_speedup(alpha, k, c, ratio[min(k, 15)]) for k in ks], "--", lw=1,
                    label=f"Leviathan i.i.d. (alpha={alpha:.2f} at K=1, c={c:.3f})")
    pts = sorted((r["k"], r["speedup"], r["ideal_speedup"]) for r in rows
                 if r.get("overlap") and isinstance(r["k"], int))
    if pts:
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "s-", label="model overlapped: measured")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "+:", color=line.get_color(),
                label="model overlapped: ideal (hidden drafting free)")
    for r in rows:
        if r["k"] == "auto" or r["speculation"] == "tree":
            ax.axhline(r["speedup"], ls=":", lw=1, color="gray")
            ax.text(0.5, r["speedup"], r["name"], fontsize=7, va="bottom")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xlabel("draft tokens K")
    ax.set_ylabel("speedup over target-only")
    ax.legend(fontsize=7)
    ax.set_title("Speedup vs K")
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_k.png", dpi=110)
    files.append("speedup_vs_k.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curve["S"], ratio, "o-", label="ours")
    llama_curve = (results.get("llama_cpp") or {}).get("time_curve")
    if llama_curve:
        ax.plot(llama_curve["S"], llama_curve["ratio"], "s--", label="llama.cpp (llama-bench)")
        ax.legend(fontsize=8)
    ax.set_xlabel("S (tokens per target call)")
    ax.set_ylabel("T(S) / T(1)")
    ax.set_title("Target cost of verifying S tokens")
    fig.tight_layout()
    fig.savefig(out / "target_time.png", dpi=110)
    files.append("target_time.png")
    plt.close(fig)

    if any(p.get("ran", True) and p.get("tokens_per_second") for p in results.get("peers", [])):
        files.append(_peers_plot(results, out, plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        acc = r.get("per_position_acceptance") or []
        if acc and r["drafter"] == "model":
            ax.plot(range(1, len(acc) + 1), acc, "o-", label=r["name"], ms=3)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of drafted positions accepted")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    ax.set_title("Per-position acceptance")
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    files.append("acceptance.png")
    plt.close(fig)
    return files


def _peers_plot(results: dict, out: Path, plt) -> str:
    """tok/s of our target-only and best configuration beside every peer row that ran."""
    rows = results["rows"]
    best = max(rows, key=lambda r: r["tokens_per_second"])
    bars = [("ours: target-only", results["target_only_tokens_per_second"], "C0"),
            (f"ours: {best['name']}", best["tokens_per_second"], "C0")]
    for p in results["peers"]:
        if p.get("ran", True) and p.get("tokens_per_second"):
            label = p["system"] + (f" K={p['k']}" if p.get("k") else "")
            bars.append((label, p["tokens_per_second"], "C2" if label.startswith("llama.cpp") else "C1"))
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(bars) + 1.2))
    ax.barh(range(len(bars)), [b[1] or 0 for b in bars], color=[b[2] for b in bars])
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("tokens per second (prompt evaluation included)")
    ax.set_title("Ours beside the peers")
    fig.tight_layout()
    fig.savefig(out / "peers.png", dpi=110)
    plt.close(fig)
    return "peers.png"


def write(results: dict, out: Path) -> dict:
    return write_outputs(results, out, "results", markdown, plots)


def write_outputs(results: dict, out: Path, stem: str, to_markdown, to_plots) -> dict:
    """``<stem>.json``, ``<stem>.md`` and the plots (skipped without matplotlib) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2, default=str))
    md = to_markdown(results)
    (out / f"{stem}.md").write_text(md)
    files = [f"{stem}.json", f"{stem}.md"]
    try:
        files += to_plots(results, out)
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'specdec-rt[bench]')")
    return {"files": files, "markdown": md}
