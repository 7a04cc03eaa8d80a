"""Sparsification of task vectors (one flat delta at a time): which elements survive, and the factor
that scales the survivors back up.

- ``magnitude`` (TIES, Yadav et al. 2023, section 3 "trim"): the top ``max(1, int(density * n))``
  magnitudes, ties at the threshold to the lowest flat indices (a stable descending sort), found by
  an O(n) introselect on the raw float bits (:class:`MagnitudeCut`: no full mask is stored).
- ``random`` (DARE, Yu et al. 2024, section 3 "drop"): keep each element with probability
  ``density``, from a PCG64 stream seeded by (seed, tensor name, model) (:func:`dare_seed`).
- ``outliers`` (model breadcrumbs, Davari & Belilovsky 2023): drop the ``gamma`` largest and the
  smallest magnitudes, keep ``density``.
- ``magprune`` (DELLA, Deep et al. 2024, section 3 "MagPrune"; mergekit's ``della_magprune``): rank
  the magnitudes along axis 1 of the tensor (a 1-D tensor is one row), map ranks linearly to keep
  probabilities in ``[density - epsilon, density + epsilon]`` (the largest magnitude most likely
  kept) and draw each element from the same seeded PCG64 stream as DARE. The ranks, their
  normalisation and the probabilities are rounded to the rescale dtype step by step, as mergekit
  computes them; exact magnitude ties rank by flat index (a stable sort; torch's is unstable), and
  a row of one element keeps with probability ``density - epsilon`` (mergekit divides 0 by 0).
- rescale (DARE "rescale"): ``l1`` matches the L1 norm of the unmasked delta (mergekit),
  ``inverse_density`` multiplies by ``1 / density`` (the DARE paper).

:data:`SPARSIFIERS` maps each name to its selection function and the dtype its rescale is rounded in.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge import kernels as K
from mlx_ssp.merge.kernels import F32, f32, kernel, rnd, scalar



#: reused scratch buffers: a fresh large allocation costs a page fault per 4 KiB page on every
#: tensor, which on this kind of machine is slower than the select itself
#: (one set per merging thread)
_SCRATCH = threading.local()
_COUNT_CHUNK = 1 << 20


def _scratch(dtype, n: int, tag: str = "") -> np.ndarray:
    bufs = _SCRATCH.__dict__
    key = (np.dtype(dtype), tag)
    b = bufs.get(key)
    if b is None or b.size < n:
        b = bufs[key] = np.empty(n, dtype=dtype)
    return b[:n]


def _count(a: np.ndarray, op, v) -> int:
    """``count_nonzero(op(a, v))`` in cache-sized slices into a reused boolean buffer."""
    out = _scratch(np.bool_, min(a.size, _COUNT_CHUNK), "count")
    total = 0
    for i in range(0, a.size, _COUNT_CHUNK):
        c = a[i : i + _COUNT_CHUNK]
        total += int(np.count_nonzero(op(c, v, out=out[: c.size])))
    return total


def kth_largest_bits(absbits: np.ndarray, k: int, inplace: bool = False) -> tuple[int, int, int]:
    """The k-th largest of non-negative floats given as their raw bits (the bits of non-negative
    IEEE floats sort like the values): an O(n) introselect on the integer bits, no sort, no float
    compare. Returns ``(bits of v, count greater than v, count equal to v)``. ``inplace``
    partitions ``absbits`` itself (its order is lost)."""
    n = absbits.size
    part = absbits if inplace else absbits.copy()
    part.partition(n - k)
    v = part.dtype.type(part[n - k])
    # after the partition everything from n - k on is >= v and everything before it is <= v
    greater = _count(part[n - k :], np.greater, v)
    equal = _count(part, np.equal, v)
    return int(v), greater, equal


def _nth_equal(bits: np.ndarray, v, nth: int, chunk: int = 1 << 20, mask=None) -> int:
    """Flat index of the ``nth`` (1-based) element equal to ``v`` (after ``& mask`` when given),
    scanning in chunks so that no full-size index array is allocated."""
    seen = 0
    eq_buf = _scratch(np.bool_, min(bits.size, chunk), "count")
    and_buf = _scratch(bits.dtype, min(bits.size, chunk), "and")
    for i in range(0, bits.size, chunk):
        c_bits = bits[i : i + chunk]
        if mask is not None:
            c_bits = np.bitwise_and(c_bits, mask, out=and_buf[: c_bits.size])
        eq = np.equal(c_bits, v, out=eq_buf[: c_bits.size])
        c = int(np.count_nonzero(eq))
        if seen + c >= nth:
            return i + int(np.flatnonzero(eq)[nth - seen - 1])
        seen += c
    raise ValueError("fewer equal elements than requested")


@dataclass(frozen=True)
class MagnitudeCut:
    """The exact top-k selection of a flat delta as a threshold on the bits of |delta|: keep
    ``bits > v`` everywhere and ``bits == v`` below flat index ``cut`` (ties go to the lowest
    indices, as a stable descending sort does)."""

    v: int
    cut: int
    width: int

    def select(self, delta: mx.array, lo: int = 0, hi: Optional[int] = None) -> mx.array:
        """The boolean mask of ``delta[lo:hi]`` (``delta`` is the whole flat delta)."""
        hi = delta.size if hi is None else hi
        utype = mx.uint32 if self.width == 32 else mx.uint16
        sign_off = 0x7FFFFFFF if self.width == 32 else 0x7FFF

        def build(strict):
            def f(bits, v):
                a = bits & mx.array(sign_off, dtype=utype)
                return a > v if strict else a >= v
            return f

        ge = kernel(("mag_ge", self.width), lambda: build(False))
        gt = kernel(("mag_gt", self.width), lambda: build(True))
        ub, vv = delta[lo:hi].view(utype), mx.array(self.v, dtype=utype)
        if self.cut >= hi:
            return ge(ub, vv)
        if self.cut <= lo:
            return gt(ub, vv)
        c = self.cut - lo  # tied elements at the threshold are kept below flat index ``cut`` only
        return mx.concatenate([ge(ub[:c], vv), gt(ub[c:], vv)])


def magnitude_cut(delta: mx.array, density: float) -> Optional[MagnitudeCut]:
    """The threshold that keeps the top ``max(1, int(density * n))`` magnitudes of a flat delta
    (None: keep all). One O(n) select and two counting passes over the integer bits."""
    n = delta.size
    if density >= 1 or n == 0:
        return None
    if density <= 0:
        w = 32 if delta.dtype == F32 else 16
        return MagnitudeCut(v=(1 << w) - 1, cut=0, width=w)  # nothing passes ``>`` the max
    k = max(1, int(density * n))
    raw = K.raw_bits(delta)
    width = raw.dtype.itemsize * 8
    sign_off = raw.dtype.type((1 << (width - 1)) - 1)
    absbits = np.bitwise_and(raw, sign_off, out=_scratch(raw.dtype, n))
    v, greater, equal = kth_largest_bits(absbits, k, inplace=True)
    need = k - greater
    cut = n if need == equal else _nth_equal(raw, raw.dtype.type(v), need, mask=sign_off) + 1
    return MagnitudeCut(v, cut, width)


def magnitude_mask(delta: mx.array, density: float) -> Optional[mx.array]:
    """Keep the top ``max(1, int(density * n))`` elements of a flat delta by magnitude; ties at the
    threshold go to the lowest flat indices (a stable descending sort). None means keep all."""
    if density >= 1:
        return None
    if density <= 0 or delta.size == 0:
        return mx.zeros(delta.shape, dtype=mx.bool_)
    c = magnitude_cut(delta, density)
    return None if c is None else c.select(delta)


def outlier_mask(delta: mx.array, density: float, gamma: float) -> Optional[mx.array]:
    """Model breadcrumbs: in ascending stable magnitude order, drop the ``n_bot`` smallest and keep
    the next ``int(density * n)`` (so the ``gamma`` largest, when room allows, are dropped)."""
    if density >= 1:
        return None
    n = delta.size
    target = int(density * n)
    n_top = int(gamma * n)
    n_bot = max(0, n - target - n_top)
    order = np.argsort(np.abs(np.asarray(f32(delta))), kind="stable")
    mask = np.zeros(n, dtype=bool)
    mask[order[n_bot : n_bot + target]] = True
    return mx.array(mask)


def dare_seed(seed: int, tensor_name: str, model_id: str) -> int:
    """A 64-bit seed that depends only on (seed, tensor name, model): independent of the order
    tensors are processed in and of sharding. The engine's model id is the model's position in the
    config's ``models:`` list, so moving or resharding a model keeps its masks."""
    h = hashlib.sha256(f"{seed}\x00{tensor_name}\x00{model_id}".encode()).digest()
    return int.from_bytes(h[:8], "little")


