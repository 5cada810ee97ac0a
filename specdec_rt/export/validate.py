"""Export-time validation: the ONNX graph against the PyTorch model it came from.

Tracing or hand-building a graph can bake in a shape-specific branch, a wrong rotary half, a
wrong K/V layout. Every export is run through ONNX Runtime for prefill (P = 0), chain verify
(S = 4 on P > 0), single-token decode (S = 1, which must also equal the matching row of the
S = 4 call) and a token tree (custom mask, depth positions), and compared with PyTorch; models
with a short sliding window repeat all of it on a past longer than the window.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from specdec_rt.errors import ValidationError  # noqa: F401 - defined there, re-exported here
from specdec_rt.export.arch import ArchSpec

# parents of a small token tree: node 0 is the root; depth = distance to the root
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]


@dataclass
class ValidationReport:
    max_logit_error: float = 0.0
    max_kv_error: float = 0.0
    decode_vs_verify_error: float = 0.0
    tree_error: float = 0.0
    top1_agreement: float = 1.0
    tolerance: float = 0.0
    cases: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _torch_kv(past, layer: int):
    """(keys, values) [B, Hkv, T, D] from any transformers cache flavour."""
    if hasattr(past, "layers"):
        return past.layers[layer].keys, past.layers[layer].values
    if hasattr(past, "key_cache"):
        return past.key_cache[layer], past.value_cache[layer]
    return past[layer][0], past[layer][1]


def tree_mask_and_depths(parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Ancestor-or-self visibility matrix [N, N] and depths for a parent-pointer tree."""
    n = len(parents)
    visible = np.zeros((n, n), dtype=bool)
    depth = np.zeros(n, dtype=np.int64)
    for i, parent in enumerate(parents):
        visible[i, i] = True
        if parent >= 0:
            visible[i] |= visible[parent]
            depth[i] = depth[parent] + 1
    return visible, depth


def _additive(allowed: np.ndarray) -> np.ndarray:
    return np.where(allowed, 0.0, -np.inf).astype(np.float32)


class _OrtRunner:
    def __init__(self, onnx_path: str, spec: ArchSpec, kv_dtype: np.dtype) -> None:
        import onnxruntime as ort

        from specdec_rt.runtime.engine import session_options

        self.sess = ort.InferenceSession(onnx_path, session_options(), providers=["CPUExecutionProvider"])
        self.spec = spec
        self.kv_dtype = kv_dtype

    def empty_past(self):
        s = self.spec
        z = np.zeros((1, 0, s.num_kv_heads, s.head_dim), dtype=self.kv_dtype)
        return [(z, z) for _ in range(s.num_layers)]

    def run(self, tokens, positions, past, new_allowed: np.ndarray | None = None):
        s_len = len(tokens)
        p_len = past[0][0].shape[1]
        allowed = np.ones((s_len, p_len + s_len), dtype=bool)
        causal = np.tril(np.ones((s_len, s_len), dtype=bool)) if new_allowed is None else new_allowed
        allowed[:, p_len:] = causal
        window = self.spec.sliding_window
        if window:  # the same sliding-window rule as the runtime's masks: q - k < window
            key_pos = np.concatenate([np.arange(p_len), np.asarray(positions)])
            allowed &= (np.asarray(positions)[:, None] - key_pos[None, :]) < window
        feed = {
            "input_ids": np.asarray([tokens], dtype=np.int64),
            "position_ids": np.asarray([positions], dtype=np.int64),
            "attention_mask": _additive(allowed)[None, None],
        }
        for i, (k, v) in enumerate(past):
            feed[f"past_key.{i}"] = k
            feed[f"past_value.{i}"] = v
        out = self.sess.run(None, feed)
        new = [(out[1 + 2 * i], out[2 + 2 * i]) for i in range(self.spec.num_layers)]
        return out[0][0], new


def _concat(past, new):
    return [(np.concatenate([pk, nk], axis=1), np.concatenate([pv, nv], axis=1))
            for (pk, pv), (nk, nv) in zip(past, new)]


# windows up to this long get a validation case whose committed past exceeds the window (the
# PyTorch reference then runs sequences of window + 7 tokens); longer windows are left to the tests
PAST_WINDOW_LIMIT = 512


def _shortest_window(spec: ArchSpec) -> int | None:
    windows = [w for w in [spec.sliding_window, *(spec.layer_windows or [])] if w]
    return min(windows) if windows else None


