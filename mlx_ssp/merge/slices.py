"""The ``slices:`` form: layer ranges as mergekit 0.1.5's ``MergePlanner`` plans them (``plan.py``:
``plan_module`` / ``plan_slice`` / ``plan_layer``): "frankenmerges" with ``passthrough``, or any
method over ranges of several models (the form most SLERP recipes on the hub are written in).

Each output slice merges, layer by layer, its sources' ``layer_range = [start, end)`` (all of the
same length; the base among them for a task-vector method); the output's layers are the slices'
layers in order, renumbered from 0 (``model.layers.{start + j}.*`` of a source of slice k feeds
``model.layers.{offset_k + j}.*``), and ``num_hidden_layers`` in ``config.json`` is their total.
Slices may overlap and may come from different models (same layer shapes). Tensors outside the
layers are merged, as in mergekit, from the *first* slice's sources when they precede the layers
(the input embeddings) and from the *last* slice's sources when they follow them (final norm, LM
head). Gradients run over each slice (``t = j / (n - 1)``, ``t = 1`` for a one-layer slice);
tensors outside the layers get ``t = 0``. Parameters: the source's, then the slice's, then the top
level (shared ones: the slice's, then the top level). One slice over every model's full range is
the ``models:`` form, byte for byte (the models in the same order).
``config.json`` is the base model's when ``base_model`` is given, else the first slice source's;
its per-layer lists (:data:`PER_LAYER_KEYS`) are rebuilt from the slices. The vocabulary-sized
tensors (embeddings from the first slice, LM head from the last) must have the same rows.

Deviations from mergekit: it reads the pre/post split from per-architecture JSON files; here a
tensor outside the layers is "pre" when its name contains an input-embedding name
(:data:`PRE_HINTS`), else "post". mergekit takes ``config.json`` from an unordered set of the
models when no ``base_model`` is given; here it is the first slice's. mergekit neither rebuilds
``layer_types`` nor checks the vocabularies. A slice's own ``base_model`` / ``residual_weight`` and
``--vocab-mismatch`` are not supported here (every source's tensors must have the same shape).
"""

from __future__ import annotations

from mlx_ssp.errors import UserError
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.config import _LAYER, MergeConfig, layer_index
from mlx_ssp.merge.methods import METHODS
from mlx_ssp.merge.passthrough import MAX_INPUTS
from mlx_ssp.merge.plan import (MergeJob, is_vocab_tensor, TensorPlan, check_weight_sum, layer_count,
                                mark_out_quantization, resolve_per_model, resolve_shared, tensor_dtypes)
from mlx_ssp.merge.sources import open_source, read_model_config

#: names of tensors that come before the layers (the input embeddings of the architectures mlx-lm reads)
PRE_HINTS = ("embed_tokens", "wte", "wpe", "word_embeddings", "embed_in", "tok_embeddings", "embeddings")


def rename_layer(name: str, index: int) -> str:
    """``name`` with its layer index replaced by ``index``."""
    m = _LAYER.search(name)
    return name[: m.start(1)] + str(index) + name[m.end(1):]


def is_pre(name: str) -> bool:
    return any(h in name for h in PRE_HINTS)


def slice_layout(slices: list[tuple[int, int]]) -> list[tuple[int, int, int, float]]:
    """(slice number, input layer, output layer, gradient t) for every output layer, in order."""
    rows, out = [], 0
    for k, (a, b) in enumerate(slices):
        n = b - a
        for j in range(n):
            rows.append((k, a + j, out, j / (n - 1) if n > 1 else 1.0))
            out += 1
    return rows


def _layer_names(tensors: dict) -> dict[int, list[str]]:
    """Layer index -> its tensor names, in file order."""
    by: dict[int, list[str]] = {}
    for n in sio.iter_names(tensors):
        li = layer_index(n)
        if li is not None:
            by.setdefault(li, []).append(n)
    return by


