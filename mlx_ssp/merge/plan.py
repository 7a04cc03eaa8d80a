"""Plan a merge: open and check every input, resolve every tensor's dtypes and parameters; writes
nothing, so any bad input stops the merge before a byte is written, with a message naming the
tensor and the model.

Every model must have the same layer count and the same tensor names (the union: a tensor only some
models have is an error, never dropped). Then for every tensor, in the file order of the reference
model (the base, else the first model): each input has the same shape (vocabulary rows per
``vocab_mismatch``); the compute dtype is ``dtype``, else the widest input dtype, the output dtype
``out_dtype``, else the compute dtype; every parameter is resolved (filters, gradients, defaults).
With tokenizer surgery (``tokenizer_source`` / ``tokenizer:``, :mod:`.tokenizer`) the vocabulary-sized
tensors (embedding, LM head: a :data:`VOCAB_HINTS` name outside the layers) may have any rows (at
least the model's ``vocab_size``) and are planned with the output vocabulary's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mlx_ssp.errors import UserError
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.config import MergeConfig, check_parameter_names, layer_index, resolve
from mlx_ssp.merge.methods import METHODS, MethodSpec
from mlx_ssp.merge.passthrough import MAX_INPUTS
from mlx_ssp.merge.quant import quantized_names
from mlx_ssp.merge.sources import Source, open_source, read_model_config
from mlx_ssp.merge.tokenizer import plan_vocab

VOCAB_HINTS = ("embed_tokens", "lm_head", "wte", "embed_out", "word_embeddings", "output.weight")
_WIDTH = {"F16": 1, "BF16": 1, "F32": 2, "F64": 3}


@dataclass
class TensorPlan:
    """One output tensor: its inputs, dtypes and resolved parameters (or a copy of the reference's)."""

    name: str
    inputs: list[int]  # indices into sources (non-base inputs for task-vector methods)
    base: Optional[int]
    shape: tuple[int, ...]
    cd: str  # compute dtype name
    out: str  # safetensors dtype code
    params: dict[str, Any] = field(default_factory=dict)
    per_model: list[dict[str, Any]] = field(default_factory=list)
    copy: bool = False  # non-float tensor: copied from the reference (``slices:``: from ``inputs[0]``)
    #: source index -> its tensor's name, where it is not ``name`` (``slices:``: a renumbered layer)
    src_names: Optional[dict[int, str]] = None
    quant: Optional[tuple[int, int, str]] = None  # ``out_quantization``: (bits, group_size, mode) to store it with
    vocab: bool = False  # tokenizer surgery: the inputs' rows are aligned to the output vocabulary on read


@dataclass
class MergeJob:
    """The whole merge: the config, the opened inputs and one plan per output tensor."""

    cfg: MergeConfig
    sources: list[Source]
    base: Optional[int]
    inputs: list[int]
    reference: int
    plans: list[TensorPlan]
    ref_config: dict
    n_layers_out: Optional[int] = None  # ``slices:``: the output's layer count (else the reference's)
    vocab: Any = None  # tokenizer surgery: the :class:`.tokenizer.VocabPlan` (None: none)


def base_output_config(job: MergeJob) -> dict:
    """The reference's ``config.json`` with the output's layer count and no input quantization."""
    conf = {k: v for k, v in job.ref_config.items() if k not in ("quantization", "quantization_config")}
    if job.n_layers_out is not None:
        keys = [k for k in ("num_hidden_layers", "n_layer") if k in conf] or ["num_hidden_layers"]
        conf.update({k: job.n_layers_out for k in keys})
    if job.vocab is not None:  # mergekit: the output tokenizer's size, padded
        conf["vocab_size"] = job.vocab.rows
    return conf


def mark_out_quantization(job: MergeJob) -> MergeJob:
    """With ``out_quantization``, the weights mlx-lm would quantize (:func:`.quant.quantized_names`)
    are stored quantized."""
    oq = job.cfg.out_quantization
    if oq is None:
        return job

    names = quantized_names([(p.name, p.shape) for p in job.plans if not p.copy], base_output_config(job),
                            oq.group_size)
    for p in job.plans:
        if p.name in names:
            p.quant = (oq.bits, oq.group_size, oq.mode)
    return job


def code_name(code: str) -> str:
    """The dtype name of a safetensors dtype code (``BF16`` -> ``bfloat16``)."""
    return sio.DTYPES[code][2]


def layer_count(src: Source, conf: dict) -> int:
    """``num_hidden_layers`` (or GPT-2's ``n_layer``), else one more than the largest layer index
    among the tensor names."""
    n = conf.get("num_hidden_layers") or conf.get("n_layer")
    if n:
        return int(n)
    idx = [layer_index(name) for name in src.tensors]
    return max([i for i in idx if i is not None], default=0) + 1


def check_layer_counts(sources: list[Source], configs: list[dict]) -> None:
    """Models with different layer counts cannot be merged tensor by tensor (layer surgery is the
    ``slices:`` form, :mod:`.slices`): an error naming each count."""
    counts = [layer_count(s, c) for s, c in zip(sources, configs)]
    if len(set(counts)) > 1:
        each = ", ".join(f"{n} in {s.ref}" for s, n in zip(sources, counts))
        raise UserError(f"the models have different layer counts (num_hidden_layers: {each}); only models with "
                        "the same layers can be merged (slices: with passthrough stacks layers)")


def _tied(conf: dict) -> bool:
    return bool(conf.get("tie_word_embeddings"))


def check_same_tensors(sources: list[Source], configs: list[dict], reference: int) -> None:
    """Every tensor of every input must be in every input (the output has each exactly once):
    otherwise an error naming the first such tensor (reference file order, then by name), the
    models that lack it and those that have it. mergekit has no rule that fills a missing tensor
    in this engine's scope; an lm_head that only some models have (tied embeddings in the
    others) gets a hint."""
    ref = sources[reference]
    others = sorted({n for s in sources for n in s.tensors} - set(ref.tensors))
    bad = [(n, [i for i, s in enumerate(sources) if n not in s.tensors])
           for n in [*sio.iter_names(ref.tensors), *others]]
    bad = [(n, lack) for n, lack in bad if lack]
    if not bad:
        return
    name, lack = bad[0]
    have = [s.ref for s in sources if name in s.tensors]
    msg = (f"tensor '{name}' is missing from model{'s' if len(lack) > 1 else ''} "
           f"{', '.join(sources[i].ref for i in lack)} (present in {', '.join(have)})")
    tied = [sources[i].ref for i in lack if _tied(configs[i])]
    if "lm_head" in name and tied:
        msg += (f"; {', '.join(tied)} tie{'s' if len(tied) == 1 else ''} lm_head to the input embeddings "
                "(tie_word_embeddings): merge only tied or only untied models")
    if len(bad) > 1:
        msg += f"; {len(bad) - 1} more tensor(s) are not in every model"
    raise UserError(msg + "; every model must have the same tensors")



def _model_refs(cfg: MergeConfig, spec: MethodSpec, source_label: str) -> tuple[list[str], Optional[int]]:
    """The input references (each once; the base appended when it is not listed, as mergekit adds
    it as an input) and the index of the base (None: no base)."""
    if spec.needs_base and not cfg.base_model:
        raise UserError(f"{source_label}: merge_method {spec.name} needs base_model (the model the task vectors "
                        "are taken from)")
    refs: list[str] = []
    for m in cfg.models:
        if m.model in refs:
            raise UserError(f"{source_label}: model {m.model} is listed twice")
        refs.append(m.model)
    if cfg.base_model and cfg.base_model not in refs:
        refs.append(cfg.base_model)
    return refs, (refs.index(cfg.base_model) if cfg.base_model else None)


def check_shape(name: str, s: Source, ref_src: Source, vocab_mismatch: str) -> None:
    """Model ``s``'s tensor ``name`` has the reference's shape, or (a vocabulary-sized tensor)
    rows that ``vocab_mismatch`` may truncate or pad to the reference's."""
    info, rinfo = s.tensors[name], ref_src.tensors[name]  # present: check_same_tensors
    if info.shape == rinfo.shape:
        return
    vocab_like = (len(info.shape) == len(rinfo.shape) and info.shape[1:] == rinfo.shape[1:]
                  and any(h in name for h in VOCAB_HINTS))
    if not vocab_like:
        raise UserError(f"tensor '{name}': shape {list(info.shape)} in model {s.ref} does not match "
                        f"{list(rinfo.shape)} in {ref_src.ref}")
    if vocab_mismatch == "error" or (vocab_mismatch == "truncate" and info.shape[0] < rinfo.shape[0]) \
            or (vocab_mismatch == "pad" and info.shape[0] > rinfo.shape[0]):
        fix = "truncate" if info.shape[0] > rinfo.shape[0] else "pad"
        raise UserError(f"tensor '{name}': vocabulary size {info.shape[0]} in model {s.ref} differs from "
                        f"{rinfo.shape[0]} in {ref_src.ref}; pass --vocab-mismatch {fix} to {fix} "
                        f"to the reference's rows")


def is_vocab_tensor(name: str) -> bool:
    """An embedding / LM-head tensor (rows indexed by token id): a vocabulary name outside the layers."""
    return layer_index(name) is None and any(h in name for h in VOCAB_HINTS)


def check_vocab_shape(name: str, s: Source, si: int, ref_src: Source, vp) -> None:
    """Under tokenizer surgery: the non-vocabulary dimensions match the reference's, and the
    model has a row for each id below its ``vocab_size``."""
    info, rinfo = s.tensors[name], ref_src.tensors[name]
    if len(info.shape) != len(rinfo.shape) or info.shape[1:] != rinfo.shape[1:]:
        raise UserError(f"tensor '{name}': shape {list(info.shape)} in model {s.ref} does not match "
                        f"{list(rinfo.shape)} in {ref_src.ref} beyond the vocabulary rows")
    if info.shape[0] < vp.limits[si]:
        raise UserError(f"tensor '{name}': {info.shape[0]} rows in model {s.ref}, fewer than its vocab_size "
                        f"{vp.limits[si]}")


def tensor_dtypes(codes: list[str], cfg: MergeConfig) -> tuple[str, str]:
    """(compute dtype name, output safetensors code): ``dtype``, else the widest input dtype (torch
    promotes bf16 + fp16 to float32; float64 computes in float32); ``out_dtype``, else the compute
    dtype."""
    widest = max(codes, key=lambda c: _WIDTH[c])
    if {"F16", "BF16"} <= set(codes) and widest in ("F16", "BF16"):
        widest = "F32"
    cd = cfg.dtype or ("float32" if widest == "F64" else code_name(widest))
    return cd, sio.CODE_OF[cfg.out_dtype or cd]


def layer_position(name: str, n_layers: int) -> float:
    """mergekit's gradient position ``t = i / (L - 1)`` of a layer's tensor; 0 outside the layers."""
    li = layer_index(name)
    if li is None:
        return 0.0
    return li / (n_layers - 1) if n_layers > 1 else 1.0


def resolve_shared(spec: MethodSpec, top: dict, name: str, t: float,
                   scopes: Optional[list] = None) -> dict[str, Any]:
    """The method's shared parameters for one tensor (``scopes``, by default the top level; else
    the defaults)."""
    defaults = dict(spec.defaults)
    where = f"tensor '{name}'"
    scopes = [top] if scopes is None else scopes
    shared = {p: resolve(p, scopes, name, t, defaults.get(p), where) for p in spec.shared_params}
    if shared.get("normalize") is None:
        shared["normalize"] = spec.default_normalize
    if shared.get("rescale") is None and "rescale" in spec.shared_params:
        shared["rescale"] = spec.default_rescale
    return shared


def resolve_per_model(spec: MethodSpec, scopes: list, name: str, t: float, ref: str) -> dict[str, Any]:
    """One model's parameters for one tensor (its own, then the top level, then the defaults),
    range-checked."""
    defaults = dict(spec.defaults)
    mw = f"tensor '{name}' of model {ref}"
    pm = {p: resolve(p, scopes, name, t, defaults.get(p), mw) for p in spec.model_params}
    if "weight" in spec.model_params and pm.get("weight") is None:
        raise UserError(f"{mw}: no weight given (set parameters.weight for the model or at the top level)")
    if "density" in pm and not (0 < pm["density"] <= 1):
        raise UserError(f"{mw}: density {pm['density']} is outside (0, 1]")
    if "gamma" in pm and not (0 <= pm["gamma"] < 1):
        raise UserError(f"{mw}: gamma {pm['gamma']} is outside [0, 1)")
    return pm


def check_weight_sum(spec: MethodSpec, shared: dict, per_model: list[dict], name: str, refs: list[str]) -> None:
    """normalize divides by the weights' sum: a zero sum is an error naming the models."""
    if shared["normalize"] and "weight" in spec.model_params and abs(sum(pm["weight"] for pm in per_model)) < 1e-8:
        raise UserError(f"tensor '{name}': the weights of models {', '.join(refs)} sum to zero, so normalize cannot "
                        "divide by them (set normalize: false or change the weights)")


def plan_tensor(job: MergeJob, spec: MethodSpec, name: str, n_layers: int, vocab_mismatch: str) -> TensorPlan:
    """Check and resolve one tensor (see the module docstring); a non-float tensor is copied from
    the reference."""
    cfg, sources = job.cfg, job.sources
    ref_src = sources[job.reference]
    rinfo = ref_src.tensors[name]
    base = job.base if spec.needs_base else None
    involved = ([base] if spec.needs_base else []) + job.inputs
    # a vocabulary name whose rows cover the reference's vocabulary (not e.g. BLOOM's word_embeddings_layernorm)
    vocab = (job.vocab is not None and is_vocab_tensor(name) and len(rinfo.shape) >= 1
             and rinfo.shape[0] >= job.vocab.limits[job.reference])
    for i in involved:
        if vocab:
            check_vocab_shape(name, sources[i], i, ref_src, job.vocab)
        else:
            check_shape(name, sources[i], ref_src, vocab_mismatch)
    codes = [sources[i].tensors[name].dtype for i in involved]
    if not all(c in sio.FLOAT_CODES for c in codes):
        if vocab:
            raise UserError(f"tensor '{name}' is not a float tensor, so its rows cannot follow the new vocabulary")
        return TensorPlan(name, [], None, rinfo.shape, "float32", rinfo.dtype, copy=True)
    cd, out = tensor_dtypes(codes, cfg)
    t = layer_position(name, n_layers)
    top = cfg.parameters or {}
    shared = resolve_shared(spec, top, name, t)
    entry_params = {m.model: m.parameters for m in cfg.models}
    per_model = [resolve_per_model(spec, [entry_params.get(sources[i].ref), top], name, t, sources[i].ref)
                 for i in job.inputs]
    check_weight_sum(spec, shared, per_model, name, [sources[i].ref for i in job.inputs])
    shape = (job.vocab.rows, *rinfo.shape[1:]) if vocab else rinfo.shape
    return TensorPlan(name, job.inputs, base, shape, cd, out, shared, per_model, vocab=vocab)


def check_merge_config(cfg: MergeConfig, *, vocab_mismatch: str = "error", source_label: str = "config") -> None:
    """What a config must satisfy before either form is planned (parameter names, tokenizer
    options against ``slices:`` and ``--vocab-mismatch``): one line naming the problem."""
    check_parameter_names(cfg, source_label)
    tok_cfg = cfg.tokenizer_settings()
    if cfg.slices is not None and (cfg.tokenizer is not None or cfg.tokenizer_source == "union"):
        raise UserError(f"{source_label}: tokenizer surgery (tokenizer:, tokenizer_source: union) is not supported "
                        "with slices: (tokenizer_source base or a model copies that model's tokenizer there)")
    if tok_cfg is not None and cfg.slices is None and vocab_mismatch != "error":
        raise UserError(f"{source_label}: --vocab-mismatch {vocab_mismatch} does not apply with tokenizer_source / "
                        "tokenizer: (the rows follow the output vocabulary)")


def plan_models(cfg: MergeConfig, *, vocab_mismatch: str = "error", source_label: str = "config") -> MergeJob:
    """The ``models:`` form (the ``slices:`` form is :func:`.slices.plan_slices`; both checked by
    :func:`check_merge_config` first, dispatched by :func:`.engine.plan_merge`): open every model,
    check every tensor and resolve every parameter; writes nothing."""
    tok_cfg = cfg.tokenizer_settings()
    spec = METHODS[cfg.merge_method]
    refs, base = _model_refs(cfg, spec, source_label)
    limit = MAX_INPUTS.get(spec.name)
    if limit is not None and len(refs) > limit:
        raise UserError(f"{source_label}: merge_method {spec.name} takes at most {limit} model, got {len(refs)}")
    sources = [open_source(r) for r in refs]
    # task-vector methods take deltas from the base; for linear the base (if any) is just an input
    inputs = [i for i in range(len(refs)) if not (spec.needs_base and i == base)]
    reference = base if base is not None else 0
    configs = [read_model_config(s) for s in sources]
    check_layer_counts(sources, configs)
    check_same_tensors(sources, configs, reference)
    job = MergeJob(cfg, sources, base, inputs, reference, [], configs[reference])
    if tok_cfg is not None:
        job.vocab = plan_vocab(tok_cfg, sources, configs, base, reference)
    n_layers = layer_count(sources[reference], configs[reference])
    job.plans = [plan_tensor(job, spec, name, n_layers, vocab_mismatch)
                 for name in sio.iter_names(sources[reference].tensors)]
    return mark_out_quantization(job)
