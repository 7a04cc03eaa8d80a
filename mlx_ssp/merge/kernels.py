"""The fused-kernel plumbing every merge method shares: compute dtypes, the rounding rule, the
cache of ``mx.compile`` kernels, the slice size of the elementwise steps and sliced reductions.

Arithmetic runs in float32; every intermediate that mergekit 0.1.5 materialises in the compute
dtype ``cd`` is rounded to it (:func:`rnd`), which is how torch computes each bf16 op (in float32,
result rounded). Elementwise steps run in slices of :data:`CHUNK` elements.

Reductions (:func:`sums`, :func:`sweep`) run slice by slice too, so that no full-size float32
copy of a tensor is ever held, in one of two orders, each chosen to give mergekit's values:

- float64 (whole-tensor sums, row sums): the float32 terms summed in float64, rounded to float32
  once, i.e. the correctly rounded sum nearly always, whatever the slicing. torch's own float32
  sums (``sum``, ``mean``) are a cascade that is about as accurate; MLX's plain float32 sum over
  millions of elements drifts (measured: 7% off for the sum of 32.8M squares, 6e-5 relative for
  2^18 of them).
- torch's norm order (the squares of ``torch.norm`` / ``vector_norm``, :data:`TORCH_LANES`): that
  kernel accumulates in 8 float32 lanes, and drifts by ~1e-4 relative over 4M elements; mergekit's
  karcher keeps those float32 norms, so matching it means drifting the same way.
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


#: how :func:`rnd` rounds to bf16 while a kernel is traced (:func:`kernel`'s ``cast_rounding``)
_ROUNDING = threading.local()


def rnd(x: mx.array, cd) -> mx.array:
    """Round a float32 array to the compute dtype ``cd`` and back (identity for float32); bf16 by
    :func:`round_bf16`, or by the two casts inside a kernel built with ``cast_rounding`` and for a
    single value (the same values)."""
    if cd == F32:
        return x
    # bits outside a kernel, except for a scalar: there each of the bit ops is one more operation
    # MLX evaluates on its own (a round trip to the stream's thread), the casts are two
    if cd == mx.bfloat16 and not getattr(_ROUNDING, "cast", False) and x.size > 1:
        return round_bf16(x)
    return x.astype(cd).astype(F32)


def round_bf16(x: mx.array) -> mx.array:
    """float32 rounded to the nearest bf16 (ties to even), still float32, on the bits: add half an
    ulp of bf16 (less one, plus the kept last bit) and clear the low 16 bits. Equal to
    ``astype(bfloat16).astype(float32)`` for every one of the 2^32 float32 bit patterns (a NaN
    becomes the quiet NaN 0x7FC00000, as the cast makes it), and in a fused kernel ~2x faster than
    those two casts, which dominate the cost of the bf16 interpolations (one per op). Needs
    non-shapeless compilation (``mx.view`` has no shapeless shape inference)."""
    return mx.view(_bf16_rounded_bits(mx.view(x, mx.uint32)), F32)


def _bf16_rounded_bits(b):
    """:func:`round_bf16` on the float32 bits ``b`` (uint32, an MLX or a NumPy array)."""
    # 1 where |x| is a NaN (its magnitude's bits exceed inf's), without a compare and a select
    nan = (0x7F800000 - (b & 0x7FFFFFFF)) >> 31
    r = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
    return r - nan * (r - 0x7FC00000)  # a NaN: exactly the quiet NaN (arithmetic modulo 2^32)


def rnd_host(x, cd) -> np.ndarray:
    """:func:`rnd` of float32 values on the host (NumPy): the same bits, for the few scalars
    between a merge's passes (an MLX evaluation of each waits on the stream's thread)."""
    x = np.asarray(x, dtype=np.float32)
    if cd == F32:
        return x
    if cd == mx.bfloat16:  # on a 1-D copy: NumPy's scalars would warn where the bit ops wrap around
        return _bf16_rounded_bits(x.reshape(-1).view(np.uint32)).view(np.float32).reshape(x.shape)
    return x.astype(np.float16).astype(np.float32)


def f32(x: mx.array) -> mx.array:
    """``x`` as float32 (no op when it already is)."""
    return x if x.dtype == F32 else x.astype(F32)


def scalar(v) -> mx.array:
    """A float32 0-d array: scalars travel into kernels as arrays so new values do not recompile
    (and a NumPy scalar on the left of ``*`` would turn an MLX array into NumPy)."""
    return mx.array(float(v), dtype=F32)


def item32(x: mx.array) -> np.float32:
    """A one-element array's value as a NumPy float32."""
    return np.float32(x.item())


