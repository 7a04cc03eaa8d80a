"""The merge's elementwise passes in C, for bf16 merges on a Linux x86_64 CPU: karcher,
multislerp, nuslerp (whole tensor and per row) and model_stock (both modes).

MLX compiles its fused CPU kernels with ``g++ -O3`` and no ``-march``: SSE2 only, 4 floats per
instruction, while the bf16 merge methods round to bf16 after nearly every operation (karcher's
tangent 11 times per element over 3 inputs). Those passes are compute-bound there, so karcher,
multislerp and nuslerp ran at 1.6-3.4x mergekit's speed. The C files under ``csrc/`` compute the
same values, operation for operation and in the same order (each file says which MLX kernels it
replaces), built by :mod:`mlx_ssp.native` with ``-O3 -march=native -ffp-contract=off`` (no
``-ffast-math``: the compiler may vectorise but never reorder a sum or fuse a multiply-add), so
the outputs are the same bits as the MLX path's; the tests check that on every pass.

The MLX path stays: it is used where this library is not (another OS or CPU, no C compiler,
``MLX_SSP_MERGE_NATIVE=0``, MLX on a GPU, inputs that are not bf16, model_stock of more than 8
models, nuslerp per column), and :func:`enabled` switches between the two for the tests and the
benchmark.
"""

from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp import native

CSRC = Path(__file__).with_name("csrc")
DISABLE_ENV = "MLX_SSP_MERGE_NATIVE"
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=256", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off")

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_I, _N, _F = ctypes.c_int, ctypes.c_int64, ctypes.c_float
_FP, _DP = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_double)
#: argument and result types of every exported function
_SIGNATURES = {
    "mlx_ssp_round_bf16": ([_P, _P, _N], None),
    "mlx_ssp_sumsq_bf16": ([_P, _N, _I], _F),
    "mlx_ssp_kar_first": ([_PP, _I, _N, _FP, _FP, _PP, _P, _I], _F),
    "mlx_ssp_kar_dots": ([_P, _PP, _I, _N, _I, _F, _DP], _I),
    "mlx_ssp_kar_tangent": ([_P, _PP, _I, _N, _FP, _FP, _P, _I], _F),
    "mlx_ssp_kar_step": ([_P, _P, _N, _F, _F, _F, _I], _F),
    "mlx_ssp_kar_out": ([_P, _N, _I, _F, _F, _P, _I], None),
    "mlx_ssp_msl_first": ([_PP, _I, _N, _FP, _FP, _P, _I], _F),
    "mlx_ssp_msl_dots": ([_P, _PP, _I, _N, _FP, _F, _DP], _I),
    "mlx_ssp_msl_tangent": ([_P, _PP, _I, _N, _FP, _FP, _FP, _P, _I], _F),
    "mlx_ssp_msl_out": ([_P, _P, _N, _F, _F, _F, _P, _I], None),
    "mlx_ssp_sumsq_rows_bf16": ([_P, _N, _N, _I, _P], None),
    "mlx_ssp_nus_cos": ([_P, _P, _N, _N, _P, _P, _P], None),
    "mlx_ssp_nus_mix": ([_P, _P, _N, _N, _P, _P, _P, _P, _F, _F, _P, _I], None),
    "mlx_ssp_ms_max_models": ([], _I),
    "mlx_ssp_ms_sums": ([_P, _PP, _I, _N, _N, _I, _P, _P], _I),
    "mlx_ssp_ms_combine": ([_P, _PP, _I, _N, _N, _P, _P, _I], None),
}

_lib: Optional[ctypes.CDLL] = None
_lock = threading.Lock()
_on = os.environ.get(DISABLE_ENV, "") != "0"
status = "not attempted"


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.[ch]"))


def _load() -> Optional[ctypes.CDLL]:
    """The library (built on first use); None where it cannot be: :data:`status` says why."""
    global _lib, status
    if _lib is not None or status != "not attempted":
        return _lib
    with _lock:
        if _lib is not None or status != "not attempted":
            return _lib
        if not native.linux_x86_64():
            status = "not Linux x86_64"
            return None
        cc = native.compiler()
        if cc is None:
            status = "no C compiler (cc, gcc or clang)"
            return None
        try:
            lib = native.load("merge_kernels", sources(), cc, FLAGS, ("-lm",), per_cpu=True)
            for name, (args, res) in _SIGNATURES.items():
                f = getattr(lib, name)
                f.argtypes, f.restype = args, res
        except Exception as e:  # noqa: BLE001 - the MLX path is always there
            status = f"not built: {e}"
            return None
        _lib, status = lib, f"on ({lib._name})"
        return _lib


def usable(*xs: mx.array) -> bool:
    """Whether the native passes take a merge of these inputs: all bf16, MLX on the CPU, the
    library built and not switched off."""
    if not _on or any(x.dtype != mx.bfloat16 for x in xs) or mx.default_device() != mx.cpu:
        return False
    return _load() is not None


def describe() -> str:
    """What a bf16 merge would use here (building the library if it is not yet)."""
    if not _on:
        return f"off ({DISABLE_ENV}=0 or switched off)"
    if mx.default_device() != mx.cpu:
        return "off: MLX runs on the GPU here (merges use MLX's kernels there)"
    _load()
    return status


def lib() -> ctypes.CDLL:
    got = _load()
    if got is None:
        raise RuntimeError(f"the merge's native library is not available: {status}")
    return got


@contextmanager
def enabled(on: bool) -> Iterator[bool]:
    """The native passes on or off inside the block (process-wide); yields the state before."""
    global _on
    before, _on = _on, bool(on)
    try:
        yield before
    finally:
        _on = before


def empty(n: int, dtype=mx.bfloat16) -> tuple[mx.array, np.ndarray]:
    """A new evaluated MLX array of ``n`` elements and a writable NumPy view of its memory (uint16
    for bf16, float32 for float32): the passes write an output MLX then owns, without a copy."""
    a = mx.zeros((n,), dtype=mx.uint16 if dtype == mx.bfloat16 else dtype)
    mx.eval(a)
    view = np.asarray(a)
    if not view.flags.writeable or view.ctypes.data == 0 and n:
        raise RuntimeError("MLX did not hand out a writable buffer")
    return (a.view(mx.bfloat16) if dtype == mx.bfloat16 else a), view


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def ptrs(arrays: Sequence[np.ndarray]):
    return (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])


def floats(values: Sequence[float]):
    return (ctypes.c_float * len(values))(*[float(v) for v in values])
