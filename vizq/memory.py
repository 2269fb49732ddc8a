"""Keep long streaming runs from growing the process through heap fragmentation.

glibc raises its mmap threshold dynamically after large frees, so the per-batch temporaries
of a capture end up on the brk heap, which fragments and never shrinks: resident memory
then creeps up by hundreds of MB over a few hundred images although nothing is retained.
Pinning the threshold makes large buffers mmap'd and returned to the OS on free.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3
_done = False


def pin_mmap_threshold(threshold: int = 1 << 17) -> bool:
    """Call once; a no-op (False) where glibc's mallopt is not available."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    return _done
