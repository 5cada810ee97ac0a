"""What the benchmark suites and the peer adapters share, at the bottom of ``specdec_rt.bench``.

Imports go one way: the suites (:mod:`.runner`, :mod:`.spec_bench`, :mod:`.batch`) import the peer
adapters (:mod:`.peer_runs`, :mod:`.llama_cpp_peer`, :mod:`.llama_cpp`, :mod:`.peers`), and all of
them import this module, which imports none of them.
"""
from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from specdec_rt.errors import GenerationInputError

T = TypeVar("T")

# our target-only runs: the exactness reference, and the other baselines speedups may be over (the
# fastest of them): the one-row kernel where exactness pads one-row calls (int4 on x86), and the
# overlapped generator's target alone (its pool does not spin)
OURS_BASE = "target-only"
UNPADDED = "target-only (1-row kernel)"
NO_SPIN = "target-only (non-spinning pool)"


class PeerUnavailable(RuntimeError):
    """A peer system cannot run here; the message says why."""


def machine_description() -> dict:
    import onnxruntime as ort

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": ort.__version__, "platform": platform.platform()}


# -- Spec-Bench's systems (``specdec-bench --suite spec-bench``): ours and the peers' ---------------
@dataclass
class Question:
    question_id: int
    category: str
    text: str


@dataclass
class Outcome:
    """One system's run of one prompt."""
    tokens: list[int]
    seconds: float
    ttft: float | None = None
    target_calls: int | None = None
    proposed: int | None = None
    accepted: int | None = None
    drafter: str | None = None  # ours: the drafter that ran (what "auto" resolved to; None: target-only)


class System:
    """Something that decodes a prompt greedily: one of our configurations or a peer's."""
    name: str
    family: str  # "ours", "onnxruntime-genai", "llama.cpp": whose target-only is its reference
    is_base: bool = False  # this family's target-only decoding

    def run(self, question: Question, ids: list[int], text: str, n: int) -> Outcome:
        raise NotImplementedError


def load_workload(path: Path, build: Callable[[dict], T], kind: str, fields: str) -> list[T]:
    """The records of a workload JSONL, one ``build(record)`` per non-blank line; a missing file,
    a line that is not JSON or lacks a field (``build`` raising KeyError, TypeError or ValueError),
    a record ``build`` refuses (GenerationInputError) and an empty file are errors naming the file
    and line (``kind``: what a record is; ``fields``: what it needs)."""
    if not path.is_file():
        raise GenerationInputError(f"{kind} workload not found: {path} (JSONL of {fields})")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(build(json.loads(line)))
        except GenerationInputError as exc:  # ``build``'s own verdict on a well-formed record
            raise GenerationInputError(f"{path}:{n}: {exc}") from None
        except (ValueError, KeyError, TypeError):
            raise GenerationInputError(f"{path}:{n}: not an {kind} session (needs {fields})") from None
    if not out:
        raise GenerationInputError(f"{path}: no sessions")
    return out
