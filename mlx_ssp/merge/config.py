"""Merge configuration: mergekit's YAML (``mlx_ssp merge CONFIG.yml OUT``) and the pipeline's ``merge:``.

:class:`MergeConfig` reads the mergekit ``models:`` form: ``models`` (each ``model`` and optional
``parameters``), ``merge_method``, ``base_model``, top-level ``parameters``, ``dtype``,
``out_dtype``, ``tokenizer_source`` (``base``, ``union`` or a model reference) or mergekit's
``tokenizer:`` section (:class:`TokenizerConfig`; :mod:`mlx_ssp.merge.tokenizer`). A parameter value is a
scalar, a gradient list (interpolated over the layer index ``t = i / (L - 1)``; tensors outside the
layers get ``t = 0``, as in mergekit), or a list of ``{filter: substring, value: ...}`` (first match
wins; ``filter: "*"`` or no filter matches everything). Per-model parameters beat top-level ones;
a filter list that matches nothing falls through to the next level, then to the method's default.

The ``slices:`` form (mergekit's layer ranges: "frankenmerges" with ``passthrough``, or any method
over ranges of several models): each slice lists ``sources`` (``model``, ``layer_range: [start,
end)``, optional ``parameters``) and optional ``parameters``; see :mod:`mlx_ssp.merge.slices`.
``out_quantization: {bits, group_size, mode}`` re-quantizes the output with mlx's quantization
(:mod:`mlx_ssp.merge.quant`); it is not a mergekit key.

Deviations from mergekit: ``modules:`` and a slice's own ``base_model`` / ``residual_weight`` are
not supported; unknown keys, methods and parameters are errors listing the valid ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

import mlx_ssp.merge.passthrough  # noqa: F401  (registers passthrough in METHODS)
from mlx_ssp.config import StrictModel, apply_overrides, format_validation_error, read_yaml
from mlx_ssp.errors import UserError
from mlx_ssp.merge.methods import METHOD_PARAM_TYPES, METHODS, RESCALE_MODES, SIGN_VOTES
from mlx_ssp.merge.quant import MODE_PAIRS

Scalar = Union[bool, int, float, str]


class Conditional(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # finite floats, as in every StrictModel
    value: Union[Scalar, list[Scalar]]
    filter: Optional[str] = None


Setting = Union[Scalar, list[Scalar], Conditional, list[Conditional]]
DTypeName = Literal["float32", "bfloat16", "float16"]
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16",
                  "half": "float16", "float": "float32"}


def _dtype(v):
    if isinstance(v, str):
        return _DTYPE_ALIASES.get(v.lower(), v.lower())
    return v


def _known_method(what: str):
    def check(v: str) -> str:
        if v not in METHODS:
            raise ValueError(f"unknown {what} '{v}'; valid methods: {', '.join(METHODS)}")
        return v
    return check


#: a dtype name or alias (bf16, fp32, half, ...), the same in both config forms
DType = Annotated[Optional[DTypeName], BeforeValidator(_dtype)]


class ModelEntry(StrictModel):
    model: str
    parameters: Optional[dict[str, Setting]] = None


class SliceSource(StrictModel):
    """One input of an output slice: layers ``layer_range[0] .. layer_range[1] - 1`` of ``model``."""

    model: str
    layer_range: tuple[int, int]
    parameters: Optional[dict[str, Setting]] = None

    @field_validator("layer_range")
    @classmethod
    def _range(cls, v):
        if not 0 <= v[0] < v[1]:
            raise ValueError(f"layer_range must be [start, end) with 0 <= start < end, got {list(v)}")
        return v


class OutputSlice(StrictModel):
    """A run of output layers merged from its sources' layer ranges (one source for ``passthrough``)."""

    sources: list[SliceSource]
    parameters: Optional[dict[str, Setting]] = None

    @field_validator("sources")
    @classmethod
    def _nonempty(cls, v):
        if not v:
            raise ValueError("sources must list at least one model")
        return v


class OutQuantization(StrictModel):
    """``out_quantization``: mlx quantization of the output's linear and embedding weights. ``affine``
    takes bits 2-8 and group size 32 / 64 / 128 (default 4 / 64); each float mode has one pair (its
    default)."""

    mode: Literal["affine", "mxfp4", "nvfp4", "mxfp8"] = "affine"
    bits: Literal[2, 3, 4, 5, 6, 8] = 4
    group_size: Literal[16, 32, 64, 128] = 64

    @model_validator(mode="before")
    @classmethod
    def _mode_defaults(cls, data):
        if isinstance(data, dict) and data.get("mode", "affine") in MODE_PAIRS:
            bits, gs = MODE_PAIRS[data.get("mode", "affine")]
            data = {"bits": bits, "group_size": gs, **data}
        return data

    @model_validator(mode="after")
    def _mode_pair(self):
        if self.mode == "affine" and self.group_size == 16:
            raise ValueError("group_size 16 is for mode nvfp4 only; affine takes 32, 64 or 128")
        if self.mode != "affine" and (self.bits, self.group_size) != MODE_PAIRS[self.mode]:
            bits, gs = MODE_PAIRS[self.mode]
            raise ValueError(f"mode {self.mode} takes bits {bits} and group_size {gs} only")
        return self


