"""Merge methods as pure functions over MLX arrays (one tensor at a time).

Inputs are flat arrays of any float dtype; they are aligned to a *compute dtype* ``cd``
(``float32``, ``bfloat16`` or ``float16``: mergekit's ``dtype``, else the widest input dtype).
Arithmetic runs in float32 inside fused ``mx.compile`` kernels, and every intermediate that
mergekit 0.1.5 materialises in the compute dtype is rounded to it (:func:`rnd`). torch computes each
bf16 op in float32 and rounds the result, so this reproduces mergekit's bf16 arithmetic: the tests
find bit-identical outputs for every deterministic method in float32 (up to 1e-6) and bfloat16.
Linear accumulates like torch's ``addcmul_`` (one rounding per multiply-add). Whole-tensor steps
(delta, top-k threshold, DARE mask, L1 norms) see the full tensor; the elementwise rest runs in
slices of :data:`CHUNK` elements, which changes no value and avoids full-size float32 temporaries.

Methods (mergekit names; the registry :data:`METHODS` maps each name to its recipe):

- ``linear`` (Wortsman et al. 2022, model soups): sum of ``w_i * x_i`` in float32, divided by
  ``sum w_i`` when ``normalize`` (default true).
- ``task_arithmetic`` (Ilharco et al. 2023): ``base + lambda * sum w_i * (x_i - base)``, divided by
  ``sum w_i`` when ``normalize`` (default false).
- ``ties`` (Yadav et al. 2023, section 3): trim each delta to its top-k magnitudes (k =
  ``max(1, int(density * numel))``, ties at the threshold go to the lower flat index, as a stable
  descending sort does), elect a sign per element by the sign of the *weighted* sum of trimmed
  deltas (``>= 0`` counts as positive), keep the deltas that agree, and divide their weighted sum by
  the sum of the agreeing weights (a zero divisor becomes 1). ``normalize`` default true.
- ``dare_linear`` / ``dare_ties`` (Yu et al. 2024, section 3): drop each delta element with
  probability ``1 - density`` and, when ``rescale`` (default true), scale the survivors so the
  delta's L1 norm is unchanged; then linear or TIES combination. ``normalize`` default false.
- ``breadcrumbs`` / ``breadcrumbs_ties`` (Davari & Belilovsky 2023): drop the ``gamma`` fraction of
  largest magnitudes and the smallest ones, keeping ``density``.

Deviations (each an explicit option; the defaults are mergekit 0.1.5's):

- ``sign_vote``: ``weighted`` (mergekit) | ``unweighted`` (the TIES paper: sign of the sum of the
  trimmed, unweighted task vectors) | ``count`` (majority of signs, mergekit's ``count``).
- ``rescale_mode``: ``l1`` (mergekit: match the L1 norm of the delta) | ``inverse_density`` (the
  DARE paper: multiply survivors by ``1 / density``).
- DARE's L1 norms are summed in float32 over rows of 1024 elements and in float64 across rows
  (torch's float32 cascade sum is about as accurate; a plain float32 sum over tens of millions of
  elements is not).
- DARE masks come from a PCG64 stream seeded by a hash of (seed, tensor name, model), not from a
  process-global generator, so the output does not depend on tensor order or sharding; the kept
  elements therefore differ from mergekit's (the distribution is the same).
- Ties among exactly equal magnitudes at the TIES threshold keep the lowest flat indices; torch's
  CPU sort is unstable, so mergekit's pick among exact ties is implementation-defined (with a
  stable sort patched in, mergekit and this module agree bit for bit, bf16 included).
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

F32 = mx.float32
F64 = mx.float64
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def rnd(x: mx.array, cd) -> mx.array:
    """Round a float32 array to the compute dtype ``cd`` and back (identity for float32)."""
    if cd == F32:
        return x
    return x.astype(cd).astype(F32)


def _f(x: mx.array) -> mx.array:
    return x if x.dtype == F32 else x.astype(F32)


# Elementwise steps are fused with mx.compile (shapeless: one compiled kernel per step kind, reused
# for every tensor length); scalars travel as 0-d arrays so new weights do not recompile.
_KERNELS: dict = {}
_KERNELS_LOCK = threading.Lock()


def _kernel(key, build):
    k = _KERNELS.get(key)
    if k is None:
        with _KERNELS_LOCK:  # merging threads: one compiled function per key
            k = _KERNELS.get(key)
            if k is None:
                k = _KERNELS[key] = mx.compile(build(), shapeless=True)
    return k


def _scalar(v: float) -> mx.array:
    return mx.array(v, dtype=F32)


# ---------------------------------------------------------------- sparsification masks


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


def _raw_bits(delta: mx.array) -> tuple[np.ndarray, int]:
    """Raw bits of a flat float array as a zero-copy numpy view (through the buffer protocol;
    ``np.asarray`` of an ``mx.view`` copies), and the bit width."""
    mx.eval(delta)
    raw = memoryview(delta).cast("B")
    if delta.dtype == F32:
        return np.frombuffer(raw, dtype=np.uint32), 32
    return np.frombuffer(raw, dtype=np.uint16), 16


def _abs_bits(delta: mx.array) -> tuple[np.ndarray, int]:
    """Raw bits of |delta| (sign bit cleared) as a new numpy array, and the bit width."""
    raw, width = _raw_bits(delta)
    return raw & raw.dtype.type((1 << (width - 1)) - 1), width


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

        ge = _kernel(("mag_ge", self.width), lambda: build(False))
        gt = _kernel(("mag_gt", self.width), lambda: build(True))
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
    raw, width = _raw_bits(delta)
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
    order = np.argsort(np.abs(np.asarray(_f(delta))), kind="stable")
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


#: words per draw: 2 MiB of raw words stay in L2 (4x the chunk was 2x slower per element)
_RNG_CHUNK = 1 << 18


def rescale_factor(delta: mx.array, sel, mode: str, density: float, cd, eps: float = 1e-7) -> Optional[float]:
    """The factor that scales the masked delta back up (None: leave it unscaled): ``l1`` matches
    the L1 norm of the unmasked delta (mergekit; norms and ratio rounded to ``cd`` as torch does),
    ``inverse_density`` is ``1 / density``. ``sel`` is a :class:`MagnitudeCut` or a boolean mask.

    The two L1 norms are summed in float32 over rows of 1024 elements (a BLAS matrix-vector
    product per slice; short rows keep float32 accumulation exact to ~1e-7, which a float32 sum
    over millions of elements is not), and the row sums in float64: no full-size temporary. torch sums in float32 in its own order, so a norm can differ
    from mergekit's in the last float32 bit (after rounding to bf16, essentially never)."""
    if mode == "inverse_density":
        return 1.0 / density
    # |d| and |d| * mask in one kernel, their row sums over _L1_ROW elements as float32
    # matrix-vector products (BLAS: vectorised, ~1e-7 relative error per row), then float64
    k = _kernel(("l1abs",), lambda: (lambda d, m: _l1_abs(_f(d), m)))
    before = after = 0.0
    for lo in range(0, delta.size, CHUNK):
        hi = min(delta.size, lo + CHUNK)
        m = sel.select(delta, lo, hi) if isinstance(sel, MagnitudeCut) else sel[lo:hi]
        full = lo + (hi - lo) // _L1_ROW * _L1_ROW
        pieces = [(lo, full, _L1_ROW), (full, hi, hi - full)]
        for a0, a1, width in pieces:
            if a1 <= a0:
                continue
            mm = m[a0 - lo : a1 - lo]
            a, b = k(delta[a0:a1].reshape(-1, width), mm.reshape(-1, width))
            ones = mx.ones((width,), dtype=F32)
            a, b = a @ ones, b @ ones
            mx.eval(a, b)
            before += float(np.frombuffer(memoryview(a), dtype=np.float32).sum(dtype=np.float64))
            after += float(np.frombuffer(memoryview(b), dtype=np.float32).sum(dtype=np.float64))
    before_r, after_r = rnd(_scalar(before), cd), rnd(_scalar(after), cd)
    if before_r.item() < eps or after_r.item() < eps:
        return None
    return float(rnd(before_r / after_r, cd).item())