def aligned(x: mx.array, cd) -> mx.array:
    """A slice aligned to ``cd`` (as mergekit aligns its inputs), in float32."""
    return f32(x.astype(cd))


# Elementwise steps are fused with mx.compile, traced once per input shape (slices repeat a few
# shapes; shapeless kernels cannot hold :func:`round_bf16`'s bit views) unless a kernel asks for
# cast rounding and one shapeless compilation (see :func:`kernel`).
_KERNELS: dict = {}
_KERNELS_LOCK = threading.Lock()


def kernel(key, build, cast_rounding: bool = False, shapeless: bool = False):
    """The compiled ``build()`` for ``key`` (compiled once per process; ``key`` must name every
    value the built function captures). ``cast_rounding``: :func:`rnd` rounds to bf16 by two casts
    in this kernel, and ``shapeless`` compiles it once for every shape (bit rounding needs
    per-shape tracing). Which is faster depends on the kernel (measured, CPU per 4096 x 1024 bf16
    tensor: karcher 0.57 s with bit rounding, 0.46 s with casts; model_stock 0.031 s, 0.025 s with
    casts and shapeless; nuslerp 0.033 s, 0.058 s with casts; multislerp, its unit vectors held,
    0.082 s, 0.070 s with casts)."""
    k = _KERNELS.get(key)
    if k is None:
        with _KERNELS_LOCK:  # merging threads: one compiled function per key
            k = _KERNELS.get(key)
            if k is None:
                fn = build()

                def traced(*args):  # tracing runs the Python function: the rounding mode is set then
                    before = getattr(_ROUNDING, "cast", False)
                    _ROUNDING.cast = cast_rounding
                    try:
                        return fn(*args)
                    finally:
                        _ROUNDING.cast = before
                k = _KERNELS[key] = mx.compile(traced, shapeless=shapeless and cast_rounding)
    return k


def each(size: int, f, align: int = 1) -> list[mx.array]:
    """``f(lo, hi)`` evaluated slice by slice (:func:`slices`) over a flat tensor of ``size`` elements."""
    parts = []
    for lo, hi in slices(size, align):
        part = f(lo, hi)
        mx.eval(part)
        parts.append(part)
    return parts


