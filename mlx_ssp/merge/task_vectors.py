"""``linear`` and the task-vector merges as pure functions over MLX arrays (one tensor at a time).

Inputs are flat arrays of any float dtype; they are aligned to a *compute dtype* ``cd``
(``float32``, ``bfloat16`` or ``float16``: mergekit's ``dtype``, else the widest input dtype).
Arithmetic runs in float32 inside fused ``mx.compile`` kernels, and every intermediate that
mergekit 0.1.5 materialises in the compute dtype is rounded to it (:func:`.kernels.rnd`). torch
computes each bf16 op in float32 and rounds the result, so this reproduces mergekit's bf16
arithmetic: the tests find bit-identical outputs for every deterministic method in float32 (up to
1e-6) and bfloat16. Linear accumulates like torch's ``addcmul_`` (one rounding per multiply-add).
Whole-tensor steps (delta, top-k threshold, DARE mask, L1 norms) see the full tensor; the
elementwise rest runs in slices of :data:`.kernels.CHUNK` elements, which changes no value and
avoids full-size float32 temporaries.

A task-vector method is the algorithm's own steps, each a small function here or in
:mod:`.sparsify`: task vectors (:func:`task_vector`) -> sparsify (:data:`.sparsify.SPARSIFIERS`:
magnitude trim, DARE drop, breadcrumbs; optional rescale) -> weight (:func:`weighted_slice`) ->
sign consensus (:func:`elect_sign`, :func:`agreeing_sum`) or plain sum (:func:`weighted_sum`) ->
normalise (:func:`normalize_by`) -> scale by lambda and add back to the base (:func:`add_back`).

Methods (mergekit names; the registry :data:`.methods.METHODS` maps each name to its recipe; a
method's parameters for one tensor are one :class:`.params.LinearParams` or
:class:`.params.TaskVectorParams`):

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
- ``della`` / ``della_linear`` (Deep et al. 2024, section 3): MagPrune (:mod:`.sparsify`: keep
  probabilities from magnitude ranks per row, ``density +- epsilon``, per-model ``epsilon`` default
  0.15), L1 rescale (``rescale`` default true), then TIES consensus (``della``, ``normalize`` default
  true) or the plain sum (``della_linear``, ``normalize`` default false).

Deviations (each an explicit option; the defaults are mergekit 0.1.5's):

- ``sign_vote``: ``weighted`` (mergekit) | ``unweighted`` (the TIES paper: sign of the sum of the
  trimmed, unweighted task vectors) | ``count`` (majority of signs, mergekit's ``count``).
- ``rescale_mode``: ``l1`` (mergekit: match the L1 norm of the delta) | ``inverse_density`` (the
  DARE paper: multiply survivors by ``1 / density``).
- DARE's L1 norms are summed in float32 over rows of 1024 elements and in float64 across rows
  (torch's float32 cascade sum is about as accurate; a plain float32 sum over tens of millions of
  elements is not).
- DARE (and DELLA) masks come from a PCG64 stream seeded by a hash of (seed, tensor name, model),
  not from a process-global generator, so the output does not depend on tensor order or sharding; the kept
  elements therefore differ from mergekit's (the distribution is the same).
- Ties among exactly equal magnitudes at the TIES threshold keep the lowest flat indices; torch's
  CPU sort is unstable, so mergekit's pick among exact ties is implementation-defined (with a
  stable sort patched in, mergekit and this module agree bit for bit, bf16 included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.merge import kernels as K
from mlx_ssp.merge.kernels import F32, F64, f32, kernel, rnd, scalar
from mlx_ssp.merge.params import LinearParams, TaskVectorParams, load_input
from mlx_ssp.merge.sparsify import SPARSIFIERS, rescale_factor, select_slice


def _joined(parts: list, as_parts: bool):
    """The evaluated slices as they are (``as_parts``: a writer stores them one after the other,
    saving a full-size concatenation) or as one flat array."""
    if as_parts:
        return parts
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


# ---------------------------------------------------------------- linear


def _linear_fn(cd, out):
    def f(xs, ws, den):
        # inputs are aligned to cd first, as mergekit does; each step is one fused multiply-add
        # rounded to float32 (float64 holds the float32 product exactly), like torch's addcmul_
        acc = None
        for x, w in zip(xs, ws):
            t = f32(x.astype(cd)).astype(F64) * w
            acc = t.astype(F32) if acc is None else (acc.astype(F64) + t).astype(F32)
        return (acc / den).astype(cd).astype(out)
    return f


def linear(tensors: Sequence, p: LinearParams, cd, out=None, as_parts: bool = False):
    """Weighted sum in float32, divided by the weight sum when ``normalize``; rounded to ``cd``
    (then cast to ``out``, default ``cd``). ``tensors`` may be arrays or zero-argument loaders.
    ``as_parts``: return the flat result as a list of consecutive evaluated slices."""
    xs = [load_input(x) for x in tensors]
    out = out or cd
    k = kernel(("linear", len(xs), str(cd), str(out)), lambda: _linear_fn(cd, out))
    den = scalar(float(sum(p.weights)) if p.normalize else 1.0)
    ws = [mx.array(float(np.float32(w)), dtype=F64) for w in p.weights]
    size = xs[0].size
    if size <= K.CHUNK:
        res = k(xs, ws, den)
        return [res] if as_parts else res
    mx.eval(*xs)
    parts = []
    for lo, hi in K.slices(size):  # in slices: no full-size float temporaries
        part = k([x[lo:hi] for x in xs], ws, den)
        mx.eval(part)
        parts.append(part)
    return _joined(parts, as_parts)


# ---------------------------------------------------------------- task vectors: the steps


@dataclass(frozen=True)
class SparseTaskVector:
    """One model's task vector after the whole-tensor steps: the delta in ``cd``, its selection
    (None: keep all, a :class:`.sparsify.MagnitudeCut` or a boolean mask) and its rescale factor
    (None: unscaled)."""

    delta: mx.array
    sel: Any
    factor: Optional[float]


def task_vector(x: mx.array, base: mx.array, cd) -> mx.array:
    """``x - base`` in ``cd`` (``x`` aligned to ``cd`` first, as mergekit does), evaluated."""
    k = kernel(("delta", str(cd)), lambda: (lambda x, b: (f32(x) - f32(b)).astype(cd)))
    d = k(x.astype(cd), base)
    mx.eval(d)
    return d


def sparsify_task_vector(d: mx.array, i: int, sparsify: Optional[str], p: TaskVectorParams, cd) -> SparseTaskVector:
    """Model ``i``'s selection (:data:`.sparsify.SPARSIFIERS`) and, with ``rescale``, the factor that
    scales its survivors back up (rounded to the sparsifier's rescale dtype)."""
    sel, q = None, cd
    sp = SPARSIFIERS[sparsify] if sparsify else None
    if sp is not None:
        eps = p.epsilons[i] if p.epsilons else 0.15
        sel, q = sp.select(d, p.densities[i], p.seeds[i], p.gammas[i], eps, p.shape, cd), sp.rescale_dtype(cd)
    factor = None
    if sel is not None and p.rescale:
        factor = rescale_factor(d, sel, p.rescale_mode, p.densities[i], q)
    return SparseTaskVector(d, sel, factor)


def weighted_slice(tv: SparseTaskVector, w: mx.array, lo: int, hi: int, cd, keep_raw: bool):
    """Slice ``[lo:hi]`` of one model's masked, rescaled, weighted task vector, and with ``keep_raw``
    the unweighted one (the TIES paper's vote). They leave their kernels as float32 holding
    cd-rounded values: the vote reads each several times, and a bf16 input would need a cast pass
    per read."""
    dc = tv.delta[lo:hi]
    m = select_slice(tv.sel, tv.delta, lo, hi)
    if tv.factor is not None:
        # rounded to the rescale dtype then cd, then weighted, as mergekit does; the rescale dtype
        # is cd or float32, so that is one rounding to cd, written as one cast so mx.compile fuses
        # the kernel whole (graphs deeper than its limit are cut, and the cut-off input casts run
        # as separate full passes)
        fs = scalar(tv.factor)
        raw = kernel(("rescaled", str(cd)), lambda: (lambda d, m, s: rnd(f32(d) * m * s, cd)))(dc, m, fs) \
            if keep_raw else None
        wk = kernel(("wrescaled", str(cd)), lambda: (lambda d, m, s, w: rnd(rnd(f32(d) * m * s, cd) * w, cd)))
        return wk(dc, m, fs, w), raw
    raw = (dc if m is None else rnd(f32(dc) * m, cd)) if keep_raw else None
    if m is None:
        return kernel(("wmul0", str(cd)), lambda: (lambda d, w: rnd(f32(d) * w, cd)))(dc, w), raw
    return kernel(("wmul", str(cd)), lambda: (lambda d, m, w: rnd(f32(d) * m * w, cd)))(dc, m, w), raw


# The combine steps below are traced inside fused kernels (pure functions of float32 arrays).


def elect_sign(votes: list, sign_vote: str, cd) -> mx.array:
    """TIES "elect": +1 / -1 per element from the sum of the votes (``count``: of their signs);
    ``>= 0`` counts as positive. One select instead of a cast, a multiply and a subtract."""
    if sign_vote == "count":
        s = mx.sign(f32(votes[0]))
        for v in votes[1:]:
            s = s + mx.sign(f32(v))
    else:
        s = f32(votes[0])
        for v in votes[1:]:
            s = s + f32(v)
        if cd == mx.float16:  # bf16 rounding never changes a sign; fp16 can underflow to 0
            s = s.astype(cd)
    return mx.where(s >= 0, 1.0, -1.0)


def agreeing_sum(wd: list, ws: list, sg: mx.array, cd) -> tuple[mx.array, mx.array]:
    """TIES "disjoint merge": the sum of the weighted deltas that agree with the elected sign, and
    the sum of their weights (both in ``cd``). The agreement is a float multiply (``x * sg > 0``),
    which the CPU compiler handles faster than boolean logic: x * sg is exact, and x * a
    (a in {0, 1}) keeps x's signed zero as the bf16 product did. A zero delta never agrees."""
    mixed, div = None, None
    for x, wi in zip(wd, ws):
        x = f32(x)
        a = ((x * sg) > 0).astype(F32)
        mixed = x * a if mixed is None else mixed + x * a
        div = wi * a if div is None else div + wi * a
    return mixed.astype(cd), div.astype(cd)


def weighted_sum(wd: list, cd) -> mx.array:
    """The sum of the weighted deltas, rounded to ``cd``."""
    mixed = f32(wd[0])
    for x in wd[1:]:
        mixed = mixed + f32(x)
    return rnd(mixed, cd)


def normalize_by(mixed: mx.array, divisor, cd) -> mx.array:
    """``mixed / divisor`` rounded to ``cd``."""
    return rnd(mixed / divisor, cd)


def add_back(base: mx.array, mixed: mx.array, lam: Optional[mx.array], cd, out) -> mx.array:
    """``base + lam * mixed`` (no multiply when ``lam`` is None), in ``cd`` then ``out``."""
    if lam is not None:
        mixed = rnd(mixed * lam, cd)
    return (f32(base) + mixed).astype(cd).astype(out)


def _consensus_fns(sign_vote: str, normalize: bool, lam_on: bool, cd, out):
    """TIES combine in two kernels, split where mergekit rounds to cd anyway (mixed and divisor):
    shallow kernels fuse well."""
    def vote(wd, votes, ws):
        return agreeing_sum(wd, ws, elect_sign(votes, sign_vote, cd), cd)

    def apply(base, mixed, div, lam):
        mixed = f32(mixed)
        if normalize:
            d = f32(div)
            mixed = normalize_by(mixed, d + (d == 0), cd)  # a zero divisor becomes 1
        return add_back(base, mixed, lam if lam_on else None, cd, out)
    return vote, apply


def _sum_fn(normalize: bool, lam_on: bool, cd, out):
    def f(base, wd, div_scalar, lam):
        mixed = weighted_sum(wd, cd)
        if normalize:
            mixed = normalize_by(mixed, div_scalar, cd)
        return add_back(base, mixed, lam if lam_on else None, cd, out)
    return f


def combiner(consensus: bool, p: TaskVectorParams, w: list[float], ws: list[mx.array], cd, out):
    """``combine(base_slice, weighted, votes)`` -> the merged slice: sign consensus + disjoint
    merge, or the plain weighted sum; then normalise, scale by lambda and add back to the base.
    ``w``: the weights rounded to ``cd``, ``ws`` the same as 0-d arrays."""
    n = len(ws)
    lam_on, lam = p.lam != 1, scalar(p.lam)
    if consensus:
        vote_fn, apply_fn = _consensus_fns(p.sign_vote, p.normalize, lam_on, cd, out)
        vote_k = kernel(("vote", n, str(cd), p.sign_vote), lambda: vote_fn)
        apply_k = kernel(("apply", str(cd), str(out), p.normalize, lam_on), lambda: apply_fn)
        return lambda base, wd, votes: apply_k(base, *vote_k(wd, votes, ws), lam)
    sum_k = kernel(("combine", n, str(cd), str(out), p.normalize, lam_on),
                   lambda: _sum_fn(p.normalize, lam_on, cd, out))
    dv = float(rnd(scalar(sum(w)), cd).item())
    dvs = scalar(1.0 if abs(dv) < 1e-8 else dv)
    return lambda base, wd, votes: sum_k(base, wd, dvs, lam)


def task_vector_merge(base: mx.array, tensors: Sequence, p: TaskVectorParams, *, sparsify: Optional[str],
                      consensus: bool, cd, out=None, as_parts: bool = False):
    """The generalized task-arithmetic merge (task_arithmetic, ties, dare_*, breadcrumbs*).

    ``base`` and ``tensors`` are flat arrays (or zero-argument loaders) of any float dtype; they
    are cast to ``cd`` first, as mergekit aligns inputs to the compute dtype. Returns ``out``
    (default ``cd``), or with ``as_parts`` a list of consecutive slices of it (see :func:`linear`).

    Per model, the whole-tensor steps (:func:`task_vector`, :func:`sparsify_task_vector`); then the
    elementwise rest (:func:`weighted_slice`, :func:`combiner`) in slices of CHUNK elements, so no
    full-size float32 temporary is ever allocated (large fresh buffers cost page faults on every
    tensor) and each slice stays in cache."""
    out = out or cd
    base = base.astype(cd)
    if not tensors:
        return [base.astype(out)] if as_parts else base.astype(out)
    w = [float(rnd(scalar(x), cd).item()) for x in p.weights]
    sparse = [sparsify_task_vector(task_vector(load_input(x), base, cd), i, sparsify, p, cd)
              for i, x in enumerate(tensors)]
    ws = [scalar(x) for x in w]
    combine = combiner(consensus, p, w, ws, cd, out)
    keep_raw = consensus and p.sign_vote == "unweighted"
    mx.eval(base)
    parts = []
    for lo, hi in K.slices(base.size):
        pairs = [weighted_slice(tv, wi, lo, hi, cd, keep_raw) for tv, wi in zip(sparse, ws)]
        wd = [x for x, _ in pairs]
        part = combine(base[lo:hi], wd, [r for _, r in pairs] if keep_raw else wd)
        mx.eval(part)
        parts.append(part)
    if not parts:  # an empty tensor
        parts = [base.astype(out)]
    return _joined(parts, as_parts)