_L1_ROW = 1024


def _l1_abs(d: mx.array, m: mx.array) -> tuple[mx.array, mx.array]:
    a = mx.abs(d)
    return a, a * m


def rescale(delta: mx.array, mask: mx.array, mode: str, density: float, cd, eps: float = 1e-7) -> mx.array:
    """Masked delta scaled back up by :func:`rescale_factor`; float32 values representable in
    ``cd``."""
    md = _f(delta) * mask
    s = rescale_factor(delta, mask, mode, density, cd, eps)
    return md if s is None else rnd(md * s, cd)


# ---------------------------------------------------------------- methods


def linear(tensors: Sequence, weights: Sequence[float], normalize: bool, cd, out=None, as_parts: bool = False):
    """Weighted sum in float32, divided by the weight sum when ``normalize``; rounded to ``cd``
    (then cast to ``out``, default ``cd``). ``tensors`` may be arrays or zero-argument loaders.
    ``as_parts``: return the flat result as a list of consecutive evaluated slices (a writer can
    store them one after the other, saving a full-size concatenation)."""
    xs = [x() if callable(x) else x for x in tensors]
    n = len(xs)
    cdn, outn = str(cd), str(out or cd)

    def build():
        def f(xs, ws, den):
            # inputs are aligned to cd first, as mergekit does; each step is one fused multiply-add
            # rounded to float32 (float64 holds the float32 product exactly), like torch's addcmul_
            acc = None
            for x, w in zip(xs, ws):
                t = _f(x.astype(cd)).astype(F64) * w
                acc = t.astype(F32) if acc is None else (acc.astype(F64) + t).astype(F32)
            return (acc / den).astype(cd).astype(out or cd)
        return f

    k = _kernel(("linear", n, cdn, outn), build)
    den = _scalar(float(sum(weights)) if normalize else 1.0)
    ws = [mx.array(float(np.float32(w)), dtype=F64) for w in weights]
    size = xs[0].size
    if size <= CHUNK:
        res = k(xs, ws, den)
        return [res] if as_parts else res
    mx.eval(*xs)
    parts = []
    for lo in range(0, size, CHUNK):  # in slices: no full-size float temporaries (see task_vector_merge)
        part = k([x[lo : lo + CHUNK] for x in xs], ws, den)
        mx.eval(part)
        parts.append(part)
    return parts if as_parts else mx.concatenate(parts)


