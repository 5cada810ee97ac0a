"""The exporter's user-facing error (one line, naming the file or field at fault)."""
from __future__ import annotations


class ExportError(ValueError):
    """A checkpoint cannot be exported, or the bundle cannot be written; the message says why."""
