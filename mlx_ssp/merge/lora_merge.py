"""Merging LoRA adapters of one base model into one adapter, without building the merged model
(``mlx_ssp merge-lora CONFIG.yml OUT_DIR``; docs/merge.md, "Merging adapters in LoRA space").

An mlx-lm LoRA adapter (``adapters.safetensors`` + ``adapter_config.json``) changes each adapted
linear layer by ``D = scale * lora_b^T lora_a^T`` (``lora_a``: (in, r), ``lora_b``: (r, out); mlx-lm's
``LoRALinear``: ``y = x W^T + scale * (x lora_a) lora_b``). Merging the fused models ``W + D_i``
with a task-vector method is a function of the ``D_i`` alone, so it can be done per layer on the
adapters, never reading the base's weights:

- ``linear`` is exact on the factors: ``sum c_i D_i`` (``c_i = w_i / sum w`` with ``normalize``)
  is the product of the factors concatenated along the rank axis, ``lora_a = [A_1 .. A_n]``,
  ``lora_b = [c_1 s_1 B_1; ..; c_n s_n B_n] / s_out``: rank ``R = r_1 + .. + r_n``. Truncated to a
  smaller ``rank``, the factors' exact SVD (QR of both stacked factors, then the SVD of the small
  ``R x R`` core) gives the best rank-r approximation in the Frobenius norm (Eckart-Young), with
  no ``out x in`` matrix (unless ``R`` exceeds the layer's smaller dimension: that matrix is then
  no larger than the factors).
- The other task-vector methods (``task_arithmetic``, ``ties``, ``dare_*``, ``breadcrumbs*``,
  ``della*``: every entry of :data:`.methods.METHODS` that merges task vectors) cannot be done on
  factors (trimming, random drops and sign votes act on the elements of ``D_i``): each layer's
  products ``D_i`` are formed, merged by the same function as the dense merge
  (:func:`.methods.task_vector_merge`, with a zero base, so the result is the merged task vector),
  and brought back to ``rank`` by the randomized truncated SVD of :mod:`.extract_lora` (exact when
  ``rank + oversample`` reaches the layer's smaller dimension). One layer at a time: the memory is
  one layer's products.

Every module's relative Frobenius error ``||D - D_r|| / ||D||`` against the untruncated merged
update ``D`` is reported (0 where nothing was truncated; float32, before the cast to ``dtype``).
A module one adapter lacks counts as a zero delta there. Adapters of different base models
(different shapes of a module, or different recorded base directories), DoRA or full fine-tunes
are refused; ``linear`` with ``normalize: false`` and weights that do not sum to 1 is refused too
(it scales the base, which no adapter can express).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Optional

import numpy as np
from pydantic import AfterValidator, Field, ValidationError

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.config import StrictModel, apply_overrides, format_validation_error, read_yaml
from mlx_ssp.errors import UserError
from mlx_ssp.io import atomic_dir, write_json_atomic
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.config import DType, ModelEntry, Setting, check_parameter_names, layer_index
from mlx_ssp.merge.engine import source_paths
from mlx_ssp.merge.extract_lora import (check_adapter_out_dir, layer_key, low_rank, relative_error, round_sig,
                                        sketch_seed)
from mlx_ssp.merge.methods import METHODS, MethodSpec, merge_task_vectors
from mlx_ssp.merge.params import TaskVectorParams, TensorInputs
from mlx_ssp.merge.task_vectors import task_vector_merge
from mlx_ssp.merge.outdir import Protected, check_clear_of_inputs
from mlx_ssp.merge.plan import layer_count, layer_position, resolve_per_model, resolve_shared
from mlx_ssp.merge.sources import open_source, read_adapter_dir, read_model_config
from mlx_ssp.merge.sparsify import dare_seed

F32 = mx.float32
REPORT_NAME = "lora_merge.json"
#: marks an adapter directory this module wrote (``--overwrite`` replaces only such a directory)
MARK = ("merged_by", "mlx_ssp")

#: methods that can run in LoRA space: linear on the factors, every task-vector method on the products
LORA_METHODS: dict[str, MethodSpec] = {
    name: spec for name, spec in METHODS.items() if name == "linear" or spec.merge is merge_task_vectors
}


def _lora_method(v: str) -> str:
    if v not in LORA_METHODS:
        raise ValueError(f"unknown merge_method '{v}' for LoRA-space merging; valid: {', '.join(LORA_METHODS)}")
    return v


class LoraMergeConfig(StrictModel):
    """``mlx_ssp merge-lora``'s YAML: mergekit's ``models:`` form whose models are mlx-lm LoRA
    adapter directories of one base, plus the output ``rank`` and the SVD's accuracy knobs."""

    models: list[ModelEntry] = Field(min_length=1)
    merge_method: Annotated[str, AfterValidator(_lora_method)]
    #: the base the adapters were trained on (optional: checks the adapters fit it, names it in the output)
    base_model: Optional[str] = None
    parameters: Optional[dict[str, Setting]] = None
    #: the output rank; None: the sum of the input ranks (linear is then exact)
    rank: Optional[int] = Field(default=None, ge=1)
    #: dtype of the stored lora_a / lora_b (None: float32 if any input is, else the inputs' dtype)
    dtype: DType = None
    #: randomized SVD of the product methods (as extract-lora): extra sketch columns, subspace iterations
    oversample: int = Field(default=8, ge=0)
    power_iters: int = Field(default=2, ge=0)