def _run_cases(torch_model, runner: _OrtRunner, spec: ArchSpec, rng, prefix_len: int, verify_len: int,
               tag: str) -> dict:
    """Prefill, chain verify, decode and tree on a ``prefix_len``-token past; errors vs PyTorch."""
    import torch

    vocab = spec.vocab_size
    total = prefix_len + verify_len
    tokens = rng.integers(0, vocab, size=total).tolist()
    with torch.no_grad():
        ref = torch_model(torch.tensor([tokens]), use_cache=True)
    ref_logits = ref.logits[0].float().numpy()
    cases: dict[str, float] = {}

    # prefill, P = 0
    lg_a, kv_a = runner.run(tokens[:prefix_len], list(range(prefix_len)), runner.empty_past())
    cases[f"prefill_P0{tag}"] = float(np.abs(lg_a - ref_logits[:prefix_len]).max())
    # chain verify, S = verify_len on P > 0
    past = kv_a
    lg_b, kv_b = runner.run(tokens[prefix_len:], list(range(prefix_len, total)), past)
    cases[f"verify_S{verify_len}{tag}"] = float(np.abs(lg_b - ref_logits[prefix_len:]).max())
    # K/V of every position against PyTorch's cache
    kv_err = 0.0
    full = _concat(kv_a, kv_b)
    for i in range(spec.num_layers):
        rk, rv = _torch_kv(ref.past_key_values, i)
        rk = rk[0].transpose(0, 1).float().numpy()
        rv = rv[0].transpose(0, 1).float().numpy()
        n = rk.shape[0]  # a sliding-window cache keeps only the last positions
        kv_err = max(kv_err, float(np.abs(full[i][0][0][-n:].astype(np.float32) - rk).max()),
                     float(np.abs(full[i][1][0][-n:].astype(np.float32) - rv).max()))
    # decode S = 1 must equal the matching row of the S > 1 call
    lg_c, _ = runner.run(tokens[prefix_len:prefix_len + 1], [prefix_len], past)
    decode_vs_verify = float(np.abs(lg_c[0] - lg_b[0]).max())
    cases[f"decode_S1{tag}"] = float(np.abs(lg_c[0] - ref_logits[prefix_len]).max())

    # tree verify against sequential PyTorch runs of each root-to-node path
    visible, depth = tree_mask_and_depths(TREE_PARENTS)
    tree_tokens = rng.integers(0, vocab, size=len(TREE_PARENTS)).tolist()
    lg_t, _ = runner.run(tree_tokens, (prefix_len + depth).tolist(), past, new_allowed=visible)
    tree_err = 0.0
    agree = []
    for node in range(len(TREE_PARENTS)):
        path = [j for j in range(len(TREE_PARENTS)) if visible[node, j]]
        seq = tokens[:prefix_len] + [tree_tokens[j] for j in path]
        with torch.no_grad():
            row = torch_model(torch.tensor([seq])).logits[0, -1].float().numpy()
        tree_err = max(tree_err, float(np.abs(lg_t[node] - row).max()))
        agree.append(int(np.argmax(lg_t[node]) == np.argmax(row)))
    cases[f"tree{tag}"] = tree_err
    all_rows = np.concatenate([lg_a, lg_b])
    agree += (np.argmax(all_rows, -1) == np.argmax(ref_logits, -1)).astype(int).tolist()
    return {"cases": cases, "kv": kv_err, "decode_vs_verify": decode_vs_verify, "tree": tree_err,
            "agree": agree, "scale": max(1.0, float(np.abs(ref_logits).max()))}


def validate(torch_model, onnx_path: str, spec: ArchSpec, *, kv_dtype=np.float32,
             tolerance: float | None = None, enforce: bool = True, seed: int = 0,
             prefix_len: int = 7, verify_len: int = 4) -> ValidationReport:
    """Compare the ONNX graph with ``torch_model`` (fp32) on prefill, verify, decode and a tree.

    With a sliding window of at most ``PAST_WINDOW_LIMIT`` tokens that the default past does not
    exceed, every case runs a second time on a past longer than the window (cases ``*_past_window``).
    """
    rng = np.random.default_rng(seed)
    runner = _OrtRunner(onnx_path, spec, np.dtype(kv_dtype))
    runs = [(prefix_len, "")]
    window = _shortest_window(spec)
    if (window and prefix_len <= window <= PAST_WINDOW_LIMIT
            and window + 3 + verify_len + len(TREE_PARENTS) <= spec.max_positions):
        runs.append((window + 3, "_past_window"))
    results = [_run_cases(torch_model, runner, spec, rng, p, verify_len, tag) for p, tag in runs]

    scale = max(r["scale"] for r in results)
    tol = tolerance if tolerance is not None else 1e-3 * scale
    report = ValidationReport(tolerance=tol)
    for r in results:
        report.cases.update(r["cases"])
    kv_err = report.max_kv_error = max(r["kv"] for r in results)
    report.decode_vs_verify_error = max(r["decode_vs_verify"] for r in results)
    report.tree_error = max(r["tree"] for r in results)
    report.top1_agreement = float(np.mean([a for r in results for a in r["agree"]]))
    report.max_logit_error = max(report.cases.values())
    if enforce and (report.max_logit_error > tol or report.decode_vs_verify_error > tol or kv_err > tol):
        raise ValidationError(
            f"exported graph disagrees with PyTorch: max logit error {report.max_logit_error:.3g}, "
            f"K/V error {kv_err:.3g}, decode-vs-verify {report.decode_vs_verify_error:.3g} "
            f"(tolerance {tol:.3g}); cases: "
            + ", ".join(f"{k}={v:.3g}" for k, v in report.cases.items())
        )
    return report