def task_vector_merge(
    base: mx.array,
    tensors: Sequence,
    weights: Sequence[float],
    densities: Sequence[float],
    *,
    sparsify: Optional[str],
    consensus: bool,
    normalize: bool,
    rescale_on: bool,
    lam: float,
    cd,
    sign_vote: str = "weighted",
    rescale_mode: str = "l1",
    seeds: Optional[Sequence[int]] = None,
    gammas: Optional[Sequence[float]] = None,
    out=None,
    as_parts: bool = False,
):
    """The generalized task-arithmetic merge (task_arithmetic, ties, dare_*, breadcrumbs*).

    ``base`` and ``tensors`` are flat arrays (or zero-argument loaders) of any float dtype; they
    are cast to ``cd`` first, as mergekit aligns inputs to the compute dtype. Returns ``out``
    (default ``cd``), or with ``as_parts`` a list of consecutive slices of it (see :func:`linear`)."""
    out = out or cd
    base = base.astype(cd)
    if not tensors:
        return [base.astype(out)] if as_parts else base.astype(out)
    # DARE's rescale works in float32 for float16 (torch has no fp16 bernoulli on CPU)
    work = F32 if cd == mx.float16 else cd
    w = [float(rnd(_scalar(x), cd).item()) for x in weights]
    delta_k = _kernel(("delta", str(cd)), lambda: (lambda x, b: (_f(x) - _f(b)).astype(cd)))
    # weighted deltas leave their kernels as float32 holding cd-rounded values: the vote reads
    # each of them several times, and a bf16 input would need a separate cast pass per read
    wmul_k = _kernel(("wmul", str(cd)), lambda: (lambda d, m, w: rnd(_f(d) * m * w, cd)))
    wmul0_k = _kernel(("wmul0", str(cd)), lambda: (lambda d, w: rnd(_f(d) * w, cd)))
    # Per model, the whole-tensor steps: the delta, its selection (top-k threshold, DARE or
    # breadcrumbs mask) and the L1 rescale. The elementwise tail (mask, weight, vote, combine) then
    # runs in slices of CHUNK elements, so no full-size float32 temporary is ever allocated (large
    # fresh buffers cost page faults on every tensor) and each slice stays in cache.
    ds, sels, factors = [], [], []
    for i, x in enumerate(tensors):
        x = x() if callable(x) else x  # a loader: read one model's tensor only when needed
        d = delta_k(x.astype(cd), base)
        mx.eval(d)
        del x
        sel, q = None, cd  # None (keep all), a MagnitudeCut, or a full boolean mask; q: rescale dtype
        if sparsify == "magnitude":
            sel, q = magnitude_cut(d, densities[i]), cd
        elif sparsify == "random":
            sel, q = bernoulli_mask(d.size, densities[i], seeds[i]), work
        elif sparsify == "outliers":
            sel, q = outlier_mask(d, densities[i], gammas[i]), cd
        factor = None
        if sel is not None and rescale_on:
            factor = rescale_factor(d, sel, rescale_mode, densities[i], q)
        ds.append(d)
        sels.append(sel)
        factors.append(factor)
    n = len(ds)
    ws = [_scalar(x) for x in w]

    # TIES combine in two kernels, split where mergekit rounds to cd anyway (mixed and divisor):
    # shallow kernels fuse well, and the sign agreement is a float multiply (``x * sg > 0``)
    # rather than boolean logic, which the CPU compiler handles slowly. Exactly the same values:
    # x * sg is exact, and x * a (a in {0, 1}) keeps x's signed zero as the bf16 product did.
    def build_vote():
        def f(wd, vote, ws):
            if sign_vote == "count":
                s = mx.sign(_f(vote[0]))
                for v in vote[1:]:
                    s = s + mx.sign(_f(v))
            else:
                s = _f(vote[0])
                for v in vote[1:]:
                    s = s + _f(v)
                if cd == mx.float16:  # bf16 rounding never changes a sign; fp16 can underflow to 0
                    s = s.astype(cd)
            sg = mx.where(s >= 0, 1.0, -1.0)  # +1 / -1: one select instead of a cast, a multiply and a subtract
            mixed, div = None, None
            for x, wi in zip(wd, ws):
                x = _f(x)
                a = ((x * sg) > 0).astype(F32)  # a zero delta never agrees
                mixed = x * a if mixed is None else mixed + x * a
                div = wi * a if div is None else div + wi * a
            return mixed.astype(cd), div.astype(cd)
        return f

    def build_apply():
        def f(base, mixed, div, lam):
            mixed = _f(mixed)
            if normalize:
                d = _f(div)
                mixed = rnd(mixed / (d + (d == 0)), cd)  # a zero divisor becomes 1
            if lam_on:
                mixed = rnd(mixed * lam, cd)
            return (_f(base) + mixed).astype(cd).astype(out)
        return f

    def build():
        def f(base, wd, vote, ws, div_scalar, lam):
            mixed = _f(wd[0])
            for x in wd[1:]:
                mixed = mixed + _f(x)
            mixed = rnd(mixed, cd)
            if normalize:
                mixed = rnd(mixed / div_scalar, cd)
            if lam_on:
                mixed = rnd(mixed * lam, cd)
            return (_f(base) + mixed).astype(cd).astype(out)
        return f

    lam_on = lam != 1
    k = _kernel(("combine", n, str(cd), str(out), normalize, lam_on), build)
    k1 = _kernel(("vote", n, str(cd), sign_vote), build_vote)
    k2 = _kernel(("apply", str(cd), str(out), normalize, lam_on), build_apply)
    dv = float(rnd(_scalar(sum(w)), cd).item())
    dv = 1.0 if abs(dv) < 1e-8 else dv
    dvs, lams = _scalar(dv), _scalar(lam)
    mx.eval(base)
    parts = []
    for lo in range(0, base.size, CHUNK):
        hi = min(base.size, lo + CHUNK)
        wd, raw = [], []
        for d, sel, factor, wi in zip(ds, sels, factors, ws):
            dc = d[lo:hi]
            m = sel.select(d, lo, hi) if isinstance(sel, MagnitudeCut) else (None if sel is None else sel[lo:hi])
            if factor is not None:
                # the rescaled masked delta, rounded to the rescale dtype then cd, then weighted, as
                # mergekit does; the rescale dtype is cd or float32, so that is one rounding to cd,
                # written as one cast so mx.compile fuses the kernel whole (graphs deeper than its
                # limit are cut, and the cut-off input casts run as separate full passes)
                fs = _scalar(factor)
                if consensus and sign_vote == "unweighted":
                    raw.append(_kernel(("rescaled", str(cd)),
                                       lambda: (lambda d, m, s: rnd(_f(d) * m * s, cd)))(dc, m, fs))
                wd.append(_kernel(("wrescaled", str(cd)),
                                  lambda: (lambda d, m, s, w: rnd(rnd(_f(d) * m * s, cd) * w, cd)))(dc, m, fs, wi))
                continue
            if consensus and sign_vote == "unweighted":
                raw.append(dc if m is None else rnd(_f(dc) * m, cd))
            wd.append(wmul0_k(dc, wi) if m is None else wmul_k(dc, m, wi))
        vote = raw if sign_vote == "unweighted" else wd
        if consensus:
            mixed, div = k1(wd, vote, ws)
            part = k2(base[lo:hi], mixed, div, lams)
        else:
            part = k(base[lo:hi], wd, vote, ws, dvs, lams)
        mx.eval(part)
        parts.append(part)
    if not parts:  # an empty tensor
        parts = [base.astype(out)]
    if as_parts:
        return parts
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