def load_lora_merge_config(path: str | Path, overrides: tuple[str, ...] = ()) -> tuple[LoraMergeConfig, dict]:
    """Read and validate the YAML (``--set`` overrides applied); returns (config, the data as read)."""
    data = apply_overrides(read_yaml(path), overrides)
    try:
        cfg = LoraMergeConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, LoraMergeConfig, str(path))) from None
    check_parameter_names(cfg, str(path))
    refs = [m.model for m in cfg.models]
    dup = next((r for r in refs if refs.count(r) > 1), None)
    if dup is not None:
        raise UserError(f"{path}: model {dup} is listed twice")
    return cfg, data


# ------------------------------------------------------------------ reading adapters


@dataclass
class Adapter:
    """One mlx-lm LoRA adapter: its directory, config, scale, rank and ``module stem -> (lora_a, lora_b)``."""

    path: Path
    config: dict
    scale: float
    rank: int
    num_layers: int
    modules: dict[str, tuple[sio.TensorInfo, sio.TensorInfo]] = field(default_factory=dict)

    def dims(self, stem: str) -> tuple[int, int]:
        """(out, in) of the adapted layer."""
        a, b = self.modules[stem]
        return b.shape[1], a.shape[0]

    def factors(self, stem: str) -> tuple[mx.array, mx.array]:
        """(lora_a (in, r), lora_b (r, out)) in float32."""
        a, b = self.modules[stem]
        return sio.read_tensor(a).astype(F32), sio.read_tensor(b).astype(F32)

    def delta(self, stem: str) -> mx.array:
        """``scale * lora_b^T lora_a^T`` (out, in), float32."""
        a, b = self.factors(stem)
        return (self.scale * b.T) @ a.T


