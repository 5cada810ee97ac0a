"""Export-time validation: the ONNX graph against the PyTorch model it came from.

Tracing or hand-building a graph can bake in a shape-specific branch, a wrong rotary half, a
wrong K/V layout. Every export is run through ONNX Runtime for prefill (P = 0), chain verify
(S = 4 on P > 0), single-token decode (S = 1, which must also equal the matching row of the
S = 4 call) and a token tree (custom mask, depth positions), and compared with PyTorch; models
with a short sliding window repeat all of it on a past longer than the window.

Two phases, so that PyTorch and ONNX Runtime never hold a large model at the same time:
``reference_outputs`` runs PyTorch for every case (two forward calls per run: the sequence, and
every root-to-node tree path in one padded batch), the exporter frees the torch model, and
``compare`` runs the graph. Sequences are short (11 tokens + a 7-node tree): the cost at scale
is loading, not the cases.
"""
from __future__ import annotations

import time
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
    max_abs_logit: float = 0.0  # PyTorch's largest |logit| on the cases: the scale of the errors
    tolerance: float = 0.0
    cases: dict[str, float] = field(default_factory=dict)
    # a target exported for an EAGLE-3 head: its ``features`` output against eagle.target_features
    # on the same tokens (prefill and verify rows): {"cases", "max_error", "max_abs", "tolerance"}
    features: dict | None = None
    # where the time went: PyTorch's reference calls, ONNX Runtime's session creation (reading the
    # weights, prepacking) and the graph's runs on the cases
    seconds: dict[str, float] = field(default_factory=dict)

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
    def __init__(self, onnx_path: str, spec: ArchSpec, kv_dtype: np.dtype, prepack: bool = True) -> None:
        import onnxruntime as ort

        from specdec_rt.runtime.engines.sessions import session_options

        opts = session_options()
        if not prepack:
            opts.add_session_config_entry("session.disable_prepacking", "1")
        self.sess = ort.InferenceSession(onnx_path, opts, providers=["CPUExecutionProvider"])
        self.spec = spec
        self.kv_dtype = kv_dtype
        self.columns: np.ndarray | None = None  # compare only these logit columns (a cut LM head)
        self.has_features = any(o.name == "features" for o in self.sess.get_outputs())
        self.features: np.ndarray | None = None  # the last run's ``features`` rows [S, F], if the graph has them

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
        self.features = out[-1][0] if self.has_features else None  # ``features`` is the last output
        logits = out[0][0]
        # a draft with a cut LM head: its kept columns (the others are -inf by construction)
        return (logits if self.columns is None else logits[:, self.columns]), new


def _concat(past, new):
    return [(np.concatenate([pk, nk], axis=1), np.concatenate([pv, nv], axis=1))
            for (pk, pv), (nk, nv) in zip(past, new)]


# windows up to this long get a validation case whose committed past exceeds the window (the
# PyTorch reference then runs sequences of window + 7 tokens); longer windows are left to the tests
PAST_WINDOW_LIMIT = 512


def _shortest_window(spec: ArchSpec) -> int | None:
    windows = [w for w in [spec.sliding_window, *(spec.layer_windows or [])] if w]
    return min(windows) if windows else None


@dataclass
class Reference:
    """PyTorch's outputs for one validation run: logits of every position, K/V, tree rows."""

    prefix_len: int
    verify_len: int
    tag: str
    tokens: list[int]
    tree_tokens: list[int]
    logits: np.ndarray  # [prefix_len + verify_len, V]
    kv: list[tuple[np.ndarray, np.ndarray]]  # per layer [n, Hkv, D] (a sliding cache keeps the last n)
    tree_rows: np.ndarray  # [len(TREE_PARENTS), V]: each node's row from its root-to-node path
    seconds: float = 0.0  # PyTorch's time for this run
    # eagle.target_features of ``tokens`` [prefix_len + verify_len, F] (a target exported with a head)
    features: np.ndarray | None = None


