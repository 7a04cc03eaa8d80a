"""The fused-kernel plumbing every merge method shares: compute dtypes, the rounding rule, the
cache of ``mx.compile`` kernels, the slice size of the elementwise steps and sliced reductions.

Arithmetic runs in float32; every intermediate that mergekit 0.1.5 materialises in the compute
dtype ``cd`` is rounded to it (:func:`rnd`), which is how torch computes each bf16 op (in float32,
result rounded). Elementwise steps run in slices of :data:`CHUNK` elements.

Reductions (:func:`sums`) run slice by slice too, so that no full-size float32 copy of a tensor is
ever held. Whole-tensor sums add float32 partial sums of :data:`SUM_ROW` elements in float64.
Deviation (from both mergekit and a plain MLX sum): torch sums float32 in a cascade, MLX's plain
float32 sum over millions of elements drifts (measured: 7% off for the sum of 32.8M squares, 6e-5
relative for 2^18 of them); partial sums over rows of 256 are within 2e-9 of the exact value.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

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


def slices(size: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of consecutive slices of about :data:`CHUNK` elements covering ``range(size)``;
    each a multiple of ``align`` elements (whole rows of a row-wise step; at least one row)."""
    align = max(1, align)
    step = max(align, CHUNK // align * align)
    for lo in range(0, size, step):
        yield lo, min(size, lo + step)


#: whole-tensor sums: float32 partial sums over rows of this many elements, added in float64
SUM_ROW = 256


def _row_partials(x: mx.array) -> list[mx.array]:
    """Float32 sums of the consecutive SUM_ROW-element rows of the flat ``x`` (the tail: one more)."""
    full = x.size // SUM_ROW * SUM_ROW
    out = [mx.sum(x[:full].reshape(-1, SUM_ROW), axis=-1)] if full else []
    if full < x.size:
        out.append(mx.sum(x[full:], keepdims=True))
    return out


def _totals(partials: list[list[mx.array]]) -> np.ndarray:
    """Each term's float32 row partials (evaluated) added in float64."""
    return np.array([sum(float(np.asarray(p).sum(dtype=np.float64)) for p in ps) for ps in partials])


def _as_f32(totals: np.ndarray) -> list[mx.array]:
    return [mx.array(np.float32(v)).reshape(1) for v in totals]


def sweep(step: Callable[[int, int], tuple[Any, Sequence[mx.array]]], size: int) -> tuple[list, list[mx.array]]:
    """One pass over a flat tensor of ``size`` > 0 elements, slice by slice: ``step(lo, hi)`` returns
    (kept, terms); ``kept`` (an array or a list of them, e.g. a slice of an updated iterate) is
    evaluated and collected per slice, the terms are summed over the whole tensor as :func:`sums`
    does (float32 partial sums per :data:`SUM_ROW` elements, added in float64). Returns (the kept
    values in slice order, each term's sum as a float32 array of shape (1,))."""
    kept, totals = [], None
    for lo, hi in slices(size):
        keep, terms = step(lo, hi)
        part = [_row_partials(x) for x in terms]
        mx.eval(keep, part)
        kept.append(keep)
        got = _totals(part)
        totals = got if totals is None else totals + got
    return kept, _as_f32(totals if totals is not None else np.zeros(0))


def sums(terms: Callable[[int, int], Sequence[mx.array]], size: int, width: Optional[int] = None) -> list[mx.array]:
    """Sums of float32 terms over a flat tensor of ``size`` elements, computed slice by slice:
    ``terms(lo, hi)`` returns the (lazy) terms of elements ``[lo, hi)``, e.g. squares and products.

    ``width`` None: each term's sum over the whole tensor as a float32 array of shape (1,) (partial
    sums per :data:`SUM_ROW` elements in float32, added in float64, then rounded to float32).
    ``width`` given: per row of ``width`` elements, MLX's float32 sum along the row (shape (rows,)),
    the value a full-size ``mx.sum(x.reshape(-1, width), axis=-1)`` gives."""
    if width:
        rows: Optional[list[list[mx.array]]] = None
        for lo, hi in slices(size, width):
            part = [mx.sum(x.reshape(-1, width), axis=-1) for x in terms(lo, hi)]
            mx.eval(part)
            rows = [[p] for p in part] if rows is None else [r + [p] for r, p in zip(rows, part)]
        return [r[0] if len(r) == 1 else mx.concatenate(r) for r in rows or []]
    if size == 0:  # an empty tensor: the terms' count is unknown without a slice
        return _as_f32(np.zeros(len(terms(0, 0))))
    return sweep(lambda lo, hi: ((), terms(lo, hi)), size)[1]
