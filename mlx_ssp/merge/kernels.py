"""The fused-kernel plumbing every merge method shares: compute dtypes, the rounding rule, the
cache of ``mx.compile`` kernels and the slice size of the elementwise steps.

Arithmetic runs in float32; every intermediate that mergekit 0.1.5 materialises in the compute
dtype ``cd`` is rounded to it (:func:`rnd`), which is how torch computes each bf16 op (in float32,
result rounded). Elementwise steps run in slices of :data:`CHUNK` elements.
"""

from __future__ import annotations

import threading
from typing import Iterator

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

F32 = mx.float32
F64 = mx.float64
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

#: elements per slice of the elementwise steps (float32 temporaries of 1 MiB, so that a slice's
#: inputs, temporaries and outputs stay in a 2-4 MiB L2 cache: measured ~5% faster than 1 << 20).
#: Read as ``kernels.CHUNK`` at call time (the tests shrink it).
CHUNK = 1 << 18


def rnd(x: mx.array, cd) -> mx.array:
    """Round a float32 array to the compute dtype ``cd`` and back (identity for float32)."""
    if cd == F32:
        return x
    return x.astype(cd).astype(F32)


def f32(x: mx.array) -> mx.array:
    """``x`` as float32 (no op when it already is)."""
    return x if x.dtype == F32 else x.astype(F32)


def scalar(v: float) -> mx.array:
    """A float32 0-d array: scalars travel into kernels as arrays so new values do not recompile."""
    return mx.array(v, dtype=F32)


# Elementwise steps are fused with mx.compile (shapeless: one compiled kernel per step kind, reused
# for every tensor length).
_KERNELS: dict = {}
_KERNELS_LOCK = threading.Lock()


def kernel(key, build):
    """The compiled ``build()`` for ``key`` (compiled once per process; ``key`` must name every
    value the built function captures)."""
    k = _KERNELS.get(key)
    if k is None:
        with _KERNELS_LOCK:  # merging threads: one compiled function per key
            k = _KERNELS.get(key)
            if k is None:
                k = _KERNELS[key] = mx.compile(build(), shapeless=True)
    return k


def slices(size: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of consecutive slices of :data:`CHUNK` elements covering ``range(size)``."""
    for lo in range(0, size, CHUNK):
        yield lo, min(size, lo + CHUNK)
