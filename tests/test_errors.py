"""The user-facing error classes live below both halves of the package; old paths still work."""
from __future__ import annotations

import pytest

import specdec_rt.errors as E
from helpers import assert_runs_without


def test_errors_module_imports_neither_half():
    assert_runs_without("import specdec_rt.errors\n", timeout=60, prefixes=(
        "specdec_rt.runtime", "specdec_rt.export", "numpy", "onnxruntime", "tokenizers", "torch"))


@pytest.mark.parametrize("module, name", [
    ("specdec_rt.runtime.core.bundle", "BundleError"),
    ("specdec_rt.runtime.engines.ort", "ContextOverflowError"),
    ("specdec_rt.runtime.api.generator", "GenerationInputError"),
    ("specdec_rt.runtime.engines.providers", "BackendUnavailableError"),
    ("specdec_rt.runtime.core.sampling", "SamplingParamsError"),
    ("specdec_rt.runtime.errors", "BundleError"),
    ("specdec_rt.runtime.errors", "USER_ERRORS"),
    ("specdec_rt.export.pipeline", "ExportError"),
    ("specdec_rt.export.arch", "UnsupportedArchitectureError"),
    ("specdec_rt.export.validate", "ValidationError"),
])
def test_old_import_paths_name_the_same_objects(module, name):
    import importlib

    assert getattr(importlib.import_module(module), name) is getattr(E, name)


def test_every_user_error_is_reported_by_the_tools():
    for cls in (E.BundleError, E.ContextOverflowError, E.GenerationInputError, E.ChatTemplateError,
                E.SamplingParamsError, E.BackendUnavailableError, E.ExportError,
                E.UnsupportedArchitectureError, E.ValidationError):
        assert issubclass(cls, E.USER_ERRORS), cls
    # the base classes callers may already catch are kept
    assert issubclass(E.BundleError, ValueError) and issubclass(E.ValidationError, RuntimeError)
    assert issubclass(E.BackendUnavailableError, RuntimeError)
