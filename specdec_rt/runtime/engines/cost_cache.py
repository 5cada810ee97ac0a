"""The measured cost model kept on disk, per bundle and machine: "auto" without a cold start.

"auto" decides from T(S) (the target's time for S new tokens, S = 1..33) and the draft's step
time, measured on the machine at hand. Measuring takes a moment on a small pair (~0.3 s) but
~20 s on a 1.5B int4 target on 2 cores (12 round-robin passes over 16 call widths), which a
one-off ``specdec-run`` would pay on every start. The figures depend only on the graphs and the
machine, so they are stored once under a key of both and read back by later processes.

Key: the bundle's graph checksums (manifest), the CPU model and core count, the ONNX Runtime
version, the provider, the thread settings and the clock. Location: ``$SPECDEC_CACHE_DIR`` (or
``~/.cache/specdec-rt``) ``/costs/<key>.json``; ``SPECDEC_COST_CACHE=0`` turns it off. A file
that does not parse is ignored and rewritten. The first generation of each new (bundle,
machine) still measures; widths of batched calls are added as they are measured.

Load-time probe verdicts that take seconds at scale (:func:`probe_key`: whether prompt K/V
equal decoding's, for the prefix cache) are kept the same way in ``probes/<key>.json``, under a
key that also holds the CPU's feature flags and the engine's padding.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

VERSION = 2  # cost models; 2: T(S) up to S = 33 (cost_model.MAX_VERIFY_ROWS)
PROBE_VERSION = 1  # probe verdicts (kept when only the cost model's format changes)


def cache_dir() -> Path | None:
    """Where cost models are kept, or None when caching is off."""
    if os.environ.get("SPECDEC_COST_CACHE", "1") in ("0", "false", "no", "off"):
        return None
    root = os.environ.get("SPECDEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specdec-rt")
    return Path(root) / "costs"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_key(manifest: dict, role_graphs: list[str], machine: dict, version: int = VERSION) -> str:
    """A digest of the graphs' checksums (and their external data) and the machine."""
    import onnxruntime as ort

    files = manifest.get("files", {})
    graphs = {f: d for f, d in sorted(files.items()) if any(f.startswith(g.rsplit("/", 1)[0] + "/") for g in role_graphs)}
    ident = {"version": version, "graphs": graphs, "cpu": _cpu(), "cores": os.cpu_count(),
             "onnxruntime": ort.__version__, **machine}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]


def engine_settings(engine) -> dict:
    """What of an engine's setup changes its timings: provider and thread pools."""
    if engine is None:
        return {}
    opts = getattr(getattr(engine, "session", None), "get_session_options", lambda: None)()
    return {"provider": getattr(engine, "provider", type(engine).__name__),
            "threads": getattr(opts, "intra_op_num_threads", None),
            "own_pool": getattr(opts, "use_per_session_threads", None)}


def _read(d: Path | None, key: str, version: int = VERSION) -> dict | None:
    """The JSON object ``d/<key>.json`` of this cache's version, or None (absent, unreadable,
    another version, caching off)."""
    if d is None:
        return None
    try:
        data = json.loads((d / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == version else None


def _write(d: Path | None, key: str, data: dict, version: int = VERSION) -> None:
    """Write atomically (a reader never sees half a file); a read-only cache is not an error."""
    if d is None:
        return
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": version, **data}, f)
        os.replace(tmp, d / f"{key}.json")
    except OSError:
        pass


def load_cost(key: str) -> dict | None:
    """``{"target_times": [...], "draft_step": c, "widths": {B: (times, c)}}`` or None."""
    data = _read(cache_dir(), key)
    try:
        return None if data is None else {
            "target_times": [float(x) for x in data["target_times"]], "draft_step": float(data["draft_step"]),
            "widths": {int(b): ([float(x) for x in t], float(c)) for b, (t, c) in data["widths"].items()}}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def save_cost(key: str, target_times: list[float], draft_step: float, widths: dict) -> None:
    _write(cache_dir(), key, {"target_times": list(target_times), "draft_step": draft_step,
                              "widths": {str(b): [list(t), c] for b, (t, c) in widths.items()}})


def _cpu_flags() -> str:
    """The CPU's feature flags: which kernels ONNX Runtime dispatches to (a hypervisor may hide
    some behind the same model name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return hashlib.sha256(line.split(":", 1)[1].strip().encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.machine()


def probe_key(manifest: dict, role_graph: str, engine, probe: str) -> str:
    """The key of a load-time probe's verdict for one engine (the graph, this machine's CPU and
    its feature flags, the engine's thread setup and padding, the probe's name)."""
    machine = {"probe": probe, "engine": engine_settings(engine), "flags": _cpu_flags(),
               "min_rows": getattr(engine, "min_rows", None), "max_len": getattr(engine, "max_len", None)}
    return cost_key(manifest, [role_graph], machine, PROBE_VERSION)


def _probe_dir() -> Path | None:
    d = cache_dir()
    return None if d is None else d.parent / "probes"


def load_probe(key: str) -> bool | None:
    """A stored probe verdict, or None (not measured here yet, unreadable, caching off)."""
    data = _read(_probe_dir(), key, PROBE_VERSION)
    return None if data is None or not isinstance(data.get("verdict"), bool) else data["verdict"]


def save_probe(key: str, verdict: bool) -> None:
    _write(_probe_dir(), key, {"verdict": bool(verdict)}, PROBE_VERSION)
