"""Structure rules of the package (issue 20), checked statically:

1. no import circles between specdec_rt modules (every import counts: module level, inside
   functions, under TYPE_CHECKING);
2. no module reaches into another's private names: neither ``from m import _name`` nor
   ``obj._name`` on anything but ``self`` / ``cls`` (a module's own private helpers are fine),
   nor ``getattr`` / ``setattr`` / ``hasattr`` with a private name, nor another object's
   ``__dict__``; the few private names of third-party libraries that have no public
   equivalent are listed in ``THIRD_PARTY_PRIVATE`` with the reason;
3. runtime modules stay small (at most ``--max-lines`` lines, default 400);
4. imports run one way (issue 40): inside the runtime down ``RUNTIME_LAYERS`` (api -> loop ->
   drafters -> policies -> engines -> core; a module may import its own sub-package and those
   below it), and between the package's halves as ``MAY_IMPORT`` says (the runtime never imports
   the export side, which needs torch);
5. no folder of the package holds more than ``MAX_MODULES`` modules;
6. every ``specdec_rt`` import names a module that exists (the flat runtime paths kept for users,
   e.g. ``specdec_rt.runtime.generator``, are not for the package's own code).

Usage: python scripts/check_structure.py [--max-lines N] [--report]; exit status 1 on a violation
(tests/test_structure.py runs it). ``--report`` prints every finding without failing.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specdec_rt"
MAX_MODULES = 15
# the runtime's sub-packages, top to bottom: a module imports its own and those after it
RUNTIME_LAYERS = ("api", "loop", "drafters", "policies", "engines", "core")
# what each half of the package may import besides itself (the rest, cli / serving / bench /
# serve_ray, sit above both and may import anything without a circle)
MAY_IMPORT = {
    "specdec_rt.runtime": ("specdec_rt.errors",),
    "specdec_rt.export": ("specdec_rt.runtime", "specdec_rt.errors"),
    "specdec_rt.errors": (),
}

# private attributes of other libraries the package must use (no public API does the job)
THIRD_PARTY_PRIVATE = {
    "_pybind_state": "onnxruntime: the process-wide thread pool switch (sessions.py)",
    "_get_c_device": "onnxruntime: the C device of an OrtValue binding (window_binding.py)",
    "_sess": "onnxruntime: the C session under InferenceSession, for persistent IO bindings",
    "_iobinding": "onnxruntime: the C IO binding, rebound per window without copies",
    "_attn_implementation": "transformers: choosing eager attention for the export trace",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def import_targets(tree: ast.AST, name: str, known: dict[str, Path]) -> set[str]:
    """Every specdec_rt module path ``name``'s imports name (``from pkg import mod`` names mod;
    ``from mod import attr`` names mod), whether or not such a module exists."""
    out: set[str] = set()
    pkg = name if known[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(PACKAGE)}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith(PACKAGE):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return out


def imported(tree: ast.AST, name: str, known: dict[str, Path]) -> set[str]:
    """specdec_rt modules ``name`` imports (``from pkg import mod`` counts as importing mod)."""
    return {m for m in import_targets(tree, name, known) if m in known and m != name}


def layer_of(module: str) -> tuple[str, int] | None:
    """(sub-package, rank) of a runtime module inside a sub-package; None elsewhere."""
    parts = module.split(".")
    if parts[:2] == [PACKAGE, "runtime"] and len(parts) > 3 and parts[2] in RUNTIME_LAYERS:
        return parts[2], RUNTIME_LAYERS.index(parts[2])
    return None


def half_of(module: str) -> str | None:
    return next((h for h in MAY_IMPORT if module == h or module.startswith(h + ".")), None)


def against_layers(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run up the runtime's layers or out of a half of the package."""
    found = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            lm, ld = layer_of(m), layer_of(d)
            if lm and ld and ld[1] < lm[1]:
                found.append(f"{m} imports {d}: runtime.{lm[0]} may not import runtime.{ld[0]}")
            half = half_of(m)
            if half and half_of(d) != half and not any(d == a or d.startswith(a + ".") for a in MAY_IMPORT[half]):
                found.append(f"{m} imports {d}: {half} may import only {', '.join(MAY_IMPORT[half]) or 'itself'}")
    return found


def crowded_folders(known: dict[str, Path], limit: int = MAX_MODULES) -> list[str]:
    count: dict[Path, int] = {}
    for path in known.values():
        if path.name != "__init__.py":
            count[path.parent] = count.get(path.parent, 0) + 1
    return [f"{folder.relative_to(ROOT)}: {n} modules (> {limit})" for folder, n in sorted(count.items())
            if n > limit]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_reaches(tree: ast.AST, name: str) -> list[str]:
    """``from m import _x`` of another module, and ``obj._x`` where obj is not self/cls."""
    found = []
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{name}:{node.lineno}: from {node.module} import {a.name}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__")
              and node.args[1].value not in THIRD_PARTY_PRIVATE
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            found.append(f"{name}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Attribute) and node.attr == "__dict__":
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{name}:{node.lineno}: .__dict__ of {ast.unparse(node.value)}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr in THIRD_PARTY_PRIVATE:
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            if isinstance(value, ast.Name) and value.id in own:
                continue  # a class of this module reaching its own class attribute
            found.append(f"{name}:{node.lineno}: .{node.attr} on {ast.unparse(value)}")
    return found


def check(max_lines: int) -> dict[str, list[str]]:
    known = modules()
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in known.items()}
    graph = {m: imported(t, m, known) for m, t in trees.items()}
    # a package's __init__ re-exporting its modules is not a circle of theirs
    graph_no_init = {m: {d for d in deps if known[d].name != "__init__.py"} for m, deps in graph.items()}
    found: dict[str, list[str]] = {"circles": [" <-> ".join(c) for c in circles(graph_no_init)],
                                   "layers": against_layers(graph), "folders": crowded_folders(known),
                                   "unknown": [], "private": [], "size": []}
    for m, t in trees.items():
        found["unknown"] += [f"{m} imports {d}, which is no module" for d in sorted(import_targets(t, m, known))
                             if d not in known]
        found["private"] += private_reaches(t, m)
        if m.startswith(f"{PACKAGE}.runtime."):
            n = len(known[m].read_text().splitlines())
            if n > max_lines:
                found["size"].append(f"{m}: {n} lines (> {max_lines})")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-lines", type=int, default=400)
    ap.add_argument("--report", action="store_true", help="print every finding, exit 0")
    args = ap.parse_args(argv)
    found = check(args.max_lines)
    bad = 0
    for kind, items in found.items():
        for item in items:
            print(f"{kind}: {item}")
            bad += 1
    if not bad:
        print("structure: no import circles, imports down the layers, no private reaches, "
              f"folders within {MAX_MODULES} modules, runtime modules within size")
    return 0 if args.report or not bad else 1


if __name__ == "__main__":
    sys.exit(main())