class ZeroEmbedding(StrictModel):
    """``{kind: zero}``: the token's rows are zeros."""

    kind: Literal["zero"]


class ModelTokenEmbedding(StrictModel):
    """``{kind: model_token, model, token_id | token}``: the rows of one token of one model (its
    own id there, or looked up by string in its tokenizer)."""

    kind: Literal["model_token"]
    model: str
    token_id: Optional[int] = Field(default=None, ge=0)
    token: Optional[str] = None

    @model_validator(mode="after")
    def _one_of(self):
        if (self.token_id is None) == (self.token is None):
            raise ValueError("give exactly one of token_id or token")
        return self


_SOURCE_KINDS = {"zero": ZeroEmbedding, "model_token": ModelTokenEmbedding}


class TokenEmbedding(StrictModel):
    """One entry of ``tokenizer.tokens``: where the token's embedding / LM-head rows come from
    (a model reference: that model's row of the token; None: mergekit's automatic rule) and
    whether every model takes them (``force``) even when it has the token."""

    source: Union[ZeroEmbedding, ModelTokenEmbedding, str, None] = None
    force: bool = False

    @field_validator("source", mode="before")
    @classmethod
    def _kind(cls, v):
        # a dict is one of the two kinds: name them (pydantic's union error would not)
        if isinstance(v, dict):
            kind = v.get("kind")
            if kind not in _SOURCE_KINDS:
                raise ValueError(f"source kind must be one of {', '.join(_SOURCE_KINDS)}, got {kind!r}")
            return _SOURCE_KINDS[kind].model_validate(v)
        return v

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data):
        # entries are keyed by token strings, where the generic message cannot find the valid keys
        if isinstance(data, dict):
            unknown = sorted(set(data) - {"source", "force"})
            if unknown:
                raise ValueError(f"unknown key(s) {', '.join(unknown)}; valid keys: force, source")
        return data


class TokenizerConfig(StrictModel):
    """mergekit's ``tokenizer:`` section: the output vocabulary (``source``: ``union`` (default),
    ``base`` or a model), tokens to add or to give chosen rows (``tokens``), and the embedding rows
    padded to a multiple of ``pad_to_multiple_of`` (each model's pad rows: the mean of its rows)."""

    source: str = "union"
    tokens: Optional[dict[str, TokenEmbedding]] = None
    pad_to_multiple_of: Optional[int] = Field(default=None, ge=1)


class MergeConfig(StrictModel):
    """A mergekit YAML file: the ``models:`` form, or the ``slices:`` form (layer ranges)."""

    models: Optional[list[ModelEntry]] = None
    slices: Optional[list[OutputSlice]] = None
    merge_method: Annotated[str, AfterValidator(_known_method("merge_method"))]
    base_model: Optional[str] = None
    parameters: Optional[dict[str, Setting]] = None
    dtype: DType = None
    out_dtype: DType = None
    tokenizer_source: Optional[str] = None
    tokenizer: Optional[TokenizerConfig] = None
    out_quantization: Optional[OutQuantization] = None

    @field_validator("models", "slices")
    @classmethod
    def _nonempty(cls, v, info):
        if v is not None and not v:
            raise ValueError(f"{info.field_name} must list at least one {'model' if info.field_name == 'models' else 'slice'}")
        return v

    @model_validator(mode="after")
    def _one_form(self):
        if (self.models is None) == (self.slices is None):
            raise ValueError("give exactly one of models: (a merge) or slices: (layer surgery)")
        if self.tokenizer_source is not None and self.tokenizer is not None:
            raise ValueError("give tokenizer_source or tokenizer (its source key), not both (as in mergekit)")
        return self

    def tokenizer_settings(self) -> Optional[TokenizerConfig]:
        """The tokenizer surgery asked for (``tokenizer:``, or ``tokenizer_source`` alone); None:
        none (the reference's tokenizer files are copied)."""
        if self.tokenizer is not None:
            return self.tokenizer
        return None if self.tokenizer_source is None else TokenizerConfig(source=self.tokenizer_source)


# ------------------------------------------------------------ parameter values

PARAM_TYPES: dict[str, type] = {
    "weight": float, "density": float, "gamma": float, "lambda": float,
    "normalize": bool, "rescale": bool, "int8_mask": bool, "sign_vote": str, "rescale_mode": str,
    "scale": float,
}
PARAM_TYPES.update(METHOD_PARAM_TYPES)  # slerp, della, model_stock, ... (methods.py owns them)
CHOICES = {"sign_vote": SIGN_VOTES, "rescale_mode": RESCALE_MODES}