def _check_slices(cfg: MergeConfig, spec, source_label: str) -> None:
    """Per slice: at most the method's input count, each model once, equal layer counts, and the
    base among the sources when the method takes task vectors from it."""
    limit = MAX_INPUTS.get(spec.name)
    if spec.needs_base and not cfg.base_model:
        raise UserError(f"{source_label}: merge_method {spec.name} needs base_model (one of each slice's sources)")
    for i, sl in enumerate(cfg.slices):
        where = f"{source_label}: slices[{i}]"
        models = [s.model for s in sl.sources]
        if limit is not None and len(models) > limit:
            raise UserError(f"{where}: {spec.name} takes {limit} source per slice, got {len(models)}")
        if len(set(models)) < len(models):
            raise UserError(f"{where}: a model is listed twice among the sources")
        if len({b - a for a, b in (s.layer_range for s in sl.sources)}) > 1:
            raise UserError(f"{where}: every source must span the same number of layers, got "
                            f"{', '.join(f'{s.model} {list(s.layer_range)}' for s in sl.sources)}")
        if spec.needs_base and cfg.base_model not in models:
            raise UserError(f"{where}: base_model {cfg.base_model} is not among the slice's sources "
                            f"({', '.join(models)})")


def plan_slices(cfg: MergeConfig, *, vocab_mismatch: str = "error", source_label: str = "config") -> MergeJob:
    """Open every slice's sources, check the ranges and plan every output tensor (see the module
    docstring); writes nothing."""
    spec = METHODS[cfg.merge_method]
    if vocab_mismatch != "error":
        raise UserError(f"{source_label}: --vocab-mismatch {vocab_mismatch} is not supported with slices: (every "
                        "source's tensors must have the same shape)")
    _check_slices(cfg, spec, source_label)
    refs: list[str] = []
    for sl in cfg.slices:
        refs += [s.model for s in sl.sources if s.model not in refs]
    if cfg.base_model and cfg.base_model not in refs:
        refs.append(cfg.base_model)
    sources = [open_source(r) for r in refs]
    configs = [read_model_config(s) for s in sources]
    by_ref = {r: i for i, r in enumerate(refs)}
    layers = [_layer_names(s.tensors) for s in sources]
    for i, sl in enumerate(cfg.slices):
        for s in sl.sources:
            si = by_ref[s.model]
            n = layer_count(sources[si], configs[si])
            if s.layer_range[1] > n:
                raise UserError(f"{source_label}: slices[{i}]: layer_range {list(s.layer_range)} of model {s.model} "
                                f"goes past its {n} layers")
    reference = by_ref[cfg.base_model] if cfg.base_model else by_ref[cfg.slices[0].sources[0].model]
    base = by_ref[cfg.base_model] if spec.needs_base else None
    job = MergeJob(cfg, sources, base, [], reference, [], configs[reference])
    top = cfg.parameters or {}

    def plan(out_name: str, sl, names: list[str], t: float) -> TensorPlan:
        """One output tensor from tensor ``names[j]`` of the slice's source j."""
        members = [by_ref[s.model] for s in sl.sources]
        infos = []
        for si, n in zip(members, names):
            info = sources[si].tensors.get(n)
            if info is None:
                raise UserError(f"tensor '{n}' is missing from model {refs[si]}")
            if info.shape != sources[members[0]].tensors[names[0]].shape:
                raise UserError(f"tensor '{n}': shape {list(info.shape)} in model {refs[si]} does not match "
                                f"{list(sources[members[0]].tensors[names[0]].shape)} of '{names[0]}' in "
                                f"{refs[members[0]]}")
            infos.append(info)
        src_names = {si: n for si, n in zip(members, names) if n != out_name} or None
        first = infos[members.index(base)] if base is not None else infos[0]
        if not all(i.dtype in sio.FLOAT_CODES for i in infos):  # copied from the base, else the first source
            si = base if base is not None else members[0]
            return TensorPlan(out_name, [si], None, first.shape, "float32", first.dtype, copy=True, src_names=src_names)
        cd, out = tensor_dtypes([i.dtype for i in infos], cfg)
        shared = resolve_shared(spec, top, out_name, t, scopes=[sl.parameters, top])
        inputs = [si for si in members if si != base]
        params = {by_ref[s.model]: s.parameters for s in sl.sources}
        per_model = [resolve_per_model(spec, [params[si], sl.parameters, top], out_name, t, refs[si]) for si in inputs]
        check_weight_sum(spec, shared, per_model, out_name, [refs[si] for si in inputs])
        return TensorPlan(out_name, inputs, base, first.shape, cd, out, shared, per_model, src_names=src_names)

    first, last = cfg.slices[0], cfg.slices[-1]
    outside = lambda sl: [n for n in sio.iter_names(sources[by_ref[sl.sources[0].model]].tensors)  # noqa: E731
                          if layer_index(n) is None]
    plans = [plan(n, first, [n] * len(first.sources), 0.0) for n in outside(first) if is_pre(n)]
    for k, li, lo, t in slice_layout([tuple(sl.sources[0].layer_range) for sl in cfg.slices]):
        sl = cfg.slices[k]
        offset = li - sl.sources[0].layer_range[0]
        si0 = by_ref[sl.sources[0].model]
        names0 = layers[si0].get(li)
        if not names0:
            raise UserError(f"model {refs[si0]} has no tensors for layer {li} (slices[{k}])")
        for n in names0:
            per_source = [rename_layer(n, s.layer_range[0] + offset) for s in sl.sources]
            plans.append(plan(rename_layer(n, lo), sl, per_source, t))
    plans += [plan(n, last, [n] * len(last.sources), 0.0) for n in outside(last) if not is_pre(n)]
    _check_plans(plans, sources[reference], layers[reference], refs, reference)
    job.plans = plans
    job.n_layers_out = sum(b - a for sl in cfg.slices for a, b in [sl.sources[0].layer_range])
    job.ref_config = _per_layer_lists(job.ref_config, cfg, by_ref, configs)
    return mark_out_quantization(job)


