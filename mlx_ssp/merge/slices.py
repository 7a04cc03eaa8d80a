"""The ``slices:`` form: layer surgery ("frankenmerges") as mergekit 0.1.5's ``MergePlanner`` plans
it (``plan.py``: ``plan_module`` / ``plan_slice`` / ``plan_layer``), for ``passthrough``.

Each output slice takes layers ``layer_range = [start, end)`` from its source; the output's layers
are the slices' layers in order, renumbered from 0 (``model.layers.{start + j}.*`` of slice k
becomes ``model.layers.{offset_k + j}.*``), and ``num_hidden_layers`` in ``config.json`` is their
total. Slices may overlap and may come from different models (same hidden sizes). Tensors outside
the layers come, as in mergekit, from the *first* slice's source when they precede the layers (the
input embeddings) and from the *last* slice's source when they follow them (final norm, LM head).
Gradients run over each slice (``t = j / (n - 1)``, ``t = 1`` for a one-layer slice); tensors
outside the layers get ``t = 0``. Parameters: the source's, then the slice's, then the top level.
``config.json`` is the base model's when ``base_model`` is given, else the first slice source's;
its per-layer lists (:data:`PER_LAYER_KEYS`) are rebuilt from the slices. The vocabulary-sized
tensors (embeddings from the first slice, LM head from the last) must have the same rows.

Deviations from mergekit: it reads the pre/post split from per-architecture JSON files; here a
tensor outside the layers is "pre" when its name contains an input-embedding name
(:data:`PRE_HINTS`), else "post". mergekit takes ``config.json`` from an unordered set of the
models when no ``base_model`` is given; here it is the first slice's. mergekit neither rebuilds
``layer_types`` nor checks the vocabularies.
"""

from __future__ import annotations

import re
from typing import Optional

from mlx_ssp.errors import UserError
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.config import _LAYER, MergeConfig, layer_index
from mlx_ssp.merge.methods import METHODS
from mlx_ssp.merge.passthrough import MAX_INPUTS
from mlx_ssp.merge.plan import (VOCAB_HINTS, MergeJob, TensorPlan, layer_count, mark_out_quantization, resolve_per_model,
                                resolve_shared, tensor_dtypes)
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


def plan_slices(cfg: MergeConfig, *, vocab_mismatch: str = "error", source_label: str = "config") -> MergeJob:
    """Open every slice's source, check the ranges and plan every output tensor (see the module
    docstring); writes nothing."""
    spec = METHODS[cfg.merge_method]
    limit = MAX_INPUTS.get(spec.name)
    refs: list[str] = []
    for i, sl in enumerate(cfg.slices):
        if limit is not None and len(sl.sources) > limit:
            raise UserError(f"{source_label}: slices[{i}]: {spec.name} takes {limit} source per slice, "
                            f"got {len(sl.sources)}")
        for s in sl.sources:
            if s.model not in refs:
                refs.append(s.model)
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
    job = MergeJob(cfg, sources, None, [], reference, [], configs[reference])
    top = cfg.parameters or {}

    def plan(out_name: str, si: int, in_name: str, t: float, scopes: list[Optional[dict]]) -> TensorPlan:
        info = sources[si].tensors.get(in_name)
        if info is None:
            raise UserError(f"tensor '{in_name}' is missing from model {refs[si]}")
        if info.dtype not in sio.FLOAT_CODES:
            return TensorPlan(out_name, [si], None, info.shape, "float32", info.dtype, copy=True, src_name=in_name)
        cd, out = tensor_dtypes([info.dtype], cfg)
        shared = resolve_shared(spec, top, out_name, t)
        pm = resolve_per_model(spec, [*scopes, top], out_name, t, refs[si])
        return TensorPlan(out_name, [si], None, info.shape, cd, out, shared, [pm], src_name=in_name)

    first, last = cfg.slices[0], cfg.slices[-1]
    f_src, l_src = by_ref[first.sources[0].model], by_ref[last.sources[0].model]
    outside = lambda si: [n for n in sio.iter_names(sources[si].tensors) if layer_index(n) is None]  # noqa: E731
    plans = [plan(n, f_src, n, 0.0, [first.sources[0].parameters, first.parameters])
             for n in outside(f_src) if is_pre(n)]
    for k, li, lo, t in slice_layout([tuple(sl.sources[0].layer_range) for sl in cfg.slices]):
        sl = cfg.slices[k]
        si = by_ref[sl.sources[0].model]
        names = layers[si].get(li)
        if not names:
            raise UserError(f"model {refs[si]} has no tensors for layer {li} (slices[{k}])")
        plans += [plan(rename_layer(n, lo), si, n, t, [sl.sources[0].parameters, sl.parameters]) for n in names]
    plans += [plan(n, l_src, n, 0.0, [last.sources[0].parameters, last.parameters])
              for n in outside(l_src) if not is_pre(n)]
    ref_shapes = {rename_layer(n, 0): sources[reference].tensors[n].shape
                  for n in layers[reference].get(min(layers[reference], default=0), [])}
    seen: set[str] = set()
    for p in plans:
        key = rename_layer(p.name, 0) if layer_index(p.name) is not None else None
        if key in ref_shapes and ref_shapes[key] != p.shape:
            raise UserError(f"tensor '{p.src_name}' of model {refs[p.inputs[0]]} has shape {list(p.shape)}, the "
                            f"layers of {refs[reference]} have {list(ref_shapes[key])}: slices must come from models "
                            "with the same layer shapes")
        if p.name in seen:  # two names mapping to one output (a layer pattern this module misreads)
            raise UserError(f"tensor '{p.name}' would be written twice; the layer names are not understood")
        seen.add(p.name)
    rows = {(p.name, p.shape[0]) for p in plans
            if p.shape and layer_index(p.name) is None and any(h in p.name for h in VOCAB_HINTS)}
    if len({r for _, r in rows}) > 1:
        each = ", ".join(f"{n}: {r}" for n, r in sorted(rows))
        raise UserError(f"the vocabulary-sized tensors come from models with different vocabularies ({each}); "
                        "the first and last slices' models must share a vocabulary")
    job.plans = plans
    job.n_layers_out = sum(b - a for sl in cfg.slices for a, b in [sl.sources[0].layer_range])
    job.ref_config = _per_layer_lists(job.ref_config, cfg, by_ref, configs)
    return mark_out_quantization(job)


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
