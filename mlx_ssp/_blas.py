"""Load the system OpenBLAS before ``mlx.core`` on Linux.

The Linux ``mlx[cpu]`` wheel resolves its BLAS symbols dynamically; when a real OpenBLAS is
loaded with RTLD_GLOBAL first, float32 matmul runs about 40x faster than with the reference
BLAS the wheel falls back to. This must run before the first ``import mlx.core``, which is why
``mlx_ssp/__init__.py`` calls it first. Set ``MLX_SSP_NO_OPENBLAS=1`` to skip it.
"""

from __future__ import annotations

import ctypes
import os
import sys

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
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:  # a broken install: report, keep the slow path
                status = f"failed to load {path}: {e}"
                continue
            loaded_path = path
            status = f"loaded {path}"
            return path
    status = "not found (apt-get install -y libopenblas0-pthread)"
    return None