def _tree_leaves(parents: list[int]) -> list[int]:
    has_child = {p for p in parents if p >= 0}
    return [i for i in range(len(parents)) if i not in has_child]


def _reference_run(torch_model, spec: ArchSpec, rng, prefix_len: int, verify_len: int, tag: str,
                   feature_layers: tuple[int, ...] | None = None) -> Reference:
    """One PyTorch call: the validation sequence and every root-to-leaf tree path, right-padded
    into one batch. Causal attention never looks right, so a sequence's rows are what a call on it
    alone computes, and a tree node's row is its depth's row in any leaf path through it."""
    import torch

    t0 = time.perf_counter()
    vocab = spec.vocab_size
    total = prefix_len + verify_len
    tokens = rng.integers(0, vocab, size=total).tolist()
    visible, depth = tree_mask_and_depths(TREE_PARENTS)
    tree_tokens = rng.integers(0, vocab, size=len(TREE_PARENTS)).tolist()
    leaves = _tree_leaves(TREE_PARENTS)
    seqs = [tokens] + [tokens[:prefix_len] + [tree_tokens[j] for j in np.flatnonzero(visible[leaf])]
                       for leaf in leaves]
    width = max(len(q) for q in seqs)
    # the validation sequence (row 0) must be unpadded: its K/V are compared position by position
    assert width == total, f"verify_len {verify_len} is shorter than the validation tree's deepest path"
    lengths = torch.tensor([len(q) for q in seqs])
    batch = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
    with torch.no_grad():
        out = torch_model(batch, attention_mask=(torch.arange(width)[None, :] < lengths[:, None]).long(),
                          use_cache=True)
        logits = out.logits[0, :total].float().numpy().copy()
        cache = out.cache if "cache" in out else out.past_key_values  # transformers >= 5.2x names it cache
        kv = []
        for i in range(spec.num_layers):
            rk, rv = _torch_kv(cache, i)  # [B, Hkv, T, D]: the validation sequence is row 0, unpadded
            kv.append((rk[0].transpose(0, 1).float().numpy().copy(), rv[0].transpose(0, 1).float().numpy().copy()))
        rows = []
        for node in range(len(TREE_PARENTS)):
            b = 1 + next(i for i, leaf in enumerate(leaves) if visible[leaf, node])
            rows.append(out.logits[b, prefix_len + depth[node]])
        tree_rows = torch.stack(rows).float().numpy()
    features = None
    if feature_layers:  # the features output's definition, on the validation sequence alone
        from specdec_rt.export.eagle import target_features

        features = target_features(torch_model, torch.tensor([tokens]), tuple(feature_layers))[0][0].numpy()
    return Reference(prefix_len, verify_len, tag, tokens, tree_tokens, logits, kv, tree_rows,
                     seconds=time.perf_counter() - t0, features=features)


def _validation_runs(spec: ArchSpec, prefix_len: int, verify_len: int) -> list[tuple[int, str]]:
    runs = [(prefix_len, "")]
    window = _shortest_window(spec)
    if (window and prefix_len <= window <= PAST_WINDOW_LIMIT
            and window + 3 + verify_len + len(TREE_PARENTS) <= spec.max_positions):
        runs.append((window + 3, "_past_window"))
    return runs


def reference_outputs(torch_model, spec: ArchSpec, *, seed: int = 0, prefix_len: int = 7,
                      verify_len: int = 4, feature_layers: tuple[int, ...] | None = None) -> list[Reference]:
    """Run PyTorch once for every validation case (then the model can be freed before any ONNX
    Runtime session exists: the two never need memory at the same time).

    A model stored in bf16 / fp16 computes in float32 here (``float32_compute``), as the graph does.
    ``feature_layers``: the graph has a ``features`` output (EAGLE-3 heads); its reference is
    eagle.target_features on each run's sequence (one more forward of 11 tokens).
    """
    rng = np.random.default_rng(seed)
    with float32_compute(torch_model):
        return [_reference_run(torch_model, spec, rng, p, verify_len, tag, feature_layers)
                for p, tag in _validation_runs(spec, prefix_len, verify_len)]