def read_adapter(ref: str) -> Adapter:
    """An adapter directory, checked: LoRA (not DoRA / full), ``lora_a``/``lora_b`` pairs of 2-D
    matrices of one rank; anything else is one line naming the adapter."""
    d = Path(ref).expanduser()
    conf, tensors = read_adapter_dir(d, f"adapter {ref}", "fuse it and merge the fused models with `mlx_ssp merge`")
    lp = conf.get("lora_parameters")
    if not isinstance(lp, dict) or not isinstance(lp.get("scale"), (int, float)) or isinstance(lp.get("scale"), bool):
        raise UserError(f"{d / 'adapter_config.json'}: lora_parameters.scale is missing or not a number")
    modules: dict[str, tuple[sio.TensorInfo, sio.TensorInfo]] = {}
    for k in tensors:
        stem = k.rpartition(".")[0]
        a, b = tensors[stem + ".lora_a"], tensors[stem + ".lora_b"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[0] or a.dtype not in sio.FLOAT_CODES:
            raise UserError(f"adapter {ref}: module '{stem}' is not a linear LoRA pair (lora_a {list(a.shape)}, "
                            f"lora_b {list(b.shape)}); only 2-D float lora_a (in, r) / lora_b (r, out) merge")
        modules[stem] = (a, b)
    if not modules:
        raise UserError(f"adapter {ref}: adapters.safetensors holds no LoRA matrices")
    ranks = {a.shape[1] for a, _ in modules.values()}
    if len(ranks) > 1:
        raise UserError(f"adapter {ref}: its modules have different ranks {sorted(ranks)}")
    n_layers = conf.get("num_layers", -1)  # mlx-lm adapts the last num_layers layers (-1: all)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int):
        raise UserError(f"{d / 'adapter_config.json'}: num_layers is {n_layers!r}, not an integer")
    return Adapter(d, conf, float(lp["scale"]), ranks.pop(), n_layers, modules)


def _recorded_base(ad: Adapter) -> Optional[Path]:
    """The base directory the adapter records (mlx-lm's ``model``, extract-lora's ``base_model``),
    when it is an existing directory."""
    for key in ("model", "base_model"):
        v = ad.config.get(key)
        if isinstance(v, str) and Path(v).expanduser().is_dir():
            return Path(v).expanduser().resolve()
    return None


def check_one_base(adapters: list[Adapter], refs: list[str], base_tensors: Optional[dict] = None,
                   base_ref: str = "") -> dict[str, tuple[int, int]]:
    """Every module's (out, in), checked equal across the adapters (and against the base's weight
    when given); adapters recording different base directories are refused. Returns the union of
    the modules."""
    bases = {(_recorded_base(a), r) for a, r in zip(adapters, refs) if _recorded_base(a) is not None}
    if len({b for b, _ in bases}) > 1:
        (b1, r1), (b2, r2) = sorted(bases, key=str)[:2]
        raise UserError(f"adapters of different base models: {r1} was trained on {b1}, {r2} on {b2}")
    dims: dict[str, tuple[int, int]] = {}
    owner: dict[str, str] = {}
    for ad, ref in zip(adapters, refs):
        for stem in ad.modules:
            d = ad.dims(stem)
            if stem in dims and dims[stem] != d:
                o_n, i_n = dims[stem]
                raise UserError(f"module '{stem}' is {d[0]}x{d[1]} in adapter {ref} but {o_n}x{i_n} in {owner[stem]}: "
                                "the adapters belong to different base models")
            dims.setdefault(stem, d)
            owner.setdefault(stem, ref)
    if base_tensors is not None:
        for stem, d in dims.items():
            info = base_tensors.get(stem + ".weight")
            if info is None:
                raise UserError(f"adapter {owner[stem]}: module '{stem}' has no weight '{stem}.weight' in base model "
                                f"{base_ref}")
            if tuple(info.shape) == d[::-1] and d[0] != d[1]:  # mlx-lm's LoRAEmbedding: delta = lora_a @ lora_b
                raise UserError(f"adapter {owner[stem]}: module '{stem}' is an embedding LoRA (lora_a {d[1]}x{d[0]} "
                                "indexes the vocabulary); only linear layers merge in LoRA space")
            if tuple(info.shape) != d:
                raise UserError(f"adapter {owner[stem]}: module '{stem}' is {d[0]}x{d[1]} but the weight in base model "
                                f"{base_ref} is {list(info.shape)}: not an adapter of this base")
    return dims


# ------------------------------------------------------------------ the math (pure functions)


def concat_factors(parts: list[tuple[mx.array, mx.array, float]]) -> tuple[mx.array, mx.array]:
    """``sum_i c_i * lora_b_i^T lora_a_i^T`` as one pair: ``lora_a`` (in, sum r_i) concatenated,
    ``lora_b`` (sum r_i, out) with each block multiplied by its ``c_i`` (``parts``: (a, b, c_i))."""
    a = mx.concatenate([p[0] for p in parts], axis=1)
    b = mx.concatenate([p[2] * p[1] for p in parts], axis=0)
    return a, b


def _svd_small(m: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Full SVD of a small matrix on the CPU (MLX factorises there only)."""
    return mx.linalg.svd(m, stream=mx.cpu)


def truncate_factors(a: mx.array, b: mx.array, rank: int) -> tuple[mx.array, mx.array, float]:
    """The best rank-``rank`` approximation of ``b^T a^T`` (Eckart-Young) as (a' (in, rank), b'
    (rank, out)) and its relative Frobenius error ``sqrt(sum of the tail s^2 / sum s^2)``, from the
    factors: ``b^T = Q_b R_b``, ``a = Q_a R_a``, so ``b^T a^T = Q_b (R_b R_a^T) Q_a^T`` and only the
    ``R x R`` core is decomposed. The singular values go to ``b'``; columns past the product's rank are zero."""
    (n_in, r_all), n_out = a.shape, b.shape[1]
    if r_all <= rank:
        return mx.pad(a, [(0, 0), (0, rank - r_all)]), mx.pad(b, [(0, rank - r_all), (0, 0)]), 0.0
    if r_all <= min(n_in, n_out):
        qa, ra = mx.linalg.qr(a, stream=mx.cpu)
        qb, rb = mx.linalg.qr(b.T, stream=mx.cpu)
        u, s, vt = _svd_small(rb @ ra.T)
        left, right = qb @ u, qa @ vt.T
    else:  # more rank than dimensions: the product is small enough to decompose itself
        left, s, vt = _svd_small(b.T @ a.T)
        right = vt.T
    k = min(rank, s.shape[0])
    total = float(mx.sum(s * s).item())
    err = math.sqrt(max(float(mx.sum(s[k:] * s[k:]).item()), 0.0) / total) if total > 0 else 0.0
    a2 = right[:, :k]
    b2 = (left[:, :k] * s[:k]).T
    if k < rank:
        a2, b2 = mx.pad(a2, [(0, 0), (0, rank - k)]), mx.pad(b2, [(0, rank - k), (0, 0)])
    return a2, b2, err


def merge_products(deltas: list[mx.array], spec: MethodSpec, p: TaskVectorParams) -> mx.array:
    """The merged task vector of one layer: the dense task-vector merge of the ``deltas`` (out, in)
    from a zero base (so adding it back adds nothing)."""
    shape = deltas[0].shape
    zero = mx.zeros((deltas[0].size,), dtype=F32)
    merged = task_vector_merge(zero, [d.reshape(-1) for d in deltas], p, sparsify=spec.sparsify,
                               consensus=spec.consensus, cd=F32, out=F32)
    return merged.reshape(shape)


# ------------------------------------------------------------------ the merge


@dataclass(frozen=True)
class ModuleResult:
    """One merged module: its stem, (out, in) and the relative error of the rank truncation."""

    module: str
    shape: tuple[int, int]
    rel_error: float


def _module_order(stem: str) -> tuple[int, str]:
    """Modules outside the layers first, then layer by layer."""
    i = layer_index(stem + ".")
    return (-1 if i is None else i, stem)


def _params(spec: MethodSpec, cfg: LoraMergeConfig, stem: str, n_layers: int,
            seed: int) -> tuple[list[dict], dict, list[int]]:
    """(per-model, shared) parameters of one module, resolved like the dense merge's for the
    module's ``.weight`` (filters and gradients apply to that name), and each model's DARE seed."""
    name = stem + ".weight"
    t = layer_position(name, n_layers)
    top = cfg.parameters or {}
    shared = resolve_shared(spec, top, name, t)
    per_model = [resolve_per_model(spec, [m.parameters, top], name, t, m.model) for m in cfg.models]
    # the dense merge's model id is the model's position in models: (the base is appended after them)
    seeds = [dare_seed(seed, name, str(i)) for i in range(len(cfg.models))]
    return per_model, shared, seeds


def _linear_coeffs(per_model: list[dict], shared: dict, stem: str, refs: list[str]) -> list[float]:
    """``w_i / sum w`` (normalize) or ``w_i``; a linear merge whose weights would scale the base is refused."""
    w = [float(np.float32(pm["weight"])) for pm in per_model]
    total = sum(w)
    if shared["normalize"]:
        if abs(total) < 1e-8:
            raise UserError(f"module '{stem}': the weights of {', '.join(refs)} sum to zero, so normalize cannot "
                            "divide by them")
        return [x / total for x in w]
    if abs(total - 1) > 1e-6:
        raise UserError(f"module '{stem}': linear with normalize: false and weights summing to {total:g} scales the "
                        "base model, which an adapter cannot express; use normalize: true, weights summing to 1, or "
                        "task_arithmetic")
    return w


def merge_adapters(cfg: LoraMergeConfig, adapters: list[Adapter], dims: dict[str, tuple[int, int]], *,
                   n_layers: int, seed: int = 0,
                   on_module: Optional[Callable[[ModuleResult], None]] = None) -> tuple[dict, dict, list[ModuleResult]]:
    """(adapter tensors, adapter_config, one result per module); one module at a time."""
    spec = LORA_METHODS[cfg.merge_method]
    refs = [m.model for m in cfg.models]
    # the output's scale: the inputs' common one (so lora_b keeps their magnitude), else 1.0 (also
    # for a common 0, which nothing could be divided by); the rest is folded into each lora_b block
    scales = {a.scale for a in adapters}
    s_out = scales.pop() if len(scales) == 1 and 0 not in scales else 1.0
    rank = cfg.rank or sum(a.rank for a in adapters)
    codes = {t.dtype for a in adapters for pair in a.modules.values() for t in pair}
    out_dt = getattr(mx, cfg.dtype) if cfg.dtype else (F32 if "F32" in codes or len(codes) > 1
                                                         else getattr(mx, sio.DTYPES[codes.pop()][2]))
    weights: dict[str, mx.array] = {}
    results = []
    for stem in sorted(dims, key=_module_order):
        per_model, shared, seeds = _params(spec, cfg, stem, n_layers, seed)
        have = [i for i, a in enumerate(adapters) if stem in a.modules]
        if spec.name == "linear":
            coeffs = _linear_coeffs(per_model, shared, stem, refs)
            parts = []
            for i in have:
                a, b = adapters[i].factors(stem)
                parts.append((a, b, coeffs[i] * adapters[i].scale / s_out))
            la, lb = concat_factors(parts)
            la, lb, err = truncate_factors(la, lb, rank)
        else:
            out_n, in_n = dims[stem]
            deltas = [adapters[i].delta(stem) if i in have else mx.zeros((out_n, in_n), dtype=F32)
                      for i in range(len(adapters))]
            tv = TaskVectorParams.of(TensorInputs([], None, per_model, shared, seeds, F32, F32, (out_n, in_n)))
            d = merge_products(deltas, spec, tv)
            mx.eval(d)
            del deltas
            u, sv = low_rank(d, rank, oversample=cfg.oversample, power_iters=cfg.power_iters,
                             seed=sketch_seed(seed, stem))
            err = relative_error(d, u, sv)
            la, lb = sv.T, u.T / s_out  # d ~ u sv = s_out * lb^T la^T
        weights[stem + ".lora_a"] = la.astype(out_dt)
        weights[stem + ".lora_b"] = lb.astype(out_dt)
        mx.eval(weights[stem + ".lora_a"], weights[stem + ".lora_b"])
        res = ModuleResult(stem, dims[stem], err)
        results.append(res)
        if on_module:
            on_module(res)
    nl = [a.num_layers for a in adapters]
    config = {"fine_tune_type": "lora", "num_layers": -1 if -1 in nl else max(nl),
              "lora_parameters": {"rank": rank, "scale": s_out, "dropout": 0.0,
                                  "keys": sorted({layer_key(s + ".weight") for s in dims})}}
    return weights, config, results


def run_lora_merge(cfg: LoraMergeConfig, out_dir: Path, *, seed: int = 0, overwrite: bool = False,
                   config_data: Optional[dict] = None, protect: tuple[Path, ...] = (),
                   on_module: Optional[Callable[[ModuleResult], None]] = None) -> dict:
    """Read the adapters, merge them module by module and write OUT_DIR atomically (the adapter,
    its config and ``lora_merge.json``: the method, inputs and every module's truncation error).
    Returns a summary."""
    out_dir = Path(out_dir)
    refs = [m.model for m in cfg.models]
    adapters = [read_adapter(r) for r in refs]
    spec = LORA_METHODS[cfg.merge_method]
    protected = [Protected(Path(f), "the merge config", is_dir=False) for f in protect]
    protected += [Protected(a.path, f"input adapter {r}") for a, r in zip(adapters, refs)]
    base_tensors, n_layers, base_path = None, None, None
    if cfg.base_model is not None:
        base = open_source(cfg.base_model)
        base_tensors, base_path = base.tensors, base.path
        n_layers = layer_count(base, read_model_config(base))
        protected += source_paths([base])
        recorded = {_recorded_base(a) for a in adapters} - {None}
        if recorded and recorded != {base.path.resolve()}:
            raise UserError(f"the adapters were trained on {', '.join(map(str, sorted(recorded)))}, not on base_model "
                            f"{cfg.base_model} ({base.path})")
    dims = check_one_base(adapters, refs, base_tensors, cfg.base_model or "")
    if n_layers is None:  # gradients need a layer count: one more than the deepest adapted layer
        n_layers = 1 + max((layer_index(s + ".") or 0) for s in dims)
    check_clear_of_inputs(out_dir, protected)
    check_adapter_out_dir(out_dir, overwrite=overwrite, mark=MARK, extra_files=(REPORT_NAME,))
    t0 = time.perf_counter()
    weights, config, results = merge_adapters(cfg, adapters, dims, n_layers=n_layers, seed=seed, on_module=on_module)
    seconds = round(time.perf_counter() - t0, 3)
    config.update({"base_model": str(base_path) if base_path else _common_base(adapters), MARK[0]: MARK[1]})
    errs = [r.rel_error for r in results]
    lp = config["lora_parameters"]
    summary = {"out_dir": str(out_dir), "method": spec.name, "adapters": refs, "rank": lp["rank"],
               "scale": lp["scale"], "modules": len(results),
               "mean_rel_error": round_sig(np.mean(errs)), "max_rel_error": round_sig(np.max(errs)), "seed": seed,
               "seconds": seconds}
    report = {**summary, "config": config_data if config_data is not None else cfg.model_dump(mode="json"),
              "rel_error": {r.module: round_sig(r.rel_error) for r in results}}
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        mx.save_safetensors(str(tmp / "adapters.safetensors"), weights,
                            metadata={"format": "mlx", MARK[0]: MARK[1], "merge_method": spec.name})
        write_json_atomic(tmp / "adapter_config.json", config)
        write_json_atomic(tmp / REPORT_NAME, report)
    return summary


def _common_base(adapters: list[Adapter]) -> Optional[str]:
    """The base directory the adapters record, when they agree (None: none recorded)."""
    bases = {_recorded_base(a) for a in adapters} - {None}
    return str(bases.pop()) if len(bases) == 1 else None
