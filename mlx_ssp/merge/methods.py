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

A task-vector method is the algorithm's own steps, each a small function here or in
:mod:`.sparsify`: task vectors (:func:`task_vector`) -> sparsify (:data:`.sparsify.SPARSIFIERS`:
magnitude trim, DARE drop, breadcrumbs; optional rescale) -> weight (:func:`weighted_slice`) ->
sign consensus (:func:`elect_sign`, :func:`agreeing_sum`) or plain sum (:func:`weighted_sum`) ->
normalise (:func:`normalize_by`) -> scale by lambda and add back to the base (:func:`add_back`).

Methods (mergekit names; the registry :data:`METHODS` maps each name to its recipe and its merge
function; a method's parameters for one tensor are one :class:`LinearParams` or
:class:`TaskVectorParams`):

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

The other methods are pure functions in :mod:`.interpolate` (``slerp`` with ``t``, ``nuslerp``,
``multislerp``, ``karcher``, ``model_stock``, ``nearswap``, ``arcee_fusion``) and :mod:`.selective`
(``sce``, ``ram``, ``ramplus_tl``), wrapped here (``merge_*``) to check the input count and read the
parameters: mergekit's names and defaults, listed per method in :data:`METHODS`. Their statistics
are whole-tensor or per row, as mergekit's; slerp, nuslerp, multislerp, karcher and model_stock
sum them slice by slice and write their output slice by slice (no full-size float32 copy), the
others work on the whole tensor at once. They need the tensor's shape only for per-row variants
(``TensorInputs.shape``), and round every intermediate mergekit holds in the compute dtype, as
above (see those modules for what still differs). A required parameter (``t``) or a
wrong number of models is reported when the first tensor is merged (the output directory is never
created).

