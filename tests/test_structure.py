"""The package's structure rules (issue 20): no import circles, no reaches into another module's
private names, runtime modules within 400 lines; scripts/check_structure.py says what and where."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_package_structure_rules_hold():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_structure.py")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_checker_finds_a_circle_and_a_private_reach(tmp_path, monkeypatch):
    """The checker is not vacuous: a planted circle, a private import, a private attribute and
    a getattr of a private name are all reported."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_structure as cs
    finally:
        sys.path.pop(0)
    pkg = tmp_path / "specdec_rt" / "runtime"
    pkg.mkdir(parents=True)
    (tmp_path / "specdec_rt" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from specdec_rt.runtime.b import _hidden\n")
    (pkg / "b.py").write_text("import specdec_rt.runtime.a\n_hidden = 1\n"
                              "def f(gen):\n    gen._loop()\n    return getattr(gen, '_state')\n")
    (pkg / "big.py").write_text("x = 1\n" * 12)
    monkeypatch.setattr(cs, "ROOT", tmp_path)
    found = cs.check(max_lines=10)
    assert found["circles"] == ["specdec_rt.runtime.a <-> specdec_rt.runtime.b"]
    joined = "\n".join(found["private"])
    assert "import _hidden" in joined and "._loop on gen" in joined and "'_state'" in joined
    assert found["size"] == ["specdec_rt.runtime.big: 12 lines (> 10)"]


def test_checker_finds_imports_against_the_layers_crowded_folders_and_unknown_paths(tmp_path, monkeypatch):
    """Issue 40's rules are not vacuous: an engine importing the loop, the runtime importing the
    export side, a flat-layout path used inside the package and a 16-module folder are reported."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import check_structure as cs
    finally:
        sys.path.pop(0)
    pkg = tmp_path / "specdec_rt"
    for folder in ("", "runtime", "runtime/engines", "runtime/loop", "runtime/core", "export", "many"):
        (pkg / folder).mkdir(parents=True, exist_ok=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "runtime/engines/ort.py").write_text("from specdec_rt.runtime.loop.step import run\n")
    (pkg / "runtime/loop/step.py").write_text("from specdec_rt.runtime.core import masks\ndef run():\n    pass\n")
    (pkg / "runtime/core/masks.py").write_text("import specdec_rt.export.graph\n")
    (pkg / "export/graph.py").write_text("from specdec_rt.runtime.generator import load\n")
    for i in range(16):
        (pkg / "many" / f"m{i}.py").write_text("")
    monkeypatch.setattr(cs, "ROOT", tmp_path)
    found = cs.check(max_lines=400)
    assert found["layers"] == [
        "specdec_rt.runtime.core.masks imports specdec_rt.export.graph: specdec_rt.runtime may import "
        "only specdec_rt.errors",
        "specdec_rt.runtime.engines.ort imports specdec_rt.runtime.loop.step: runtime.engines may not "
        "import runtime.loop"]
    assert found["folders"] == ["specdec_rt/many: 16 modules (> 15)"]
    assert found["unknown"] == ["specdec_rt.export.graph imports specdec_rt.runtime.generator, which is no module"]
    assert not found["circles"]


FLAT_PATHS_CHECK = """
import importlib, warnings
import specdec_rt.runtime as runtime
for old in runtime.MOVED:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"specdec_rt.runtime.{old}")
    assert module is importlib.import_module(runtime.moved_to(old)), old
    assert [w.category for w in caught] == [DeprecationWarning], (old, caught)
    assert runtime.moved_to(old) in str(caught[0].message)
from specdec_rt.runtime.drafters import ModelDrafter  # the old drafters module is the package now
from specdec_rt.runtime.drafters.base import ModelDrafter as moved
from specdec_rt.runtime.policies.tree_shapes import Template as template
from specdec_rt.runtime.tree import Template  # a name from a moved module, the old way
assert ModelDrafter is moved and Template is template
from specdec_rt.runtime import RowRequest, SpeculationConfig
from specdec_rt.runtime.loop import requests
assert RowRequest is requests.RowRequest and SpeculationConfig is requests.SpeculationConfig
assert all(getattr(runtime, name) is not None for name in runtime.__all__)
print("ok", len(runtime.MOVED))
"""


def test_flat_runtime_paths_and_public_names_still_import():
    """Users' imports from before the split keep working: an old module path is the moved module
    itself (one object, so patches and isinstance agree) with a DeprecationWarning naming the new
    path; the public names import from specdec_rt.runtime (a fresh interpreter: one warning each)."""
    run = subprocess.run([sys.executable, "-c", FLAT_PATHS_CHECK], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