def restrict_vocab(refs: list[Reference], ids: np.ndarray) -> list[Reference]:
    """The references of a draft whose LM head keeps only ``ids``: its logit columns."""
    from dataclasses import replace

    return [replace(r, logits=np.ascontiguousarray(r.logits[:, ids]),
                    tree_rows=np.ascontiguousarray(r.tree_rows[:, ids])) for r in refs]


LARGE_WEIGHT = 16 << 20  # elements: a float32 copy of a larger weight is not made whole (64 MiB)


class float32_compute:
    """Context manager: a bf16 / fp16 torch model computes in float32, one module at a time.

    Each module's own parameters are upcast (exactly) just before its forward and the originals
    put back right after, so at most one module's float32 copy exists on top of the
    half-precision model (an fp32 copy of the whole model would double the export's peak memory).
    Vocabulary-sized weights are not upcast whole either: a large ``nn.Linear`` (the LM head)
    runs in blocks of at least 512 output rows (each output column is the same dot product; bit
    for bit with MKL's GEMM from 32-row blocks up, measured, not for gemv-sized blocks), a
    large ``nn.Embedding`` looks its ids up in an upcast copy of just the rows they select.
    Floating buffers are made float32 for good (small), with Gemma's embedding scale recomputed
    from its exact scalar (it was rounded to the load dtype). A no-op for a float32 model.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.handles: list = []
        self.patched: list = []
        self._saved: dict[int, list] = {}

    def __enter__(self):
        import torch

        if all(p.dtype == torch.float32 for p in self.model.parameters()):
            return self
        for module in self.model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                    setattr(module, name, buf.float())
            if hasattr(module, "scalar_embed_scale") and hasattr(module, "embed_scale"):
                module.embed_scale = torch.tensor(float(module.scalar_embed_scale), dtype=torch.float32)
            own = [p for p in module.parameters(recurse=False) if p.is_floating_point() and p.dtype != torch.float32]
            if not own:
                continue
            weight = getattr(module, "weight", None)
            large = weight is not None and weight.numel() >= LARGE_WEIGHT
            if large and isinstance(module, torch.nn.Linear):
                module.forward = self._blockwise_linear(module)
                self.patched.append(module)
            elif large and isinstance(module, torch.nn.Embedding):
                self.handles.append(module.register_forward_pre_hook(self._rows_up))
                self.handles.append(module.register_forward_hook(self._down))
            else:
                self.handles.append(module.register_forward_pre_hook(self._up))
                self.handles.append(module.register_forward_hook(self._down))
        return self

    @staticmethod
    def _blockwise_linear(module):
        import torch

        def forward(x):
            w, b = module.weight, module.bias
            step = max(1, (LARGE_WEIGHT // 4) // w.shape[1])
            return torch.cat([torch.nn.functional.linear(x, w[i:i + step].float(),
                                                         None if b is None else b[i:i + step].float())
                              for i in range(0, w.shape[0], step)], dim=-1)
        return forward

    def _up(self, module, args):
        import torch

        saved = []
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float32:
                saved.append((p, p.data))
                p.data = p.data.float()
        self._saved.setdefault(id(module), []).append((saved, None))

    def _rows_up(self, module, args):
        """Embedding lookup in float32 over only the rows its ids select (ids remapped)."""
        import torch

        if not args:  # ids passed by keyword: upcast the whole table
            return self._up(module, args)
        ids = args[0]
        rows, remapped = torch.unique(ids, return_inverse=True)
        p = module.weight
        saved = [(p, p.data)]
        p.data = p.data[rows].float()
        self._saved.setdefault(id(module), []).append((saved, module.padding_idx))
        module.padding_idx = None  # only shapes gradients; it may lie beyond the reduced table
        return (remapped,) + tuple(args[1:])

    def _down(self, module, args, output):
        saved, padding_idx = self._saved[id(module)].pop()
        for p, data in saved:
            p.data = data
        if isinstance(padding_idx, int):
            module.padding_idx = padding_idx

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for module in self.patched:
            del module.forward
        self.patched.clear()


def compare(onnx_path: str, spec: ArchSpec, refs: list[Reference], *, kv_dtype=np.float32,
            tolerance: float | None = None, enforce: bool = True, prepack: bool = True,
            columns: np.ndarray | None = None) -> "ValidationReport":
    """Run the graph on the cases of ``refs`` in ONNX Runtime and compare with PyTorch's outputs.

    ``prepack=False``: ONNX Runtime uses the weights where they lie instead of first copying every
    MatMul weight into its packed layout: for a float graph the session then needs about the
    graph's size instead of the graph plus a packed copy of tied / shared matrices, and opens in
    a fraction of a second instead of tens of seconds at 1.5B (the four validation calls run
    slower, ~0.5 s each at 0.5B; results agree with the packed kernels to ~1e-6). Quantized
    graphs keep prepacking: MatMulNBits' fast kernels need it.
    """
    t0 = time.perf_counter()
    runner = _OrtRunner(onnx_path, spec, np.dtype(kv_dtype), prepack=prepack)
    runner.columns = columns  # ``refs`` were cut to the same columns (restrict_vocab)
    t1 = time.perf_counter()
    results = [_compare_run(runner, spec, ref) for ref in refs]
    del runner
    scale = max(r["scale"] for r in results)
    tol = tolerance if tolerance is not None else 1e-3 * scale
    report = ValidationReport(tolerance=tol)
    report.seconds = {"reference": round(sum(r.seconds for r in refs), 3), "session": round(t1 - t0, 3),
                      "cases": round(time.perf_counter() - t1, 3)}
    for r in results:
        report.cases.update(r["cases"])
    kv_err = report.max_kv_error = max(r["kv"] for r in results)
    report.decode_vs_verify_error = max(r["decode_vs_verify"] for r in results)
    report.tree_error = max(r["tree"] for r in results)
    report.top1_agreement = float(np.mean([a for r in results for a in r["agree"]]))
    report.max_logit_error = max(report.cases.values())
    report.max_abs_logit = max(r["max_abs"] for r in results)
    if any(r["features"] for r in results):
        report.features = _feature_report(results, np.dtype(kv_dtype))
        f = report.features
        if enforce and f["max_error"] > f["tolerance"]:
            raise ValidationError(
                f"the exported graph's features output disagrees with PyTorch's hidden states: max error "
                f"{f['max_error']:.3g} (tolerance {f['tolerance']:.3g}); cases: "
                + ", ".join(f"{k}={v:.3g}" for k, v in f["cases"].items()))
    if enforce and (report.max_logit_error > tol or report.decode_vs_verify_error > tol or kv_err > tol):
        raise ValidationError(
            f"exported graph disagrees with PyTorch: max logit error {report.max_logit_error:.3g}, "
            f"K/V error {kv_err:.3g}, decode-vs-verify {report.decode_vs_verify_error:.3g} "
            f"(tolerance {tol:.3g}); cases: "
            + ", ".join(f"{k}={v:.3g}" for k, v in report.cases.items())
        )
    return report


def _feature_report(results: list[dict], kv_dtype: np.dtype) -> dict:
    """Errors of the ``features`` output; tolerance 1e-3 (fp32 graph) or 2e-2 (fp16) x max |feature|."""
    cases = {k: v for r in results for k, v in r["features"].items()}
    max_abs = max(r["features_abs"] for r in results)
    rel = 1e-3 if kv_dtype == np.float32 else 2e-2
    return {"cases": cases, "max_error": max(cases.values()), "max_abs": max_abs,
            "tolerance": rel * max(1.0, max_abs)}


def _compare_run(runner: _OrtRunner, spec: ArchSpec, ref: Reference) -> dict:
    """Prefill, chain verify, decode and tree on a ``prefix_len``-token past; errors vs PyTorch."""
    prefix_len, verify_len, tag, tokens = ref.prefix_len, ref.verify_len, ref.tag, ref.tokens
    total = prefix_len + verify_len
    ref_logits = ref.logits
    cases: dict[str, float] = {}

    features: dict[str, float] = {}
    # prefill, P = 0
    lg_a, kv_a = runner.run(tokens[:prefix_len], list(range(prefix_len)), runner.empty_past())
    cases[f"prefill_P0{tag}"] = float(np.abs(lg_a - ref_logits[:prefix_len]).max())
    if ref.features is not None:
        features[f"prefill_P0{tag}"] = float(np.abs(runner.features - ref.features[:prefix_len]).max())
    # chain verify, S = verify_len on P > 0
    past = kv_a
    lg_b, kv_b = runner.run(tokens[prefix_len:], list(range(prefix_len, total)), past)
    cases[f"verify_S{verify_len}{tag}"] = float(np.abs(lg_b - ref_logits[prefix_len:]).max())
    if ref.features is not None:
        features[f"verify_S{verify_len}{tag}"] = float(np.abs(runner.features - ref.features[prefix_len:]).max())
    # K/V of every position against PyTorch's cache
    kv_err = 0.0
    full = _concat(kv_a, kv_b)
    for i, (rk, rv) in enumerate(ref.kv):
        n = rk.shape[0]  # a sliding-window cache keeps only the last positions
        kv_err = max(kv_err, float(np.abs(full[i][0][0][-n:].astype(np.float32) - rk).max()),
                     float(np.abs(full[i][1][0][-n:].astype(np.float32) - rv).max()))
    # decode S = 1 must equal the matching row of the S > 1 call
    lg_c, _ = runner.run(tokens[prefix_len:prefix_len + 1], [prefix_len], past)
    decode_vs_verify = float(np.abs(lg_c[0] - lg_b[0]).max())
    cases[f"decode_S1{tag}"] = float(np.abs(lg_c[0] - ref_logits[prefix_len]).max())

    # tree verify against PyTorch runs of each root-to-node path
    visible, depth = tree_mask_and_depths(TREE_PARENTS)
    lg_t, _ = runner.run(ref.tree_tokens, (prefix_len + depth).tolist(), past, new_allowed=visible)
    tree_err = float(np.abs(lg_t - ref.tree_rows).max())
    agree = (np.argmax(lg_t, -1) == np.argmax(ref.tree_rows, -1)).astype(int).tolist()
    cases[f"tree{tag}"] = tree_err
    all_rows = np.concatenate([lg_a, lg_b])
    agree += (np.argmax(all_rows, -1) == np.argmax(ref_logits, -1)).astype(int).tolist()
    return {"cases": cases, "kv": kv_err, "decode_vs_verify": decode_vs_verify, "tree": tree_err,
            "features": features, "features_abs": 0.0 if ref.features is None else float(np.abs(ref.features).max()),
            "agree": agree, "scale": max(1.0, float(np.abs(ref_logits).max())),
            "max_abs": float(max(np.abs(ref_logits).max(), np.abs(ref.tree_rows).max()))}


def validate(torch_model, onnx_path: str, spec: ArchSpec, *, kv_dtype=np.float32,
             tolerance: float | None = None, enforce: bool = True, seed: int = 0,
             prefix_len: int = 7, verify_len: int = 4) -> ValidationReport:
    """Compare the ONNX graph with ``torch_model`` (computing in float32) on prefill, verify,
    decode and a tree: ``reference_outputs`` then ``compare``.

    With a sliding window of at most ``PAST_WINDOW_LIMIT`` tokens that the default past does not
    exceed, every case runs a second time on a past longer than the window (cases ``*_past_window``).
    """
    refs = reference_outputs(torch_model, spec, seed=seed, prefix_len=prefix_len, verify_len=verify_len)
    return compare(onnx_path, spec, refs, kv_dtype=kv_dtype, tolerance=tolerance, enforce=enforce)