def _validate_value(name: str, v: Any, where: str) -> Any:
    typ = PARAM_TYPES[name]
    if typ is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if isinstance(v, (int, float)) and v in (0, 1):
            return bool(v)
    elif typ is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                pass
    elif typ is str and isinstance(v, str):
        if v not in CHOICES[name]:
            raise UserError(f"{where}: {name} must be one of {', '.join(CHOICES[name])}, got '{v}'")
        return v
    raise UserError(f"{where}: {name} must be a {typ.__name__}, got {v!r}")


def evaluate(name: str, setting: Any, tensor: str, t: float, where: str) -> Any:
    """Resolve one parameter setting for one tensor (mergekit's rules). None: no filter matched."""
    if isinstance(setting, Conditional):
        setting = [setting]
    if isinstance(setting, (bool, int, float, str)):
        return _validate_value(name, setting, where)
    if isinstance(setting, list):
        if not setting:
            return None
        if all(isinstance(e, (bool, int, float, str)) for e in setting):
            vals = [_validate_value(name, e, where) for e in setting]
            if not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in vals):
                return vals[int(t * (len(vals) - 1))]
            x = t * (len(vals) - 1)
            i0 = int(x)
            i1 = min(len(vals) - 1, i0 + 1)
            f = x - i0
            return _validate_value(name, (1 - f) * vals[i0] + f * vals[i1], where)
        for cond in setting:
            if not isinstance(cond, Conditional):
                raise UserError(f"{where}: {name}: a list must hold only numbers or only {{filter, value}} items")
            if cond.filter is None or cond.filter == "*" or (tensor and cond.filter in tensor):
                return evaluate(name, cond.value, tensor, t, where)
        return None
    raise UserError(f"{where}: unexpected value for {name}: {setting!r}")


def check_parameter_names(cfg, source: str) -> None:
    """Unknown parameter names (top level or per model) are errors listing the valid ones (``cfg``:
    a :class:`MergeConfig`, or any config with ``merge_method``, ``parameters`` and ``models``)."""
    spec = METHODS[cfg.merge_method]
    valid_top = set(spec.shared_params) | set(spec.model_params)
    for k in cfg.parameters or {}:
        if k not in valid_top:
            raise UserError(f"{source}: unknown parameter '{k}' for {spec.name}; valid: {', '.join(sorted(valid_top))}")
    entries = [(f"model {m.model}", m.parameters, spec.model_params) for m in cfg.models or []]
    for i, sl in enumerate(getattr(cfg, "slices", None) or []):
        entries.append((f"slices[{i}]", sl.parameters, tuple(sorted(valid_top))))
        entries += [(f"slices[{i}] model {s.model}", s.parameters, spec.model_params) for s in sl.sources]
    for where, params, valid in entries:
        for k in params or {}:
            if k not in valid:
                raise UserError(f"{source}: {where}: unknown parameter '{k}' for {spec.name}; "
                                f"valid here: {', '.join(valid) or '(none)'}")


def resolve(name: str, scopes: list[Optional[dict]], tensor: str, t: float, default: Any, where: str) -> Any:
    """First scope that sets ``name`` (and whose filters match) wins; else ``default``."""
    for scope in scopes:
        if scope and name in scope:
            v = evaluate(name, scope[name], tensor, t, where)
            if v is not None:
                return v
    return default


def load_merge_config(path: str | Path, overrides: tuple[str, ...] = ()) -> tuple[MergeConfig, str]:
    """Read and validate a mergekit YAML; returns (config, the YAML text to save beside the output)."""
    import yaml

    data = read_yaml(path)
    data = apply_overrides(data, overrides)
    from pydantic import ValidationError

    try:
        cfg = MergeConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, MergeConfig, str(path))) from None
    check_parameter_names(cfg, str(path))
    return cfg, yaml.safe_dump(data, sort_keys=False)


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def layer_index(tensor: str) -> Optional[int]:
    m = _LAYER.search(tensor)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------ the pipeline's merge: section


class MergeStageConfig(StrictModel):
    """The ``merge:`` section of a run file: how the pipeline merges its fused specialists.

    The models are the specialists the run produced; ``base_model`` defaults to the run's model.
    ``weights`` / ``density`` are per specialist (one value for all, or a list in specialist order).
    ``parameters`` holds any other mergekit top-level parameter (normalize, rescale, lambda, ...)."""

    method: Annotated[str, AfterValidator(_known_method("merge method"))] = "linear"
    base_model: Optional[str] = None
    weights: Optional[Union[float, list[float]]] = None
    density: Optional[Union[float, list[float]]] = None
    parameters: dict[str, Any] = {}
    dtype: DType = None
    out_dtype: DType = None
    seed: Optional[int] = None
    out_shard_size: str = "5GB"
    vocab_mismatch: Literal["error", "truncate", "pad"] = "error"
    copy_tokenizer: bool = True
    #: tensors merged side by side (None: 2 on the CPU, 1 on a GPU); the output does not depend on it
    workers: Optional[int] = Field(default=None, ge=1)
    #: store the merged model MLX-quantized (``{bits, group_size, mode}``); None: float
    out_quantization: Optional[OutQuantization] = None

    OMIT_AT_DEFAULT = frozenset({"out_quantization"})  # added after runs existed: old fingerprints kept
