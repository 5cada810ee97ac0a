"""Reading a checkpoint's or a head's ``config.json``: one line naming the file when it is not a
JSON object, never a traceback from the JSON decoder."""
from __future__ import annotations

import json
from pathlib import Path

from specdec_rt.export.errors import ExportError


def read_json_config(path: Path, what: str = "config") -> dict:
    """The JSON object in ``path``; an ExportError naming the file when it is unreadable or not
    an object (``what`` says what the object should have been, e.g. "head config")."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path} is not a {what} (a JSON object)")
    return data