def bernoulli_mask(size: int, density: float, seed: int) -> Optional[mx.array]:
    """Keep each element with probability ``density`` (uniform float32 < density, PCG64 stream
    seeded by :func:`dare_seed`; NumPy's generator is ~5x faster than MLX's threefry on CPU).

    NumPy's float32 uniform is ``(u >> 8) * 2**-24`` for the stream of 32-bit words ``u`` (the low
    then the high half of each 64-bit PCG64 output), so ``uniform < density`` is exactly
    ``u < ceil(density * 2**24) << 8``: the mask is computed from the raw 64-bit outputs with one
    integer compare, no float conversion (the same mask, bit for bit, as the float draw)."""
    if density >= 1:
        return None
    bg = np.random.PCG64(seed)
    mask = np.empty(size, dtype=bool)
    thr = np.uint32(math.ceil(float(np.float32(density)) * 2.0 ** 24) << 8)
    nraw, step = (size + 1) // 2, max(1, _RNG_CHUNK // 2)
    # drawn in chunks (the stream continues across calls) so no full-size buffer is held
    for r in range(0, nraw, step):
        u = bg.random_raw(min(step, nraw - r)).view(np.uint32)
        i = 2 * r
        j = min(size, i + u.size)
        np.less(u[: j - i], thr, out=mask[i:j])
    return mx.array(mask)


