"""Merge methods as pure functions over MLX arrays (one tensor at a time).

Inputs are flat arrays of any float dtype; they are aligned to a *compute dtype* ``cd``
(``float32``, ``bfloat16`` or ``float16``: mergekit's ``dtype``, else the widest input dtype).
Arithmetic runs in float32 inside fused ``mx.compile`` kernels, and every intermediate that
mergekit 0.1.5 materialises in the compute dtype is rounded to it (:func:`rnd`). torch computes each
bf16 op in float32 and rounds the result, so this reproduces mergekit's bf16 arithmetic: the tests
find bit-identical outputs for every deterministic method in float32 (up to 1e-6) and bfloat16.
Linear accumulates like torch's ``addcmul_`` (one rounding per multiply-add).

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
- DARE masks come from a PCG64 stream seeded by a hash of (seed, tensor name, model), not from a
  process-global generator, so the output does not depend on tensor order or sharding; the kept
  elements therefore differ from mergekit's (the distribution is the same).
- Ties among exactly equal magnitudes at the TIES threshold keep the lowest flat indices; torch's
  CPU sort is unstable, so mergekit's pick among exact ties is implementation-defined (with a
  stable sort patched in, mergekit and this module agree bit for bit, bf16 included).
"""

from __future__ import annotations

import hashlib
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


def _kernel(key, build):
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = mx.compile(build(), shapeless=True)
    return k


def _scalar(v: float) -> mx.array:
    return mx.array(v, dtype=F32)


# ---------------------------------------------------------------- sparsification masks


def kth_largest_bits(absbits: np.ndarray, k: int) -> tuple[int, int, int]:
    """The k-th largest of non-negative floats given as their raw bits (the bits of non-negative
    IEEE floats sort like the values): an O(n) introselect on the integer bits, no sort, no float
    compare. Returns ``(bits of v, count greater than v, count equal to v)``."""
    n = absbits.size
    v = absbits.dtype.type(np.partition(absbits, n - k)[n - k])
    greater = int(np.count_nonzero(absbits > v))
    equal = int(np.count_nonzero(absbits == v))
    return int(v), greater, equal


def _abs_bits(delta: mx.array) -> tuple[np.ndarray, int]:
    """Raw bits of |delta| (sign bit cleared) as a numpy array, and the bit width. The bits are
    taken through the buffer protocol (zero copy; ``np.asarray`` of an ``mx.view`` copies)."""
    mx.eval(delta)
    raw = memoryview(delta).cast("B")
    if delta.dtype == F32:
        return np.frombuffer(raw, dtype=np.uint32) & np.uint32(0x7FFFFFFF), 32
    return np.frombuffer(raw, dtype=np.uint16) & np.uint16(0x7FFF), 16


def _nth_equal(bits: np.ndarray, v, nth: int, chunk: int = 1 << 22) -> int:
    """Flat index of the ``nth`` (1-based) element equal to ``v``, scanning in chunks so that no
    full-size index array is allocated."""
    seen = 0
    for i in range(0, bits.size, chunk):
        eq = bits[i : i + chunk] == v
        c = int(np.count_nonzero(eq))
        if seen + c >= nth:
            return i + int(np.flatnonzero(eq)[nth - seen - 1])
        seen += c
    raise ValueError("fewer equal elements than requested")