#: elements per slice of the elementwise steps (float32 temporaries of 1 MiB, so that a slice's
#: inputs, temporaries and outputs stay in a 2-4 MiB L2 cache: measured ~5% faster than 1 << 20)
CHUNK = 1 << 18


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class MethodSpec:
    """A merge method's recipe and its parameter defaults (mergekit 0.1.5)."""

    name: str
    needs_base: bool
    sparsify: Optional[str] = None  # magnitude | random | outliers
    consensus: bool = False
    default_normalize: bool = False
    default_rescale: bool = False
    #: per-model parameters (weight, density, gamma) and shared ones
    model_params: tuple[str, ...] = ("weight", "density")
    shared_params: tuple[str, ...] = ("normalize", "rescale", "lambda", "int8_mask", "sign_vote", "rescale_mode")
    defaults: tuple[tuple[str, object], ...] = (("density", 1.0), ("lambda", 1.0), ("int8_mask", False),
                                                ("sign_vote", "weighted"), ("rescale_mode", "l1"))


METHODS: dict[str, MethodSpec] = {
    "linear": MethodSpec("linear", needs_base=False, default_normalize=True, model_params=("weight",),
                         shared_params=("normalize",), defaults=()),
    "task_arithmetic": MethodSpec("task_arithmetic", needs_base=True),
    "ties": MethodSpec("ties", needs_base=True, sparsify="magnitude", consensus=True, default_normalize=True),
    "dare_linear": MethodSpec("dare_linear", needs_base=True, sparsify="random", default_rescale=True),
    "dare_ties": MethodSpec("dare_ties", needs_base=True, sparsify="random", consensus=True, default_rescale=True),
    "breadcrumbs": MethodSpec("breadcrumbs", needs_base=True, sparsify="outliers",
                              model_params=("weight", "density", "gamma"),
                              defaults=(("density", 1.0), ("gamma", 0.01), ("lambda", 1.0), ("int8_mask", False),
                                        ("sign_vote", "weighted"), ("rescale_mode", "l1"))),
    "breadcrumbs_ties": MethodSpec("breadcrumbs_ties", needs_base=True, sparsify="outliers", consensus=True,
                                   model_params=("weight", "density", "gamma"),
                                   defaults=(("density", 1.0), ("gamma", 0.01), ("lambda", 1.0),
                                             ("int8_mask", False), ("sign_vote", "weighted"),
                                             ("rescale_mode", "l1"))),
}

SIGN_VOTES = ("weighted", "unweighted", "count")
RESCALE_MODES = ("l1", "inverse_density")