def _uniform_stream(size: int, seed: int):
    """NumPy's float32 uniforms ``(u >> 8) * 2**-24`` of the PCG64 stream seeded by ``seed``, the
    same words :func:`bernoulli_mask` compares, yielded in chunks as ``(start, stop, uniforms)``."""
    bg = np.random.PCG64(seed)
    nraw, step = (size + 1) // 2, max(1, _RNG_CHUNK // 2)
    for r in range(0, nraw, step):
        u = bg.random_raw(min(step, nraw - r)).view(np.uint32)
        i = 2 * r
        j = min(size, i + u.size)
        yield i, j, (u[: j - i] >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)


def magprune_table(n: int, density: float, epsilon: float, work) -> np.ndarray:
    """DELLA's keep probability of each rank ``1..n`` of a row of ``n`` elements (ascending
    magnitude): ``p = (density - epsilon) + norm(r) * 2 * epsilon`` with ``norm(r) = (r - min r) /
    (max r - min r)`` clipped to [0, 1], every step rounded to ``work`` as mergekit computes it.
    The ranks of a row are a permutation of ``1..n``, so one table serves every row."""
    ranks = K.rnd_host(np.arange(1, n + 1, dtype=np.float32), work)
    lo, hi = ranks[0], ranks[-1]
    span = K.rnd_host(np.asarray(hi - lo, np.float32), work)
    if span == 0:  # one element per row: mergekit divides 0 by 0
        norm = np.zeros(n, np.float32)
    else:
        norm = np.clip(K.rnd_host(K.rnd_host(ranks - lo, work) / span, work), 0, 1).astype(np.float32)
    scaled = K.rnd_host(K.rnd_host(norm * np.float32(2), work) * np.float32(epsilon), work)
    return K.rnd_host(scaled + np.float32(density - epsilon), work)