def magnitude_mask(delta: mx.array, density: float) -> Optional[mx.array]:
    """Keep the top ``max(1, int(density * n))`` elements of a flat delta by magnitude; ties at the
    threshold go to the lowest flat indices (a stable descending sort). None means keep all."""
    n = delta.size
    if density >= 1:
        return None
    if density <= 0 or n == 0:
        return mx.zeros(delta.shape, dtype=mx.bool_)
    k = max(1, int(density * n))
    bits, width = _abs_bits(delta)
    v, greater, equal = kth_largest_bits(bits, k)
    need = k - greater
    utype = mx.uint32 if width == 32 else mx.uint16
    if need == equal:
        cut = n  # every tied element is kept
    else:
        cut = _nth_equal(bits, v, need) + 1  # keep tied elements with index < cut
    sign_off = 0x7FFFFFFF if width == 32 else 0x7FFF

    def build(strict):
        def f(bits, v):
            a = bits & mx.array(sign_off, dtype=utype)
            return a > v if strict else a >= v
        return f

    ge = _kernel(("mag_ge", width), lambda: build(False))
    gt = _kernel(("mag_gt", width), lambda: build(True))
    ub, vv = delta.view(utype), mx.array(v, dtype=utype)
    if cut >= n:
        return ge(ub, vv)
    # tied elements at the threshold are kept below flat index ``cut`` only
    return mx.concatenate([ge(ub[:cut], vv), gt(ub[cut:], vv)])


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
    seeded by :func:`dare_seed`; NumPy's generator is ~5x faster than MLX's threefry on CPU)."""
    if density >= 1:
        return None
    g = np.random.Generator(np.random.PCG64(seed))
    mask = np.empty(size, dtype=bool)
    p = np.float32(density)
    # drawn in chunks (the stream continues across calls) so no full-size float buffer is held
    for i in range(0, size, _RNG_CHUNK):
        j = min(size, i + _RNG_CHUNK)
        np.less(g.random(j - i, dtype=np.float32), p, out=mask[i:j])
    return mx.array(mask)


_RNG_CHUNK = 1 << 22


def rescale(delta: mx.array, mask: mx.array, mode: str, density: float, cd, eps: float = 1e-7) -> mx.array:
    """Masked delta scaled back up: ``l1`` matches the L1 norm of the unmasked delta (mergekit;
    norms and ratio rounded to ``cd`` as torch does), ``inverse_density`` divides by density.
    Returns float32 values representable in ``cd``."""
    md = _kernel(("mask", str(delta.dtype)), lambda: (lambda d, m: (_f(d) * m).astype(d.dtype)))(delta, mask)
    if mode == "inverse_density":
        return _kernel(("scale", str(cd)), lambda: (lambda x, s: rnd(_f(x) * s, cd)))(md, _scalar(1.0 / density))
    before = rnd(mx.sum(mx.abs(_f(delta))), cd)
    after = rnd(mx.sum(mx.abs(_f(md))), cd)
    if before.item() < eps or after.item() < eps:
        return _f(md)
    ratio = rnd(before / after, cd)
    return _kernel(("scale", str(cd)), lambda: (lambda x, s: rnd(_f(x) * s, cd)))(md, ratio)


# ---------------------------------------------------------------- methods


def linear(tensors: Sequence, weights: Sequence[float], normalize: bool, cd, out=None) -> mx.array:
    """Weighted sum in float32, divided by the weight sum when ``normalize``; rounded to ``cd``
    (then cast to ``out``, default ``cd``). ``tensors`` may be arrays or zero-argument loaders."""
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
    den = float(sum(weights)) if normalize else 1.0
    ws = [mx.array(float(np.float32(w)), dtype=F64) for w in weights]
    return k(xs, ws, _scalar(den))


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
) -> mx.array:
    """The generalized task-arithmetic merge (task_arithmetic, ties, dare_*, breadcrumbs*).

    ``base`` and ``tensors`` are flat arrays (or zero-argument loaders) of any float dtype; they
    are cast to ``cd`` first, as mergekit aligns inputs to the compute dtype. Returns ``out``
    (default ``cd``)."""
    out = out or cd
    base = base.astype(cd)
    if not tensors:
        return base.astype(out)
    # DARE's rescale works in float32 for float16 (torch has no fp16 bernoulli on CPU)
    work = F32 if cd == mx.float16 else cd
    w = [float(rnd(_scalar(x), cd).item()) for x in weights]
    delta_k = _kernel(("delta", str(cd)), lambda: (lambda x, b: (_f(x) - _f(b)).astype(cd)))
    wmul_k = _kernel(("wmul", str(cd)), lambda: (lambda d, m, w: (_f(d) * m * w).astype(cd)))
    wmul0_k = _kernel(("wmul0", str(cd)), lambda: (lambda d, w: (_f(d) * w).astype(cd)))
    wd, raw = [], []
    for i, x in enumerate(tensors):
        x = x() if callable(x) else x  # a loader: read one model's tensor only when needed
        d = delta_k(x.astype(cd), base)
        del x
        m = None
        if sparsify == "magnitude":
            m, q = magnitude_mask(d, densities[i]), cd
        elif sparsify == "random":
            m, q = bernoulli_mask(d.size, densities[i], seeds[i]), work
        elif sparsify == "outliers":
            m, q = outlier_mask(d, densities[i], gammas[i]), cd
        if m is not None and rescale_on:
            d = rescale(d, m, rescale_mode, densities[i], q).astype(cd)
            m = None
        if consensus and sign_vote == "unweighted":
            r = d if m is None else (_f(d) * m).astype(cd)
            mx.eval(r)
            raw.append(r)
        if m is None:
            wdi = wmul0_k(d, _scalar(w[i]))
        else:
            wdi = wmul_k(d, m, _scalar(w[i]))
        mx.eval(wdi)
        wd.append(wdi)
        del d, m
    n = len(wd)
    vote = raw if sign_vote == "unweighted" else wd

    def build():
        def f(base, wd, vote, ws, div_scalar, lam):
            if consensus:
                # Written so that no float32 intermediate has two consumers: mx.compile materialises
                # multi-use nodes as full arrays, which would cost ~10 float32 copies of the tensor.
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
                pos = s >= 0  # a bool: cheap to share
                mixed, div = None, None
                for x, wi in zip(wd, ws):
                    a = ((x > 0) & pos) | ((x < 0) & ~pos)  # a zero delta never agrees
                    xa = _f(x * a)  # exact in cd: a is 0 or 1
                    mixed = xa if mixed is None else mixed + xa
                    div = wi * a if div is None else div + wi * a
                mixed = rnd(mixed, cd)
                div = div.astype(cd)
                div = _f(div) + (div == 0)
            else:
                mixed = _f(wd[0])
                for x in wd[1:]:
                    mixed = mixed + _f(x)
                mixed = rnd(mixed, cd)
                div = div_scalar
            if normalize:
                mixed = rnd(mixed / div, cd)
            if lam_on:
                mixed = rnd(mixed * lam, cd)
            return (_f(base) + mixed).astype(cd).astype(out)
        return f

    lam_on = lam != 1
    k = _kernel(("combine", n, str(cd), str(out), consensus, sign_vote, normalize, lam_on), build)
    dv = float(rnd(_scalar(sum(w)), cd).item())
    dv = 1.0 if abs(dv) < 1e-8 else dv
    return k(base, wd, vote, [_scalar(x) for x in w], _scalar(dv), _scalar(lam))


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

