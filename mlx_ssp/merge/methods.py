"""The merge methods' registry (:data:`METHODS`): each mergekit 0.1.5 method name maps to its recipe,
its parameter defaults and the function that merges one tensor (``merge_*`` here: check the input
count, read the parameters, call the pure per-tensor functions).

- ``linear`` and the task-vector methods (``task_arithmetic``, ``ties``, ``dare_*``,
  ``breadcrumbs*``, ``della*``): :mod:`.task_vectors` (the algorithms, their defaults and their
  deviations from mergekit).
- ``slerp``, ``nuslerp``: :mod:`.slerp`; ``multislerp``, ``karcher``: :mod:`.sphere_means`;
  ``model_stock``, ``nearswap``, ``arcee_fusion``: :mod:`.interpolate`; ``sce``, ``ram``,
  ``ramplus_tl``: :mod:`.selective`.

The methods besides linear and the task-vector ones take mergekit's names and defaults, listed
per method in :data:`METHODS`. Their statistics are whole-tensor or per row, as mergekit's;
slerp, nuslerp, multislerp, karcher and model_stock sum them slice by slice and write their output
slice by slice (no full-size float32 copy), the others work on the whole tensor at once. They need
the tensor's shape only for per-row variants (``TensorInputs.shape``), and round every
intermediate mergekit holds in the compute dtype (see those modules for what still differs). A
required parameter (``t``) or a wrong number of models is reported when the first tensor is
merged (the output directory is never created).

nuslerp and multislerp take no base model (a ``base_model`` is merged as one more input; mergekit
would interpolate the task vectors from it): the planner does not tell the method which input is
an optional base.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge import interpolate as I
from mlx_ssp.merge import selective as S
from mlx_ssp.merge import slerp as SL
from mlx_ssp.merge import sphere_means as SM
from mlx_ssp.merge.kernels import f32
from mlx_ssp.merge.params import LinearParams, TaskVectorParams, TensorInputs, load_input
from mlx_ssp.merge.task_vectors import linear, task_vector, task_vector_merge

SIGN_VOTES = ("weighted", "unweighted", "count")
RESCALE_MODES = ("l1", "inverse_density")


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
    return [load_input(x).astype(t.cd) for x in t.models]


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
    return SL.slerp_parts(_required(spec, t, "t"), t.base(), load_input(t.models[0]), t.cd, t.out)


def merge_nuslerp(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    """``nuslerp``: two models, ``t = w1 / (w0 + w1)`` (0.5 when the weights cancel); the inputs
    stay in their dtype (aligned to the compute dtype slice by slice)."""
    _count(spec, t, n=2)
    w = [pm["weight"] for pm in t.per_model]
    tt = 0.5 if abs(sum(w)) < 1e-6 else w[1] / sum(w)
    a, b = (load_input(x) for x in t.models)
    return SL.nuslerp_parts(tt, a, b, t.cd, t.out, t.shape, row_wise=t.shared["nuslerp_row_wise"],
                            flatten=t.shared["nuslerp_flatten"])


def merge_multislerp(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    _count(spec, t, at_least=1)
    try:
        return SM.multislerp_parts([load_input(x) for x in t.models], [pm["weight"] for pm in t.per_model],
                                   t.shared["normalize_weights"], t.shared["eps"], t.cd, t.out)
    except ValueError as e:
        raise UserError(str(e)) from None


def merge_karcher(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    """``karcher``: the equal-weight Karcher mean of every input."""
    return SM.karcher_parts([load_input(x) for x in t.models], max_iter=int(t.shared["max_iter"]), tol=t.shared["tol"],
                           cd=t.cd, out=t.out)


def merge_model_stock(spec: "MethodSpec", t: TensorInputs) -> list[mx.array]:
    """``model_stock``: the inputs stay in their dtype (aligned to the compute dtype slice by slice)."""
    _count(spec, t, at_least=2)
    return I.model_stock_parts(t.base(), [load_input(x) for x in t.models], t.cd, t.out, t.shape,
                               t.shared["filter_wise"])


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