def magprune_probabilities(mag: np.ndarray, density: float, epsilon: float, work,
                           table: Optional[np.ndarray] = None) -> np.ndarray:
    """The keep probability of every element of a ``(rows, n)`` array of magnitudes (non-negative
    floats, or their raw bits as unsigned integers, which sort the same): each element's rank in its
    row (ascending, ties by position: a stable sort, a radix sort for 16-bit keys) looked up in
    :func:`magprune_table` (``table``: that table, already made)."""
    if mag.dtype.kind == "f":
        mag = mag.view(np.uint32 if mag.dtype.itemsize == 4 else np.uint16)
    if table is None:
        table = magprune_table(mag.shape[1], density, epsilon, work)
    order = np.argsort(mag, axis=1, kind="stable")
    probs = np.empty(mag.shape, dtype=np.float32)
    np.put_along_axis(probs, order, table[None, :], axis=1)
    return probs


def magprune_mask(delta: mx.array, density: float, epsilon: float, seed: int, shape: Optional[tuple],
                  work=F32) -> Optional[mx.array]:
    """DELLA's MagPrune selection of a flat delta of tensor shape ``shape`` (None: one row): keep
    each element with its rank-based probability (:func:`magprune_probabilities`; ranks along axis
    1, as mergekit does), drawn from the PCG64 stream of ``seed``. None means keep all."""
    if density >= 1:
        return None
    if density <= 0:
        return mx.zeros(delta.shape, dtype=mx.bool_)
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise UserError("della: epsilon must be chosen such that density +/- epsilon is in (0, 1) "
                        f"(density {density}, epsilon {epsilon})")
    if delta.size == 0:  # nothing to rank (and an empty array has no buffer to view)
        return mx.zeros(delta.shape, dtype=mx.bool_)
    shape = tuple(shape) if shape else (delta.size,)
    shape = (1,) + shape if len(shape) < 2 else shape
    raw = K.raw_bits(delta)
    width = raw.dtype.itemsize * 8
    mag = np.bitwise_and(raw, raw.dtype.type((1 << (width - 1)) - 1)).reshape(shape)  # |delta| as bits
    mask = np.empty(delta.size, dtype=bool)
    if len(shape) == 2:  # rows in flat order: ranked a block of rows at a time, no full-size ranks
        blocks = _row_block_probabilities(mag, density, epsilon, work)
        lo = hi = 0
        for i, j, u in _uniform_stream(delta.size, seed):
            at = i
            while at < j:
                if at >= hi:
                    lo, hi, probs = next(blocks)
                end = min(j, hi)
                np.less(u[at - i:end - i], probs[at - lo:end - lo], out=mask[at:end])
                at = end
        return mx.array(mask)
    moved = np.moveaxis(mag, 1, -1)  # mergekit ranks along dim 1
    probs = magprune_probabilities(moved.reshape(-1, shape[1]), density, epsilon, work)
    probs = np.moveaxis(probs.reshape(moved.shape), -1, 1).reshape(-1)
    for i, j, u in _uniform_stream(delta.size, seed):
        np.less(u, probs[i:j], out=mask[i:j])
    return mx.array(mask)


#: elements whose ranks :func:`magprune_mask` computes at once (the sort's int64 order: 8 MiB)
_RANK_BLOCK = 1 << 20