def slices(size: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of consecutive slices of about :data:`CHUNK` elements covering ``range(size)``;
    each a multiple of ``align`` elements (whole rows of a row-wise step; at least one row)."""
    align = max(1, align)
    step = max(align, CHUNK // align * align)
    for lo in range(0, size, step):
        yield lo, min(size, lo + step)


#: torch's CPU 2-norm over a contiguous last axis (the kernel mergekit's ``torch.norm`` and
#: ``vector_norm`` run, x86 builds): float32 squares accumulated in order in this many lanes (lane j
#: takes elements j, j + 8, ...) over the longest prefix that is a multiple of one vector's elements
#: (8 float32, 16 bf16 / fp16), the lanes then added in order, then the rest one by one
TORCH_LANES = 8


def torch_block(dtype) -> int:
    """Elements of one 256-bit vector of ``dtype`` (torch's vectorised prefix is a multiple of it)."""
    return 8 if dtype == F32 else 16


#: slices of the passes that hold an iterate (:func:`sweep`) are multiples of this many elements
ALIGN = 16


def sum_array(total) -> mx.array:
    """A whole-tensor sum (float64 or float32 value) as the sums hand it: float32, shape (1,)."""
    return mx.array(np.float32(total)).reshape(-1)


def _as_f32(totals) -> list[mx.array]:
    return [sum_array(v) for v in totals]


def raw_bits(x: mx.array) -> np.ndarray:
    """The bits of a float array, flat, as a zero-copy NumPy view of its memory through the buffer
    protocol (uint16 for bf16 / fp16, uint32 for float32; a strided array is copied first).
    ``np.asarray`` of an ``mx.view`` may copy; NumPy has no bf16 to view as."""
    flat = mx.contiguous(x.reshape(-1))  # no copy when it already is
    mx.eval(flat)
    dt = np.uint16 if flat.dtype.size == 2 else np.uint32
    if flat.size == 0:  # an empty array has no buffer to view
        return np.zeros(0, dt)
    return np.frombuffer(memoryview(flat).cast("B"), dtype=dt)


class _Exact:
    """Whole-tensor sums in float64 (NumPy's pairwise sum of the float32 terms), rounded to float32
    at the end: within rounding of the exact sum, whatever the slicing."""

    lazy = False  # :meth:`add` takes evaluated terms

    def __init__(self):
        self.totals: Optional[np.ndarray] = None

    def add(self, lo: int, hi: int, part: list) -> None:
        got = np.array([np.asarray(x, dtype=np.float32).sum(dtype=np.float64) for x in part])
        self.totals = got if self.totals is None else self.totals + got

    def result(self) -> list[mx.array]:
        return _as_f32(self.totals if self.totals is not None else np.zeros(0))


class _Lanes:
    """Sums in the order of torch's CPU norm kernel (:data:`TORCH_LANES`), over the whole tensor or
    per row of ``width`` elements; the state between slices is each term's lane accumulators.

    Whole tensor, :meth:`add` takes the slice's terms unevaluated and leaves the new accumulators
    unevaluated (:meth:`pending`), so that the caller evaluates them with the terms in one graph
    and the terms' buffers are reused in place (the caller keeps no reference to them)."""

    def __init__(self, size: int, block: int, width: Optional[int] = None):
        self.lazy = width is None
        self.per_row = width is not None
        self.width = width or size
        self.m = self.width - self.width % block  # the vectorised prefix of a row
        self.acc: Optional[list] = None  # whole tensor: per term, the lanes so far
        self.tail: Optional[list] = None
        self.rows: Optional[list[list[np.ndarray]]] = None  # per row: per term, the finished rows

    @staticmethod
    def _fold(acc: np.ndarray) -> np.ndarray:
        """The lanes (last axis) added in order."""
        b = acc[..., 0].copy()
        for j in range(1, acc.shape[-1]):
            b = (b + acc[..., j]).astype(np.float32)
        return b

    def add(self, lo: int, hi: int, part: list) -> None:
        # MLX sums a (k, lanes) array along axis 0 row after row, in order (checked bit for bit
        # against a sequential sum up to 4M rows): the lanes' running sums, ~4x NumPy's speed
        xs = [x.reshape(-1) for x in part]
        if self.per_row:
            self._add_rows(xs)
            return
        if self.acc is None:
            self.acc = [mx.zeros((1, TORCH_LANES), dtype=F32) for _ in xs]
            self.tail = [[] for _ in xs]
        v_hi = min(hi, self.m)
        for i, x in enumerate(xs):
            if hi > self.m:
                self.tail[i].append(np.asarray(x[max(self.m, lo) - lo:], dtype=np.float32))
            if lo < v_hi:  # the lanes go on from the previous slice's (slices are whole vectors)
                # the accumulators added to the first row, ((acc + x0) + x1) + ...: the running sum
                # in order, the slice's buffer updated in place (no concatenated copy)
                seg = x[: v_hi - lo].reshape(-1, TORCH_LANES)
                self.acc[i] = mx.sum(seg.at[0].add(self.acc[i][0]), axis=0, keepdims=True)
        xs.clear()
        part.clear()

    def pending(self) -> list:
        """The accumulators (unevaluated after :meth:`add`)."""
        return self.acc or []

    def _add_rows(self, xs: list[mx.array]) -> None:
        got = []
        for x in xs:
            r = x.reshape(-1, self.width)
            acc = np.asarray(mx.sum(r[:, : self.m].reshape(r.shape[0], -1, TORCH_LANES), axis=1)) if self.m else None
            b = self._fold(acc) if self.m else np.zeros(r.shape[0], np.float32)
            rest = np.asarray(r[:, self.m:], dtype=np.float32)
            for c in range(rest.shape[1]):
                b = (b + rest[:, c]).astype(np.float32)
            got.append(b)
        self.rows = [[g] for g in got] if self.rows is None else [r + [g] for r, g in zip(self.rows, got)]

    def result(self) -> list[mx.array]:
        if self.rows is not None:
            return [mx.array(np.concatenate(r)) for r in self.rows]
        out = []
        for acc, tail in zip(self.acc or [], self.tail or []):
            b = self._fold(np.asarray(acc, dtype=np.float32).reshape(-1))
            for t in tail:
                for v in t:
                    b = np.float32(b + v)
            out.append(mx.array(np.float32(b)).reshape(1))
        return out


def sweep(step: Callable[[int, int], tuple[Any, Sequence[mx.array]]], size: int, block: Optional[int] = None,
          into: Optional[list] = None) -> tuple[list, list[mx.array]]:
    """One pass over a flat tensor of ``size`` > 0 elements, in slices of whole multiples of
    :data:`ALIGN` elements: ``step(lo, hi)`` returns (kept, terms); ``kept`` (an array or a list of them, e.g.
    a slice of an updated iterate) is evaluated and collected per slice (``into``: stored in place
    of that list's slice, so the old slice is freed as the new one is made); the terms are summed
    over the whole tensor, as :func:`sums` does (``block``: in torch's norm order). Returns (the
    kept values in slice order, each term's sum as a float32 array of shape (1,))."""
    acc = _Lanes(size, block) if block else _Exact()
    kept = into if into is not None else []
    for k, (lo, hi) in enumerate(slices(size, ALIGN)):
        keep, terms = step(lo, hi)
        part = list(terms)
        del terms
        if acc.lazy:
            acc.add(lo, hi, part)  # empties ``part``: the terms are the graph's alone
            mx.eval(keep, acc.pending())
        else:
            mx.eval(keep, part)
            acc.add(lo, hi, part)
        if into is not None:
            into[k] = keep
        else:
            kept.append(keep)
    return kept, acc.result()


def sums(terms: Callable[[int, int], Sequence[mx.array]], size: int, width: Optional[int] = None,
         block: Optional[int] = None) -> list[mx.array]:
    """Sums of float32 terms over a flat tensor of ``size`` elements, computed slice by slice:
    ``terms(lo, hi)`` returns the (lazy) terms of elements ``[lo, hi)``, e.g. squares and products.

    ``width`` None: each term's sum over the whole tensor as a float32 array of shape (1,) (summed
    in float64, then rounded to float32).
    ``width`` given: per row of ``width`` elements (shape (rows,)), summed in float64 then rounded
    to float32.
    ``block`` given (squares for a norm): in the order of torch's CPU norm kernel instead
    (:data:`TORCH_LANES`; ``block``: :func:`torch_block` of the dtype torch reduces), whole tensor
    or per row of ``width``: its float32 drift over millions of elements included."""
    if size == 0:  # an empty tensor: the terms' count is unknown without a slice
        return _as_f32(np.zeros(len(terms(0, 0))))
    if block:
        acc = _Lanes(size, block, width)
        for lo, hi in slices(size, width or ALIGN):
            part = list(terms(lo, hi))
            if not acc.lazy:
                mx.eval(part)
            acc.add(lo, hi, part)
            mx.eval(acc.pending())
        return acc.result()
    if width:
        rows: Optional[list[list]] = None
        for lo, hi in slices(size, width):
            got = list(terms(lo, hi))
            mx.eval(got)
            part = [np.asarray(x, dtype=np.float32).reshape(-1, width).sum(-1, dtype=np.float64) for x in got]
            rows = [[p] for p in part] if rows is None else [r + [p] for r, p in zip(rows, part)]
        return [mx.array(np.concatenate(r).astype(np.float32)) for r in rows or []]
    return sweep(lambda lo, hi: ((), terms(lo, hi)), size)[1]


def _ceil_log2(n: int) -> int:
    return 0 if n <= 1 else int(n - 1).bit_length()


def _running(x: np.ndarray) -> np.ndarray:
    """The float32 running sum from 0 along axis 0, in order (zeros for an empty axis)."""
    if x.shape[0] == 0:
        return np.zeros(x.shape[1:], np.float32)
    return np.cumsum(x, axis=0, dtype=np.float32)[-1]


def _multi_row_sum(rows: np.ndarray) -> np.ndarray:
    """torch's CPU ``multi_row_sum`` of ``rows`` (n, ...) along axis 0: in up to 4 levels of groups
    of ``2^max(4, ceil(log2(n)) // 4)`` rows (each group's sum from 0 is added to the next level,
    which is carried on and reset when its own group is full; the last level is never reset), the
    levels then added in order."""
    step = 1 << max(4, _ceil_log2(rows.shape[0]) // 4)
    level, kept = rows, []
    for _ in range(3):  # levels 0-2: full groups move up; the rest stays in the level's accumulator
        ng = level.shape[0] // step
        full = level[: ng * step].reshape((ng, step) + level.shape[1:])
        kept.append(_running(level[ng * step:]))
        level = np.cumsum(full, axis=1, dtype=np.float32)[:, -1] if ng else full[:, 0]
    acc = kept[0]
    for a in (kept[1], kept[2], _running(level)):
        acc = (acc + a).astype(np.float32)
    return acc


def _torch_row_sum(rows: np.ndarray) -> np.ndarray:
    """torch's CPU ``row_sum`` of ``rows`` (n, lanes): 4 interleaved accumulators (row i to
    accumulator i % 4) over the first n // 4 * 4 rows, each a :func:`_multi_row_sum` of its n // 4
    rows, the leftover rows added to accumulator 0, then the accumulators added in order."""
    m = rows.shape[0] // 4
    acc = _multi_row_sum(rows[: 4 * m].reshape((m, 4) + rows.shape[1:]))
    for r in rows[4 * m:]:
        acc[0] = (acc[0] + r).astype(np.float32)
    total = acc[0]
    for k in (1, 2, 3):
        total = (total + acc[k]).astype(np.float32)
    return total


def torch_sum(x, width: Optional[int] = None):
    """torch's CPU float32 ``sum`` on one thread, in its order (checked bit for bit against torch
    2.14 on lengths 1 to 4M): of a contiguous array (a float32 scalar) or, with ``width``, of each
    row of ``width`` elements (``sum(dim=-1)``; a float32 array). Per row: :func:`_torch_row_sum`
    of its 8-element vectors, then the leftover elements one by one from 0, then the 8 lanes;
    under 8 elements, the row sum of the scalars. (With T threads torch sums T parts of a whole
    tensor this way and adds their results.)"""
    x = np.asarray(x, dtype=np.float32)
    rows = x.reshape(-1, width) if width else x.reshape(1, -1)
    w = rows.shape[1]
    if w < TORCH_LANES:
        got = _torch_row_sum(rows.T.copy()) if w else np.zeros(rows.shape[0], np.float32)
    else:
        nv = w // TORCH_LANES
        lanes = _torch_row_sum(rows[:, : nv * TORCH_LANES].reshape(-1, nv, TORCH_LANES).transpose(1, 2, 0))
        got = np.zeros(rows.shape[0], np.float32)
        for v in [rows[:, c] for c in range(nv * TORCH_LANES, w)] + list(lanes):
            got = (got + v).astype(np.float32)
    return got if width else np.float32(got[0])


def torch_column_sums(x) -> np.ndarray:
    """torch's CPU float32 ``sum`` over axis 0 of a C-contiguous (n, m) array (a reduction across
    rows, e.g. ``sum(dim=-1)`` of a transposed view), one thread (checked bit for bit against torch
    2.14 from 1 x 33 to 100000 x 3 and 300 x 1000): the columns in blocks of four 8-lane vectors,
    each column the :func:`_multi_row_sum` of its n values; the columns left over each summed as
    :func:`_torch_row_sum` sums (4 interleaved accumulators)."""
    x = np.asarray(x, dtype=np.float32)
    nb = x.shape[1] // (4 * TORCH_LANES) * (4 * TORCH_LANES)
    head = _multi_row_sum(x[:, :nb]) if nb and x.shape[0] else np.zeros(nb, np.float32)
    tail = _torch_row_sum(x[:, nb:]) if x.shape[0] else np.zeros(x.shape[1] - nb, np.float32)
    return np.concatenate([head, tail])


def torch_column_norms(x) -> np.ndarray:
    """torch's CPU float32 2-norm over axis 0 of a C-contiguous (n, m) array (``norm(dim=-1)`` of a
    transposed view): the squares summed in order, row after row."""
    x = np.asarray(x, dtype=np.float32)
    return np.sqrt(_running(np.square(x)))
