"""A float32 kernel for products of a few rows by a weight matrix (decoding on Linux x86_64).

MLX's Linux CPU backend does every float32 matmul with ``cblas_sgemm``. For the 1-8 rows of a
decoding step, OpenBLAS copies (packs) the whole weight matrix for each product and reads the demo
model's weights at 7-13 GB/s on the 2-core machine we measure on; a kernel that reads each weight row
once, straight from memory, reaches 14-16 GB/s on one thread and 20-29 GB/s on two. ``small_gemm.c``
(beside this file) is that kernel: it defines ``cblas_sgemm``, takes the products with at most 8 rows (A not transposed, B transposed: a Linear
layer), splits the rows of B between the calling thread and one helper thread, and hands every other
call to OpenBLAS unchanged. Its order of arithmetic is fixed (the C file states it), so each output
is the same bit for bit whatever the thread count and whatever rows (up to 8) share the product; it
differs from OpenBLAS's own rounding by float32 rounding only. It applies process-wide, to every
such product: decoding, and also the rank-8-or-less products of ``merge-lora`` and ``extract-lora``.

:func:`setup` builds the file with the system C compiler (:mod:`mlx_ssp.native`: ``$CC``, else ``cc``,
``gcc`` or ``clang``, cached in ``<cache>/native/``), initialises it and then loads it
with RTLD_GLOBAL; :mod:`mlx_ssp._blas` calls it between loading OpenBLAS locally and publishing it,
so that MLX finds our ``cblas_sgemm`` first (:func:`check_first` verifies that). No compiler,
another OS or CPU, or ``MLX_SSP_SMALL_GEMM=0`` leaves everything to OpenBLAS; :data:`status` says which.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from mlx_ssp import native

SOURCE = Path(__file__).with_name("small_gemm.c")
DISABLE_ENV = "MLX_SSP_SMALL_GEMM"
FLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off")  # no fusing beyond the stated FMAs
LIBS = ("-lpthread", "-lm", "-ldl")

lib: Optional[ctypes.CDLL] = None
status: str = "not attempted"


def setup(openblas: ctypes.CDLL, threads: int) -> bool:
    """Build (once) and load the kernel, point it at OpenBLAS's ``cblas_sgemm`` (for every product it
    does not take), then publish it with RTLD_GLOBAL. Call between loading OpenBLAS locally and
    making it global, before ``mlx.core`` is imported. Never raises: :data:`status` says what happened."""
    global lib, status
    if lib is not None:
        return active()
    if not native.linux_x86_64():
        status = "not Linux x86_64"
        return False
    if os.environ.get(DISABLE_ENV, "") == "0":
        status = f"disabled by {DISABLE_ENV}=0"
        return False
    cc = native.compiler()
    if cc is None:
        status = "no C compiler (cc, gcc or clang): products go to OpenBLAS"
        return False
    try:
        local = native.load("small_gemm", [SOURCE], cc, FLAGS, LIBS)
        real = ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p)
        local.mlx_ssp_small_gemm_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
        ok = bool(local.mlx_ssp_small_gemm_init(real, int(threads)))
        if not ok:
            status = "off: this CPU lacks AVX2 or FMA (products go to OpenBLAS)"
            return False
        # initialised before it is global: nothing can reach its cblas_sgemm without a BLAS behind it
        lib = ctypes.CDLL(local._name, mode=ctypes.RTLD_GLOBAL)
        lib.mlx_ssp_small_gemm_calls.restype = ctypes.c_long
    except Exception as e:  # noqa: BLE001 - importing mlx_ssp must not fail for an optional kernel
        status = f"not built: {e}"
        return False
    status = f"on, {threads} thread{'s' if threads > 1 else ''} ({lib._name})"
    return True


def check_first() -> bool:
    """After OpenBLAS is global: whether the process's ``cblas_sgemm`` is the kernel's (an
    LD_PRELOAD-ed BLAS, say, would come first). If not, the kernel is switched off and
    :data:`status` names what shadows it."""
    global status
    if lib is None:
        return False
    who = ctypes.create_string_buffer(4096)
    if lib.mlx_ssp_small_gemm_first(who, len(who)):
        return True
    lib.mlx_ssp_small_gemm_enable(0)
    status = f"off: MLX's cblas_sgemm comes from {who.value.decode(errors='replace')} (loaded before mlx_ssp)"
    return False


def active() -> bool:
    """Whether products of a few rows go to the kernel now."""
    return lib is not None and bool(lib.mlx_ssp_small_gemm_enabled())


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
    return 0 if lib is None else int(lib.mlx_ssp_small_gemm_calls())
