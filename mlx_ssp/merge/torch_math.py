"""float32 ``acos``, ``sin``, ``cos`` and ``dot`` with the last bits of torch's CPU kernels, for the
float32 merges that reproduce mergekit (slerp, nuslerp, karcher, multislerp).

torch's x86_64 builds (the PyPI wheels link Intel oneMKL) compute float32 ``acos``, ``sin`` and
``cos`` of a tensor of any size, 0-d included, with oneMKL's vector math (``vmsAcos``, ``vmsSin``,
``vmsCos`` in high-accuracy mode; not SLEEF, whose results differ in 2-8% of inputs). Those are
within 0.8 ulp but not correctly rounded: they differ from the correctly rounded value in 5-9% of
inputs (from NumPy's float32 functions in 13-36%), and an ulp of slerp's angle moves its
coefficients, so the whole tensor. oneMKL's algorithms are not published, so the one way to those
bits is oneMKL itself: when Intel's runtime is installed (the ``mkl`` PyPI package, Linux x86_64;
the ``torch-parity`` extra) :func:`acos`, :func:`sin` and :func:`cos` call it through ctypes
(checked bit for bit against torch 2.14.1 on 4M inputs each; oneMKL 2026.2 and torch's bundled
2024.2 agree). Otherwise they round NumPy's float64 values to float32: correctly rounded, within
one ulp of torch's. :func:`backend` says which is in use; ``MLX_SSP_TORCH_MATH=numpy`` in the
environment chooses NumPy's whatever is installed (the same bits on every machine).

oneMKL is loaded only from the environment's own ``lib`` (``sys.prefix/lib``), with the LP64
interface and sequential threading whatever ``MKL_INTERFACE_LAYER`` / ``MKL_THREADING_LAYER`` say.
It picks a code path per CPU (:func:`mkl_branch`); torch's values were recorded on an AMD EPYC,
where both torch's bundled oneMKL and the installed one take the generic path, so bit-identity with
torch is checked (and claimed) on that path only: another CPU's path (Intel AVX2, AVX-512) may
give other last bits, and the tests skip there naming both paths.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np

#: torch's mode for oneMKL's vector math: high accuracy (VML_HA), denormals kept (VML_FTZDAZ_OFF),
#: no error handling (VML_ERRMODE_IGNORE)
_VML_MODE = 0x2 | 0x140000 | 0x100
#: oneMKL's single dynamic library (``mkl_rt``), newest first
_MKL_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2")
#: MKL_INT of the LP64 interface: one call takes at most this many elements
_MAX_N = 2 ** 31 - 1


def _candidates() -> list[Path]:
    """Where the ``mkl`` package puts the library: the environment's own ``lib`` only (another
    oneMKL on the loader's path may be another version, with other bits)."""
    return [p for p in (Path(sys.prefix) / "lib" / n for n in _MKL_NAMES) if p.is_file()]


#: environment variable: ``numpy`` makes :func:`backend` NumPy's even where oneMKL is installed
ENV = "MLX_SSP_TORCH_MATH"


def _mkl() -> Optional[ctypes.CDLL]:
    """oneMKL's runtime, or None (not installed, or NumPy chosen by :data:`ENV`)."""
    return None if os.environ.get(ENV, "").lower() == "numpy" else _load_mkl()


@functools.cache
def _load_mkl() -> Optional[ctypes.CDLL]:
    """oneMKL's runtime, loaded on first use (an optional library of ~650 MB), or None."""
    if sys.platform != "linux":
        return None
    for path in _candidates():
        try:
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        except OSError:
            continue
        # LP64 (32-bit lengths, as passed here) whatever MKL_INTERFACE_LAYER says; sequential: no
        # OpenMP runtime is loaded (elementwise results do not depend on threads)
        lib.MKL_Set_Interface_Layer(ctypes.c_int(0))
        lib.MKL_Set_Threading_Layer(ctypes.c_int(1))
        lib.mkl_cbwr_get_auto_branch.restype = ctypes.c_int
        for name in ("vmsAcos", "vmsSin", "vmsCos"):
            getattr(lib, name).restype = None
        lib.cblas_sdot.restype = ctypes.c_float
        return lib
    return None


