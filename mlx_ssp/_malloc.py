"""Keep freed heap memory in the process on Linux (glibc), so that large buffers are reused.

Each decoding step on the CPU allocates and frees several batch x vocabulary float32 buffers
(25 MB each at batch 128 with a 49k vocabulary). glibc serves blocks that large with ``mmap`` and
returns them with ``munmap`` on free, so every step touches fresh pages: measured on the demo model,
10 steps at batch 128 took 210,000-550,000 minor page faults and 2-3 s of system time, against
under 100 faults and 0.2-1.5 s with the settings below (``mallopt``: no ``mmap`` for ordinary
blocks, a heap top that is never trimmed). The cost is that the process keeps its peak heap
instead of handing it back. The settings govern the allocations made after the call (blocks
mapped before it are still unmapped when freed), so it could be called later too; ``mlx_ssp/__init__.py``
calls it at import so that every command, and the training steps' per-step buffers, get it. Set
``MLX_SSP_NO_MALLOC_TUNING=1`` to skip it.
"""

from __future__ import annotations

import ctypes
import os
import sys

DISABLE_ENV = "MLX_SSP_NO_MALLOC_TUNING"
#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4

#: What was done: "tuned", or why not.
status: str = "not attempted"


def keep_freed_memory() -> bool:
    """Apply the settings if on Linux with glibc and not disabled; True when applied."""
    global status
    if not sys.platform.startswith("linux"):
        status = "not Linux"
        return False
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        status = f"disabled by {DISABLE_ENV}"
        return False
    try:
        # the process's own symbols include libc's; find_library would run `ldconfig -p` at every import
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        status = "no glibc mallopt"
        return False
    # large blocks from the heap (a worker thread's block beyond its 64 MB arena still gets mmap)
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    status = "tuned" if ok else "mallopt refused"
    return ok