Deviations (each an explicit option; the defaults are mergekit 0.1.5's):

- ``sign_vote``: ``weighted`` (mergekit) | ``unweighted`` (the TIES paper: sign of the sum of the
  trimmed, unweighted task vectors) | ``count`` (majority of signs, mergekit's ``count``).
- ``rescale_mode``: ``l1`` (mergekit: match the L1 norm of the delta) | ``inverse_density`` (the
  DARE paper: multiply survivors by ``1 / density``).
- DARE's L1 norms are summed in float32 over rows of 1024 elements and in float64 across rows
  (torch's float32 cascade sum is about as accurate; a plain float32 sum over tens of millions of
  elements is not).
- nuslerp and multislerp take no base model (a ``base_model`` is merged as one more input; mergekit
  would interpolate the task vectors from it): the planner does not tell the method which input
  is an optional base.
- DARE (and DELLA) masks come from a PCG64 stream seeded by a hash of (seed, tensor name, model), not from a
  process-global generator, so the output does not depend on tensor order or sharding; the kept
  elements therefore differ from mergekit's (the distribution is the same).
- Ties among exactly equal magnitudes at the TIES threshold keep the lowest flat indices; torch's
  CPU sort is unstable, so mergekit's pick among exact ties is implementation-defined (with a
  stable sort patched in, mergekit and this module agree bit for bit, bf16 included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge import interpolate as I
from mlx_ssp.merge import kernels as K
from mlx_ssp.merge import selective as S
from mlx_ssp.merge.kernels import DTYPES, F32, F64, f32, kernel, rnd, scalar  # noqa: F401  (DTYPES: re-export)
from mlx_ssp.merge.sparsify import SPARSIFIERS, rescale_factor, select_slice

SIGN_VOTES = ("weighted", "unweighted", "count")
RESCALE_MODES = ("l1", "inverse_density")


def _load(x):
    """An array, or the array a zero-argument loader reads (one model's tensor, only when needed)."""
    return x() if callable(x) else x


def _joined(parts: list, as_parts: bool):
    """The evaluated slices as they are (``as_parts``: a writer stores them one after the other,
    saving a full-size concatenation) or as one flat array."""
    if as_parts:
        return parts
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


# ---------------------------------------------------------------- per-tensor parameters


@dataclass(frozen=True)
class TensorInputs:
    """One tensor as the engine hands it to a method: zero-argument loaders of the flat inputs (and
    of the base), the resolved parameters (per model and shared), the DARE seed of each model, the
    compute and output dtypes."""

    models: list[Callable[[], mx.array]]
    base: Optional[Callable[[], mx.array]]
    per_model: list[dict[str, Any]]
    shared: dict[str, Any]
    seeds: list[int]
    cd: Any
    out: Any
    #: the tensor's shape (None: the engine did not pass it; shape-dependent steps then see one row)
    shape: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class LinearParams:
    """``linear``: one weight per model; divide by their sum when ``normalize``."""

    weights: tuple[float, ...]
    normalize: bool

    @classmethod
    def of(cls, t: TensorInputs) -> "LinearParams":
        return cls(tuple(pm["weight"] for pm in t.per_model), t.shared["normalize"])


@dataclass(frozen=True)
class TaskVectorParams:
    """A task-vector method's parameters for one tensor: per model (weight, density, gamma, DARE
    seed) and shared (normalize, rescale, lambda, sign_vote, rescale_mode)."""

    weights: tuple[float, ...]
    densities: tuple[float, ...]
    gammas: tuple[float, ...]
    seeds: tuple[int, ...]
    normalize: bool
    rescale: bool = False
    lam: float = 1.0
    sign_vote: str = "weighted"
    rescale_mode: str = "l1"
    epsilons: tuple[float, ...] = ()
    shape: Optional[tuple[int, ...]] = None

    @classmethod
    def of(cls, t: TensorInputs) -> "TaskVectorParams":
        pm, sh = t.per_model, t.shared
        return cls(weights=tuple(m["weight"] for m in pm), densities=tuple(m.get("density", 1.0) for m in pm),
                   gammas=tuple(m.get("gamma", 0.01) for m in pm), seeds=tuple(t.seeds),
                   normalize=sh["normalize"], rescale=bool(sh.get("rescale", False)), lam=sh.get("lambda", 1.0),
                   sign_vote=sh.get("sign_vote", "weighted"), rescale_mode=sh.get("rescale_mode", "l1"),
                   epsilons=tuple(m.get("epsilon", 0.15) for m in pm), shape=t.shape)


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
    xs = [_load(x) for x in tensors]
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
    sparse = [sparsify_task_vector(task_vector(_load(x), base, cd), i, sparsify, p, cd)
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


# ---------------------------------------------------------------- registry


def merge_linear(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    """``linear``: every input (the base too, when given) is a weighted input."""
    return linear(t.models, LinearParams.of(t), t.cd, out=t.out, as_parts=True)


def merge_task_vectors(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    """A task-vector method: the spec's sparsifier and consensus over the deltas from the base."""
    return task_vector_merge(t.base(), t.models, TaskVectorParams.of(t), sparsify=spec.sparsify,
                             consensus=spec.consensus, cd=t.cd, out=t.out, as_parts=True)


# ---------------------------------------------------------------- the other methods (mergekit 0.1.5)


def _inputs(t: TensorInputs) -> list[mx.array]:
    """Every non-base input, aligned to the compute dtype as mergekit does."""
    return [_load(x).astype(t.cd) for x in t.models]


def _finish(res: mx.array, t: TensorInputs) -> list[mx.array]:
    """A float32 result rounded once to the compute dtype, then cast to the output dtype."""
    out = res.astype(t.cd).astype(t.out)
    mx.eval(out)
    return [out]


def _count(spec: "MethodSpec", t: TensorInputs, n: Optional[int] = None, at_least: Optional[int] = None) -> None:
    k = len(t.models)
    what = "model besides base_model" if spec.needs_base else "model"
    # the planner hands a method without a required base its base_model as one more input
    hint = "" if spec.needs_base else " (a base_model counts as one of them)"
    if n is not None and k != n:
        raise UserError(f"merge_method {spec.name} takes exactly {n} {what}{'s' if n > 1 else ''} (got {k}){hint}")
    if at_least is not None and k < at_least:
        raise UserError(f"merge_method {spec.name} takes at least {at_least} {what}s (got {k}){hint}")


def _required(spec: "MethodSpec", t: TensorInputs, name: str) -> Any:
    v = t.shared.get(name)
    if v is None:
        raise UserError(f"merge_method {spec.name} needs the parameter {name} (set parameters.{name})")
    return v


def merge_slerp(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    """``slerp``: from the base (t = 0) to the other model (t = 1); the inputs stay in their dtype
    (aligned to the compute dtype slice by slice)."""
    _count(spec, t, n=1)
    return I.slerp_parts(_required(spec, t, "t"), t.base(), _load(t.models[0]), t.cd, t.out)


def merge_nuslerp(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    """``nuslerp``: two models, ``t = w1 / (w0 + w1)`` (0.5 when the weights cancel); the inputs
    stay in their dtype (aligned to the compute dtype slice by slice)."""
    _count(spec, t, n=2)
    w = [pm["weight"] for pm in t.per_model]
    tt = 0.5 if abs(sum(w)) < 1e-6 else w[1] / sum(w)
    a, b = (_load(x) for x in t.models)
    return I.nuslerp_parts(tt, a, b, t.cd, t.out, t.shape, row_wise=t.shared["nuslerp_row_wise"],
                           flatten=t.shared["nuslerp_flatten"])


def merge_multislerp(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    _count(spec, t, at_least=1)
    try:
        return I.multislerp_parts([_load(x) for x in t.models], [pm["weight"] for pm in t.per_model],
                                  t.shared["normalize_weights"], t.shared["eps"], t.cd, t.out)
    except ValueError as e:
        raise UserError(str(e)) from None


def merge_karcher(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    """``karcher``: the equal-weight Karcher mean of every input."""
    return I.karcher_parts([_load(x) for x in t.models], max_iter=int(t.shared["max_iter"]), tol=t.shared["tol"],
                           cd=t.cd, out=t.out)


def merge_model_stock(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    """``model_stock``: the inputs stay in their dtype (aligned to the compute dtype slice by slice)."""
    _count(spec, t, at_least=2)
    return I.model_stock_parts(t.base(), [_load(x) for x in t.models], t.cd, t.out, t.shape, t.shared["filter_wise"])


def merge_nearswap(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    _count(spec, t, n=1)
    return _finish(I.nearswap(_required(spec, t, "t"), t.base().astype(t.cd), _inputs(t)[0], t.cd), t)


def merge_arcee_fusion(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    _count(spec, t, n=1)
    return _finish(I.arcee_fusion(t.base().astype(t.cd), _inputs(t)[0], t.shape, t.seeds[0], t.cd), t)


def _task_vectors(t: TensorInputs) -> tuple[mx.array, list[mx.array]]:
    base = t.base().astype(t.cd)
    return base, [task_vector(x, base, t.cd) for x in _inputs(t)]


def merge_sce(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    base, tvs = _task_vectors(t)
    if not tvs:
        return _finish(f32(base), t)
    return S.sce_parts(base, tvs, t.shared["select_topk"], t.cd, t.out)


def merge_ram(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    base, tvs = _task_vectors(t)
    if not tvs:
        return _finish(f32(base), t)
    sh = t.shared
    plus = spec.name == "ramplus_tl"
    return _finish(S.ram(base, tvs, sh["epsilon"], plus=plus, r=sh.get("r", 0.1), alpha=sh.get("alpha", 0.2),
                         cd=t.cd), t)


#: types of the parameters only the methods above take (mlx_ssp.merge.config validates values by them)
METHOD_PARAM_TYPES: dict[str, type] = {
    "t": float, "epsilon": float, "filter_wise": bool, "nuslerp_row_wise": bool, "nuslerp_flatten": bool,
    "normalize_weights": bool, "eps": float, "max_iter": float, "tol": float, "select_topk": float,
    "r": float, "alpha": float,
}


_TV_DEFAULTS = (("density", 1.0), ("lambda", 1.0), ("int8_mask", False), ("sign_vote", "weighted"),
                ("rescale_mode", "l1"))


@dataclass(frozen=True)
class MethodSpec:
    """A merge method's recipe, its parameter defaults (mergekit 0.1.5) and the function that merges
    one tensor (``merge(spec, TensorInputs)`` -> the output's consecutive flat slices)."""

    name: str
    needs_base: bool
    sparsify: Optional[str] = None  # a key of sparsify.SPARSIFIERS: magnitude | random | outliers
    consensus: bool = False
    default_normalize: bool = False
    default_rescale: bool = False
    #: per-model parameters (weight, density, gamma) and shared ones
    model_params: tuple[str, ...] = ("weight", "density")
    shared_params: tuple[str, ...] = ("normalize", "rescale", "lambda", "int8_mask", "sign_vote", "rescale_mode")
    defaults: tuple[tuple[str, object], ...] = _TV_DEFAULTS
    merge: Callable[["MethodSpec", TensorInputs], list] = field(default=merge_task_vectors, compare=False)

    def run(self, t: TensorInputs) -> list[mx.array]:
        return self.merge(self, t)


_BREADCRUMBS = dict(sparsify="outliers", model_params=("weight", "density", "gamma"),
                    defaults=_TV_DEFAULTS + (("gamma", 0.01),))

_DELLA = dict(sparsify="magprune", default_rescale=True, model_params=("weight", "density", "epsilon"),
             defaults=_TV_DEFAULTS + (("epsilon", 0.15),))


def _other(merge, *defaults, weighted: bool = False) -> dict:
    """A non-task-vector method: its merge function and shared defaults; ``weighted``: it takes
    mergekit's per-model ``weight`` (required, no default), else no per-model parameter."""
    return dict(merge=merge, model_params=("weight",) if weighted else (), defaults=tuple(defaults))


METHODS: dict[str, MethodSpec] = {
    "linear": MethodSpec("linear", needs_base=False, default_normalize=True, model_params=("weight",),
                         shared_params=("normalize",), defaults=(), merge=merge_linear),
    "task_arithmetic": MethodSpec("task_arithmetic", needs_base=True),
    "ties": MethodSpec("ties", needs_base=True, sparsify="magnitude", consensus=True, default_normalize=True),
    "dare_linear": MethodSpec("dare_linear", needs_base=True, sparsify="random", default_rescale=True),
    "dare_ties": MethodSpec("dare_ties", needs_base=True, sparsify="random", consensus=True, default_rescale=True),
    "breadcrumbs": MethodSpec("breadcrumbs", needs_base=True, **_BREADCRUMBS),
    "breadcrumbs_ties": MethodSpec("breadcrumbs_ties", needs_base=True, consensus=True, **_BREADCRUMBS),
    "della": MethodSpec("della", needs_base=True, consensus=True, default_normalize=True, **_DELLA),
    "della_linear": MethodSpec("della_linear", needs_base=True, **_DELLA),
    "sce": MethodSpec("sce", needs_base=True, shared_params=("select_topk", "int8_mask"),
                      **_other(merge_sce, ("select_topk", 1.0), ("int8_mask", False))),
    "ram": MethodSpec("ram", needs_base=True, shared_params=("epsilon",), **_other(merge_ram, ("epsilon", 1e-5))),
    "ramplus_tl": MethodSpec("ramplus_tl", needs_base=True, shared_params=("r", "alpha", "epsilon"),
                             **_other(merge_ram, ("r", 0.1), ("alpha", 0.2), ("epsilon", 1e-5))),
    "slerp": MethodSpec("slerp", needs_base=True, shared_params=("t",), **_other(merge_slerp)),
    "nuslerp": MethodSpec("nuslerp", needs_base=False, shared_params=("nuslerp_row_wise", "nuslerp_flatten"),
                          **_other(merge_nuslerp, ("nuslerp_row_wise", False), ("nuslerp_flatten", True), weighted=True)),
    "multislerp": MethodSpec("multislerp", needs_base=False, shared_params=("normalize_weights", "eps"),
                             **_other(merge_multislerp, ("normalize_weights", True), ("eps", 1e-8), weighted=True)),
    "karcher": MethodSpec("karcher", needs_base=False, shared_params=("max_iter", "tol"),
                          **_other(merge_karcher, ("max_iter", 10.0), ("tol", 1e-5))),
    "model_stock": MethodSpec("model_stock", needs_base=True, shared_params=("filter_wise",),
                              **_other(merge_model_stock, ("filter_wise", False))),
    "nearswap": MethodSpec("nearswap", needs_base=True, shared_params=("t",), **_other(merge_nearswap)),
    "arcee_fusion": MethodSpec("arcee_fusion", needs_base=True, shared_params=(), **_other(merge_arcee_fusion)),
}