def backend() -> str:
    """``"mkl"`` (torch's x86_64 values, bit for bit) or ``"numpy"`` (correctly rounded)."""
    return "mkl" if _mkl() is not None else "numpy"


def mkl_branch() -> Optional[int]:
    """The code path oneMKL chose for this CPU (``mkl_cbwr_get_auto_branch``: 2 is the generic
    one, larger values AVX2, AVX-512, ...), or None without oneMKL. Its last bits may differ
    between paths, so the bit-for-bit tests hold on the path their goldens were recorded on."""
    lib = _mkl()
    return None if lib is None else int(lib.mkl_cbwr_get_auto_branch())


def _vml(lib: ctypes.CDLL, name: str, x: np.ndarray) -> np.ndarray:
    f = getattr(lib, name)
    flat = np.ascontiguousarray(x.reshape(-1))
    out = np.empty_like(flat)
    ptr = ctypes.POINTER(ctypes.c_float)
    for lo in range(0, flat.size, _MAX_N):
        n = min(_MAX_N, flat.size - lo)
        f(ctypes.c_int(n), flat[lo:].ctypes.data_as(ptr), out[lo:].ctypes.data_as(ptr), ctypes.c_longlong(_VML_MODE))
    return out.reshape(x.shape)


def _unary(name: str, f64: Callable[[np.ndarray], np.ndarray], x):
    """``x`` (a float32 scalar or array) through oneMKL's ``name``, or ``f64`` rounded to float32;
    a scalar in, a NumPy float32 scalar out."""
    a = np.asarray(x, dtype=np.float32)
    lib = _mkl()
    y = _vml(lib, name, a) if lib is not None else f64(a.astype(np.float64)).astype(np.float32)
    return np.float32(y.reshape(())) if a.ndim == 0 else y


def acos(x):
    """torch's float32 ``acos`` of ``x`` (float32 scalar or array)."""
    return _unary("vmsAcos", np.arccos, x)


def sin(x):
    """torch's float32 ``sin`` of ``x`` (float32 scalar or array)."""
    return _unary("vmsSin", np.sin, x)


def cos(x):
    """torch's float32 ``cos`` of ``x`` (float32 scalar or array)."""
    return _unary("vmsCos", np.cos, x)


def empty64(n: int) -> np.ndarray:
    """An uninitialised float32 vector of ``n`` elements starting on a 64-byte boundary, as torch
    allocates tensors: oneMKL's ``sdot`` sums in an order that depends on the vectors' alignment."""
    buf = np.empty(n + 16, np.float32)
    lo = (-buf.ctypes.data % 64) // 4
    return buf[lo:lo + n]


def _aligned64(x) -> np.ndarray:
    """``x`` as a flat float32 vector on a 64-byte boundary (a copy unless it already is one)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.flags.c_contiguous and x.ctypes.data % 64 == 0:
        return x
    out = empty64(x.size)
    out[...] = x
    return out


def dot(x: np.ndarray, y: np.ndarray) -> np.float32:
    """torch's float32 ``dot`` of two float32 vectors: BLAS's ``sdot``, oneMKL's in torch's x86_64
    builds (checked bit for bit against torch 2.14.1 from 1 to 3M elements, one thread), on the
    vectors aligned as torch's tensors are (:func:`empty64`; others are copied); without oneMKL,
    the float32 products summed in float64 and rounded."""
    x, y = _aligned64(x), _aligned64(y)
    lib = _mkl()
    if lib is None or x.size > _MAX_N:
        return np.float32((x * y).sum(dtype=np.float64))
    ptr = ctypes.POINTER(ctypes.c_float)
    return np.float32(lib.cblas_sdot(ctypes.c_int(x.size), x.ctypes.data_as(ptr), ctypes.c_int(1),
                                     y.ctypes.data_as(ptr), ctypes.c_int(1)))
