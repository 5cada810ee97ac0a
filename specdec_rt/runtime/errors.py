"""The user-facing error types (old import path; they live in :mod:`specdec_rt.errors`).

Kept so ``from specdec_rt.runtime.errors import USER_ERRORS`` keeps working. Nothing here imports
``specdec_rt.export``: the export errors are defined below both halves of the package.
"""
from __future__ import annotations

from specdec_rt.errors import (USER_ERRORS, BackendUnavailableError, BundleError,  # noqa: F401
                               ChatTemplateError, ContextOverflowError, ExportError,
                               GenerationInputError, SamplingParamsError,
                               UnsupportedArchitectureError, ValidationError)