def _row_block_probabilities(mag: np.ndarray, density: float, epsilon: float, work):
    """:func:`magprune_probabilities` of a 2-D array, blocks of whole rows at a time, as
    ``(flat start, flat stop, probabilities)`` in order."""
    rows, n = mag.shape
    table = magprune_table(n, density, epsilon, work)
    step = max(1, _RANK_BLOCK // max(1, n))
    for r in range(0, rows, step):
        r1 = min(rows, r + step)
        yield r * n, r1 * n, magprune_probabilities(mag[r:r1], density, epsilon, work, table).reshape(-1)


#: words per draw: 2 MiB of raw words stay in L2 (4x the chunk was 2x slower per element)
_RNG_CHUNK = 1 << 18


def select_slice(sel, delta: mx.array, lo: int, hi: int) -> Optional[mx.array]:
    """The boolean mask of ``delta[lo:hi]`` for a selection ``sel``: None (keep all), a
    :class:`MagnitudeCut` or a full boolean mask."""
    if isinstance(sel, MagnitudeCut):
        return sel.select(delta, lo, hi)
    return None if sel is None else sel[lo:hi]


#: elements per row of the L1 norms' float32 partial sums
_L1_ROW = 1024


def _l1_abs(d: mx.array, m: mx.array) -> tuple[mx.array, mx.array]:
    a = mx.abs(d)
    return a, a * m


def _row_sums(a: mx.array, b: mx.array) -> tuple[float, float]:
    """Sums of two ``(rows, width)`` float32 arrays: per row in float32 (a BLAS matrix-vector
    product), across rows in float64."""
    ones = mx.ones((a.shape[1],), dtype=F32)
    a, b = a @ ones, b @ ones
    mx.eval(a, b)
    return (float(np.frombuffer(memoryview(a), dtype=np.float32).sum(dtype=np.float64)),
            float(np.frombuffer(memoryview(b), dtype=np.float32).sum(dtype=np.float64)))


def l1_norms(delta: mx.array, sel) -> tuple[float, float]:
    """``(|delta|_1, |delta * mask|_1)`` for a selection ``sel`` (a :class:`MagnitudeCut` or a boolean
    mask), in slices of ``CHUNK``: no full-size temporary.

    The norms are summed in float32 over rows of 1024 elements (short rows keep float32
    accumulation exact to ~1e-7, which a float32 sum over millions of elements is not), and the row
    sums in float64. torch sums in float32 in its own order, so a norm can differ from mergekit's in
    the last float32 bit (after rounding to bf16, essentially never)."""
    k = kernel(("l1abs",), lambda: (lambda d, m: _l1_abs(f32(d), m)))  # |d| and |d| * mask, fused
    before = after = 0.0
    for lo, hi in K.slices(delta.size):
        m = select_slice(sel, delta, lo, hi)
        full = lo + (hi - lo) // _L1_ROW * _L1_ROW
        for a0, a1, width in ((lo, full, _L1_ROW), (full, hi, hi - full)):  # whole rows, then the tail
            if a1 <= a0:
                continue
            mm = m[a0 - lo : a1 - lo]
            da, db = _row_sums(*k(delta[a0:a1].reshape(-1, width), mm.reshape(-1, width)))
            before += da
            after += db
    return before, after


def rescale_factor(delta: mx.array, sel, mode: str, density: float, cd, eps: float = 1e-7) -> Optional[float]:
    """The factor that scales the masked delta back up (None: leave it unscaled): ``l1`` matches
    the L1 norm of the unmasked delta (mergekit; norms and ratio rounded to ``cd`` as torch does,
    :func:`l1_norms`), ``inverse_density`` is ``1 / density``."""
    if mode == "inverse_density":
        return 1.0 / density
    before, after = l1_norms(delta, sel)
    before_r, after_r = rnd(scalar(before), cd), rnd(scalar(after), cd)
    if before_r.item() < eps or after_r.item() < eps:
        return None
    return float(rnd(before_r / after_r, cd).item())


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class Sparsifier:
    """One way to sparsify a task vector: ``select(delta, density, seed, gamma, epsilon, shape, cd)``
    returns None (keep all), a :class:`MagnitudeCut` or a boolean mask; the rescale factor is
    rounded to ``rescale_dtype(cd)``."""

    name: str
    select: Callable[..., object]
    rescale_dtype: Callable[[object], object] = lambda cd: cd


def _dare_dtype(cd):
    # DARE's rescale works in float32 for float16 (torch has no fp16 bernoulli on CPU)
    return F32 if cd == mx.float16 else cd


SPARSIFIERS: dict[str, Sparsifier] = {
    "magnitude": Sparsifier("magnitude", lambda d, density, seed, gamma, *_: magnitude_cut(d, density)),
    "random": Sparsifier("random", lambda d, density, seed, gamma, *_: bernoulli_mask(d.size, density, seed),
                         rescale_dtype=_dare_dtype),
    "outliers": Sparsifier("outliers", lambda d, density, seed, gamma, *_: outlier_mask(d, density, gamma)),
    # mergekit works in bf16 for bf16 and in float32 otherwise, as for DARE
    "magprune": Sparsifier("magprune", lambda d, density, seed, gamma, epsilon, shape, cd:
                           magprune_mask(d, density, epsilon, seed, shape, _dare_dtype(cd)),
                           rescale_dtype=_dare_dtype),
}
