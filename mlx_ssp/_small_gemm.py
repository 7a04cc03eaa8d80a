"""A float32 kernel for products of a few rows by a weight matrix (decoding on Linux x86_64).

MLX's Linux CPU backend does every float32 matmul with ``cblas_sgemm``. For the 1-8 rows of a
decoding step, OpenBLAS copies (packs) the whole weight matrix for each product and reads weights at
about 7 GB/s on the 2-core machine we measure on; a kernel that reads each weight row once, straight
from memory, reaches 14-24 GB/s. ``small_gemm.c`` (beside this file) is that kernel: it defines
``cblas_sgemm``, takes the products with at most 8 rows (A not transposed, B transposed: a Linear
layer), splits the rows of B between the calling thread and one helper thread, and hands every other
call to OpenBLAS unchanged. Its order of arithmetic is fixed (the C file states it), so each output
is the same bit for bit whatever the thread count and whatever rows share the product; it differs
from OpenBLAS's own rounding by float32 rounding only.

:func:`prepare` builds the file with the system C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``) into ``<cache>/native/`` once per source and compiler, and loads it with RTLD_GLOBAL;
:mod:`mlx_ssp._blas` calls it between checking and publishing OpenBLAS, so that MLX finds our
``cblas_sgemm`` first. No compiler, another OS or CPU, or ``MLX_SSP_SMALL_GEMM=0`` leaves
everything to OpenBLAS; :data:`status` says which.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from mlx_ssp.io import cache_dir

SOURCE = Path(__file__).with_name("small_gemm.c")
DISABLE_ENV = "MLX_SSP_SMALL_GEMM"
FLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off")  # no fusing beyond the stated FMAs
LIBS = ("-lpthread", "-lm")
#: rows of A the kernel takes (the C file's MAX_ROWS)
MAX_ROWS = 8

lib: Optional[ctypes.CDLL] = None
status: str = "not attempted"


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def _library_path(cc: str) -> Path:
    """One file per source text and compiler binary (its path, size and mtime: cheaper than running it)."""
    st = os.stat(cc)
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{cc}|{st.st_size}|{st.st_mtime_ns}|{' '.join(FLAGS + LIBS)}".encode())
    return cache_dir() / "native" / f"small_gemm-{key.hexdigest()[:16]}.so"


def _build(cc: str, out: Path) -> None:
    """Compile into a temporary file beside ``out``, then rename: a concurrent build or a killed one
    never leaves a half-written library under the final name."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".small_gemm-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), *LIBS], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in out.parent.glob("small_gemm-*.so"):  # builds of earlier sources (a process using one keeps its mapping)
        if old != out:
            old.unlink(missing_ok=True)


def prepare() -> Optional[ctypes.CDLL]:
    """Build (once) and load the kernel with RTLD_GLOBAL; None, with :data:`status` saying why, where
    it does not apply. Must run before ``mlx.core`` is imported and before OpenBLAS is made global."""
    global lib, status
    if lib is not None:
        return lib
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        status = "not Linux x86_64"
        return None
    if os.environ.get(DISABLE_ENV, "") == "0":
        status = f"disabled by {DISABLE_ENV}=0"
        return None
    cc = _compiler()
    if cc is None:
        status = "no C compiler (cc, gcc or clang): products go to OpenBLAS"
        return None
    try:
        path = _library_path(cc)
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        status = f"not built: {e} {err.decode(errors='replace')[-300:]}".strip()
        return None
    status = f"built, waiting for OpenBLAS ({path})"
    return lib


def connect(openblas: ctypes.CDLL, threads: int) -> bool:
    """Point the kernel at OpenBLAS's ``cblas_sgemm`` (for every product it does not take); returns
    whether the kernel runs on this CPU (AVX2 and FMA)."""
    global status
    if lib is None:
        return False
    real = ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p)
    lib.mlx_ssp_small_gemm_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
    ok = bool(lib.mlx_ssp_small_gemm_init(real, int(threads)))
    status = (f"on, {threads} thread{'s' if threads > 1 else ''} ({lib._name})" if ok
              else "off: this CPU lacks AVX2 or FMA (products go to OpenBLAS)")
    return ok


def active() -> bool:
    """Whether products of a few rows go to the kernel now."""
    if lib is None:
        return False
    before = lib.mlx_ssp_small_gemm_enable(1)
    lib.mlx_ssp_small_gemm_enable(before)
    return bool(before)


@contextmanager
def enabled(on: bool) -> Iterator[bool]:
    """The kernel on or off inside the block (process-wide); yields the state before."""
    if lib is None:
        yield False
        return
    before = lib.mlx_ssp_small_gemm_enable(int(on))
    try:
        yield bool(before)
    finally:
        lib.mlx_ssp_small_gemm_enable(before)


@contextmanager
def threads(n: int) -> Iterator[int]:
    """The kernel's thread count (1 or 2) inside the block; yields the count before."""
    if lib is None:
        yield 1
        return
    before = lib.mlx_ssp_small_gemm_threads(int(n))
    try:
        yield before
    finally:
        lib.mlx_ssp_small_gemm_threads(before)


def calls() -> int:
    """Products the kernel has done in this process."""
    if lib is None:
        return 0
    lib.mlx_ssp_small_gemm_calls.restype = ctypes.c_long
    return int(lib.mlx_ssp_small_gemm_calls())
