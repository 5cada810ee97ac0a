"""Every user-facing error type of specdec-rt, below both halves of the package.

This module imports nothing from ``specdec_rt.runtime`` or ``specdec_rt.export`` (nor anything
outside the standard library), so the runtime can name export errors and the command-line tools
can catch every expected error without the runtime ever importing the export package (which
needs torch). The modules that raise them (``specdec_rt.runtime.core.bundle.BundleError``, under
its flat path ``specdec_rt.runtime.bundle.BundleError`` too, ``specdec_rt.export.pipeline.ExportError``,
...) re-export these same classes.
"""
from __future__ import annotations


class BundleError(ValueError):
    """The bundle is missing, corrupt, tampered with or inconsistent."""


class ContextOverflowError(ValueError):
    """The sequence would not fit in the model's context."""


class GenerationInputError(ValueError):
    """The prompt or a generation argument is invalid."""


class ChatTemplateError(GenerationInputError):
    """Chat messages are malformed, the bundle has no chat template, or the template refused them."""


class SamplingParamsError(ValueError):
    """temperature / top_k / top_p out of range."""


class BackendUnavailableError(RuntimeError):
    """The requested execution provider (or its libraries) is not available here."""


class ExportError(ValueError):
    """A checkpoint cannot be exported; the message says why."""


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's ``model_type`` has no extractor, or it uses a switch the exporter lacks."""


class GGUFError(ExportError):
    """A GGUF input cannot be read or converted: truncated, corrupt, split, or a package is missing."""


class UnsupportedGGUFError(GGUFError, UnsupportedArchitectureError):
    """The GGUF's ``general.architecture`` is one transformers cannot load or the exporter cannot
    export: both an export error and an unsupported architecture, so either ``except`` catches it."""


class ServerConfigError(ValueError):
    """A server option cannot be used: an empty or unreadable API key file, a malformed key, TLS
    files that do not load (reported before the model loads)."""


class ValidationError(RuntimeError):
    """The exported graph disagrees with PyTorch beyond tolerance."""


# What the command-line tools and the server report as one line (exit status 1 / HTTP 400)
# instead of a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    BundleError, ContextOverflowError, GenerationInputError, SamplingParamsError,
    BackendUnavailableError, ExportError, UnsupportedArchitectureError, ValidationError,
    ServerConfigError, FileNotFoundError,
)

__all__ = ["BundleError", "ContextOverflowError", "GenerationInputError", "ChatTemplateError",
           "SamplingParamsError", "BackendUnavailableError", "ExportError",
           "UnsupportedArchitectureError", "GGUFError", "UnsupportedGGUFError", "ValidationError",
           "ServerConfigError", "USER_ERRORS"]
