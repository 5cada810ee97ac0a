"""The shipped reference pair: export, exactness against transformers, the demo command."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec_rt.cli.demo import reference_dir

REPO = Path(__file__).resolve().parents[1]
REF = reference_dir()  # package data: specdec_rt/data/reference
SHIPPED = ["README.md", "eval_prompts.jsonl"] + [
    f"{role}/{name}" for role in ("target", "draft")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
] + ["eagle/config.json", "eagle/model.safetensors"]  # the target's EAGLE-3 head (issue 22)


@pytest.fixture(scope="module")
def ref_bundle(tmp_path_factory):
    from specdec_rt.export.pipeline import ExportOptions, export_pair

    out = tmp_path_factory.mktemp("ref") / "bundle"
    t0 = time.perf_counter()
    manifest = export_pair(REF / "target", REF / "draft", out, ExportOptions(progress=False))
    manifest["_seconds"] = time.perf_counter() - t0
    return out, manifest


@pytest.fixture(scope="module")
def ref_gen(ref_bundle):
    import specdec_rt

    return specdec_rt.load(ref_bundle[0])


@pytest.fixture(scope="module")
def prompts():
    lines = (REF / "eval_prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def test_reference_files_are_shipped():
    for rel in SHIPPED:
        assert (REF / rel).is_file(), f"specdec_rt/data/reference/{rel} is missing"
    total = sum(f.stat().st_size for f in REF.rglob("*.safetensors"))
    assert total <= 40 * 1024 * 1024


def test_reference_lookup_goes_through_importlib_resources():
    from importlib.resources import files

    import specdec_rt

    assert REF.resolve() == (files("specdec_rt") / "data" / "reference").resolve()
    assert REF.resolve() == Path(specdec_rt.__file__).resolve().parent / "data" / "reference"


def test_reference_lookup_works_from_another_directory(tmp_path):
    code = "from specdec_rt.cli.demo import reference_dir, reference_prompts; print(reference_dir()); " \
           "print(len(reference_prompts()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(REF), "10"]


def test_wheel_contains_the_reference_pair(tmp_path):
    """A non-editable build carries the pair as package data (and not the training logs)."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(REPO / "specdec_rt", src / "specdec_rt", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("specdec_rt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in SHIPPED:
        assert f"specdec_rt/data/reference/{rel}" in names, rel
    assert not [n for n in names if "training_log" in n]
    assert wheel.stat().st_size < 40 * 1024 * 1024


def test_export_validates(ref_bundle):
    _, manifest = ref_bundle
    for role in ("target", "draft"):
        assert manifest["models"][role]["validation"]["max_logit_error"] < 1e-2


def test_greedy_speculative_matches_transformers(ref_gen, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(REF / "target"), dtype=torch.float32).eval()
    for prompt in prompts[:3]:
        ids = ref_gen.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=48, min_new_tokens=48,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert ref_gen.generate_ids(ids, max_new_tokens=48, drafter=None, ignore_eos=True) == ref
        for k in (1, 2, 4, 8):
            assert ref_gen.generate_ids(ids, max_new_tokens=48, num_draft_tokens=k, ignore_eos=True) == ref
        assert ref_gen.generate_ids(ids, max_new_tokens=48, speculation="tree", ignore_eos=True) == ref
        assert ref_gen.generate_ids(ids, max_new_tokens=48, speculation="tree", num_draft_tokens="auto",
                                    ignore_eos=True) == ref
        assert ref_gen.generate_ids(ids, max_new_tokens=48, num_draft_tokens="auto", ignore_eos=True) == ref
        assert ref_gen.generate_ids(ids, max_new_tokens=48, drafter="prompt_lookup", ignore_eos=True) == ref


def test_distilled_draft_agrees_with_target(ref_gen, prompts):
    accepted = proposed = 0
    for prompt in prompts[:4]:
        stats = ref_gen.generate(prompt, max_new_tokens=64, num_draft_tokens=4, ignore_eos=True).stats
        accepted += stats.accepted
        proposed += stats.proposed
    assert accepted / proposed > 0.3


def test_stream_text_equals_generate_text(ref_gen, prompts):
    full = ref_gen.generate(prompts[1], max_new_tokens=40, ignore_eos=True)
    pieces = list(ref_gen.stream(prompts[1], max_new_tokens=40, ignore_eos=True))
    assert len(pieces) > 1
    assert "".join(pieces) == full.text


def test_cli_run_json(ref_bundle, prompts):
    proc = subprocess.run([sys.executable, "-m", "specdec_rt.cli.run_cli", "--bundle", str(ref_bundle[0]),
                           "--prompt", prompts[0], "--max-new-tokens", "16", "--json", "--ignore-eos"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 16 and out["text"] and "acceptance_rate" in out["stats"]


def test_cli_reports_bad_input_in_one_line(ref_bundle):
    proc = subprocess.run([sys.executable, "-m", "specdec_rt.cli.run_cli", "--bundle", str(ref_bundle[0]),
                           "--prompt", "x", "--temperature", "-1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "temperature" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_demo_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specdec_rt.cli.run_cli", "--demo", "--demo-dir",
                           str(tmp_path / "demo"), "--max-new-tokens", "32"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical to target-only greedy: yes" in proc.stdout
    assert "speedup:" in proc.stdout and "acceptance rate" in proc.stdout
