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
