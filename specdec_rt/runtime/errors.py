"""The user-facing error types, gathered so command-line tools report them as one line."""
from __future__ import annotations

from specdec_rt.runtime.bundle import BundleError
from specdec_rt.runtime.engine import ContextOverflowError
from specdec_rt.runtime.generator import GenerationInputError
from specdec_rt.runtime.providers import BackendUnavailableError
from specdec_rt.runtime.sampling import SamplingParamsError


def _export_errors() -> tuple[type[BaseException], ...]:
    try:  # the export extra may be absent on a deployment machine
        from specdec_rt.export.arch import UnsupportedArchitectureError
        from specdec_rt.export.pipeline import ExportError
        from specdec_rt.export.validate import ValidationError
    except ImportError:
        return ()
    return (ExportError, UnsupportedArchitectureError, ValidationError)


USER_ERRORS: tuple[type[BaseException], ...] = (
    BundleError, ContextOverflowError, GenerationInputError, BackendUnavailableError,
    SamplingParamsError, FileNotFoundError,
) + _export_errors()
