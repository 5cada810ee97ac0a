"""Peak resident memory of the process, per generation where the OS allows it.

Linux keeps a resettable high-water mark (``VmHWM`` in /proc/self/status, reset by writing "5"
to /proc/self/clear_refs), so a generation can report its own peak rather than the process's
lifetime peak. Elsewhere the lifetime peak (``ru_maxrss``) is the honest fallback.
"""
from __future__ import annotations

import resource
import sys


def reset_peak_rss() -> bool:
    """Start a new high-water mark; False where the OS cannot (the lifetime peak is reported)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (Linux) or since the process started."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