def _check_plans(plans: list[TensorPlan], ref_source, ref_layers: dict, refs: list[str], reference: int) -> None:
    """Every output layer tensor has the shape of the reference model's (``ref_source``, whose
    layer tensors are ``ref_layers``), no output name comes twice and the vocabulary-sized tensors
    share one vocabulary."""
    ref_shapes = {rename_layer(n, 0): ref_source.tensors[n].shape
                  for n in ref_layers.get(min(ref_layers, default=0), [])}
    seen: set[str] = set()
    for p in plans:
        key = rename_layer(p.name, 0) if layer_index(p.name) is not None else None
        if key in ref_shapes and ref_shapes[key] != p.shape:
            src = p.inputs[0] if p.inputs else p.base
            raise UserError(f"tensor '{(p.src_names or {}).get(src, p.name)}' of model {refs[src]} has shape "
                            f"{list(p.shape)}, the layers of {refs[reference]} have {list(ref_shapes[key])}: slices "
                            "must come from models with the same layer shapes")
        if p.name in seen:  # two names mapping to one output (a layer pattern this module misreads)
            raise UserError(f"tensor '{p.name}' would be written twice; the layer names are not understood")
        seen.add(p.name)
    rows = {(p.name, p.shape[0]) for p in plans if p.shape and is_vocab_tensor(p.name)}
    if len({r for _, r in rows}) > 1:
        each = ", ".join(f"{n}: {r}" for n, r in sorted(rows))
        raise UserError(f"the vocabulary-sized tensors come from models with different vocabularies ({each}); "
                        "the first and last slices' models must share a vocabulary")


#: ``config.json`` keys holding one entry per layer, rebuilt from the slices
PER_LAYER_KEYS = ("layer_types",)


def _per_layer_lists(conf: dict, cfg: MergeConfig, by_ref: dict, configs: list[dict]) -> dict:
    """``conf`` with each :data:`PER_LAYER_KEYS` list rebuilt from the slices' ranges (left as it is
    when some slice's model lacks it)."""
    conf = dict(conf)
    for key in PER_LAYER_KEYS:
        lists = [configs[by_ref[sl.sources[0].model]].get(key) for sl in cfg.slices]
        if key in conf and all(isinstance(v, list) for v in lists):
            conf[key] = [x for v, sl in zip(lists, cfg.slices) for x in v[slice(*sl.sources[0].layer_range)]]
    return conf
