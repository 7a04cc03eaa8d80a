"""Load the system OpenBLAS before ``mlx.core`` on Linux.

The Linux ``mlx[cpu]`` wheel resolves its BLAS symbols dynamically; when a real OpenBLAS is
loaded with RTLD_GLOBAL first, float32 matmul runs about 40x faster than with the reference
BLAS the wheel falls back to. This must run before the first ``import mlx.core``, which is why
``mlx_ssp/__init__.py`` calls it first. Set ``MLX_SSP_NO_OPENBLAS=1`` to skip it.

:func:`threads` sets OpenBLAS's thread count for a block of code (the decoder uses one thread for
a few rows: see :mod:`mlx_ssp.rollout.decoder`); blocks may nest and end in any order, and a count
the user fixed with ``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS`` or ``OMP_NUM_THREADS`` is left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from mlx_ssp import _small_gemm

#: Where Debian/Ubuntu's ``libopenblas0-pthread`` (and friends) put the library.
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

DISABLE_ENV = "MLX_SSP_NO_OPENBLAS"

#: The path that was loaded, or None; the reason when nothing was loaded.
loaded_path: str | None = None
status: str = "not attempted"


def preload_openblas() -> str | None:
    """Load OpenBLAS globally if on Linux, present and not disabled. Returns the path or None."""
    global loaded_path, status
    if loaded_path is not None:
        return loaded_path
    if not sys.platform.startswith("linux"):
        status = "not Linux (Accelerate/Metal is used)"
        return None
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        status = f"disabled by {DISABLE_ENV}"
        return None
    if "mlx.core" in sys.modules:
        status = "mlx.core was imported before mlx_ssp; import mlx_ssp first"
        return None
    extra = os.environ.get("MLX_SSP_OPENBLAS")
    for path in ((extra,) if extra else ()) + CANDIDATES:
        if path and os.path.exists(path):
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            except OSError as e:  # a broken install: report, keep the slow path
                status = f"failed to load {path}: {e}"
                continue
            # the few-row kernel goes into the global scope first, so MLX's cblas_sgemm resolves to
            # it; loading OpenBLAS again with RTLD_GLOBAL then publishes the rest of its symbols
            _small_gemm.setup(lib, kernel_threads())
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _small_gemm.check_first()
            loaded_path = path
            status = f"loaded {path}"
            return path
    status = "not found (apt-get install -y libopenblas0-pthread)"
    return None


def kernel_threads() -> int:
    """Threads for the few-row kernel (:mod:`mlx_ssp._small_gemm`): two where this process may run on
    two cores or more, fewer where the user fixed OpenBLAS's count lower."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(2, cores)
    for key in USER_THREAD_ENVS:
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            n = min(n, int(value))
    return n


def _library():
    """The loaded OpenBLAS's thread functions, or None (nothing loaded, or a BLAS without them)."""
    if loaded_path is None:
        return None
    lib = ctypes.CDLL(loaded_path)
    if not (hasattr(lib, "openblas_get_num_threads") and hasattr(lib, "openblas_set_num_threads")):
        return None
    return lib


#: Environment variables through which a user fixes OpenBLAS's thread count (then we leave it alone).
USER_THREAD_ENVS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")

# The thread count is process-global: blocks may nest or end out of order (two decoders), so the
# first entry saves the count and the last exit restores it.
_lock = threading.Lock()
_depth = 0
_saved: Optional[int] = None


def user_fixed_threads() -> bool:
    return any(os.environ.get(k) for k in USER_THREAD_ENVS)


def enter_threads(n: int) -> Optional[int]:
    """Start a block with OpenBLAS on ``n`` threads; returns the count before the outermost block, or
    None where nothing changes (no OpenBLAS loaded by us, or a user setting in :data:`USER_THREAD_ENVS`).
    Pair every call that returned a count with one :func:`exit_threads`."""
    global _depth, _saved
    lib = None if user_fixed_threads() else _library()
    if lib is None:
        return None
    with _lock:
        if _depth == 0:
            _saved = int(lib.openblas_get_num_threads())
        _depth += 1
        lib.openblas_set_num_threads(int(n))
        return _saved


def exit_threads() -> None:
    """End one block started by :func:`enter_threads`; the last one restores the saved count."""
    global _depth, _saved
    lib = _library()
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0 and lib is not None and _saved is not None:
            lib.openblas_set_num_threads(_saved)
            _saved = None


@contextmanager
def threads(n: int) -> Iterator[Optional[int]]:
    """OpenBLAS computes with ``n`` threads inside the block (the count before the outermost block is
    restored when the last block ends, also on an error); yields that count, or None where nothing
    changes: no OpenBLAS loaded by us (macOS uses Accelerate), or a thread count set by the user
    (``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS`` or ``OMP_NUM_THREADS``). Results do not depend
    on it here: OpenBLAS splits a product's output among its threads (the demo model's decoding
    outputs are bit-identical with one and two threads at 4, 16 and 64 rows)."""
    before = enter_threads(n)
    try:
        yield before
    finally:
        if before is not None:
            exit_threads()
