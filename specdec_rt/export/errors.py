"""The exporter's user-facing error, defined with every other one in :mod:`specdec_rt.errors`."""
from __future__ import annotations

from specdec_rt.errors import ExportError  # noqa: F401 - one class, re-exported here

__all__ = ["ExportError"]
