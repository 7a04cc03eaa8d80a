"""The streaming merge: plan and validate every tensor (:mod:`.plan`), then merge and write tensor
by tensor.

1. Plan (:func:`plan_merge`): open every input (:mod:`.sources`), check it and resolve every
   tensor's dtypes and parameters; any bad input stops here, before a byte is written.
2. Before anything is written, OUT_DIR is checked against every input (:mod:`.outdir`: never an
   input, inside one or holding one; an existing OUT_DIR only replaced when it is a previous
   output). The output directory is built in a temporary sibling and renamed into place at the end.
3. Merge in file order, reading each input tensor lazily (only its bytes; LoRA adapters fused on
   the fly) and handing it to the method's registry entry (:data:`.methods.METHODS`); the result
   is written at its planned place in its output shard. ``workers`` tensors (default 2 on the CPU)
   are merged side by side (:mod:`.parallel`); ``--workers 1`` for the least memory. With tokenizer
   surgery, each input's embedding / LM-head rows are aligned to the output vocabulary as the
   tensor is read (:func:`.tokenizer.aligned_fetch`), and the output tokenizer is written with it.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx

import mlx_ssp  # noqa: F401
from mlx_ssp import trackers
from mlx_ssp.card import Card, write_card
from mlx_ssp.config import section_seed, validate
from mlx_ssp.errors import UserError
from mlx_ssp.io import atomic_dir
from mlx_ssp.merge import quant as Q
from mlx_ssp.merge import safetensors_io as sio
from mlx_ssp.merge.config import MergeConfig, MergeStageConfig
from mlx_ssp.merge.kernels import DTYPES
from mlx_ssp.merge.methods import METHODS
from mlx_ssp.merge.outdir import MARK_KEY, MARK_VALUE, Protected, check_out_dir
from mlx_ssp.merge.parallel import resolve_workers, run_parallel
from mlx_ssp.merge.params import TensorInputs
from mlx_ssp.merge.plan import MergeJob, TensorPlan, base_output_config, check_merge_config, code_name, plan_models
from mlx_ssp.merge.slices import plan_slices
from mlx_ssp.merge.sparsify import dare_seed
from mlx_ssp.merge.tokenizer import TOKENIZER_FILES, aligned_fetch, copy_tokenizer_files, write_tokenizer
from mlx_ssp.progress import bar as progress_bar

#: Bump when the same config, inputs and options give other output bytes (a method's arithmetic,
#: rounding, tensor order, side files): a multimerge keeps an intermediate only while its
#: fingerprint, which holds this, is unchanged, and mlx_ssp's own version does not move per change.
MERGER_VERSION = 3  # 3: a NaN rounds to bf16 as exactly the quiet NaN 0x7FC0
#: the shard metadata of a dry run's stand-in (:func:`write_skeleton`) instead of the merge mark,
#: so that a stand-in never passes for a merge output (:func:`.outdir.is_merge_output`)
SKELETON_KEY, SKELETON_VALUE = "mlx_ssp_stand_in", "headers only, no tensor data"


def plan_merge(cfg: MergeConfig, *, vocab_mismatch: str = "error", source_label: str = "config") -> MergeJob:
    """Open every model, check every tensor and resolve every parameter; writes nothing: the
    ``slices:`` form by :func:`.slices.plan_slices`, the ``models:`` form by :func:`.plan.plan_models`."""
    check_merge_config(cfg, vocab_mismatch=vocab_mismatch, source_label=source_label)
    plan = plan_slices if cfg.slices is not None else plan_models
    return plan(cfg, vocab_mismatch=vocab_mismatch, source_label=source_label)

def _fit_rows(x: mx.array, rows: int, fill) -> mx.array:
    """Truncate or pad (with the reference's rows) along the vocabulary axis."""
    if x.shape[0] > rows:
        return x[:rows]
    if x.shape[0] < rows:
        return mx.concatenate([x, fill()[x.shape[0]:rows].astype(x.dtype)], axis=0)
    return x



def merge_tensor(job: MergeJob, p: TensorPlan, seed: int) -> list[mx.array]:
    """Merge one planned tensor; returns it in the output dtype, flat, as consecutive slices
    (row-major order: the bytes of the reference's shape, written one slice after the other)."""
    ref_src = job.sources[job.reference]
    names = p.src_names or {}
    if p.copy:
        return [job.sources[p.inputs[0]].load(names.get(p.inputs[0], p.name)) if p.inputs else ref_src.load(p.name)]
    rows = p.shape[0] if p.shape else 0

    def fetch(i):
        return job.sources[i].load(names.get(i, p.name))
    if p.vocab:  # tokenizer surgery: every input's rows on the output vocabulary
        fetch = aligned_fetch(job.vocab, fetch, DTYPES[p.cd])

    def loader(i):
        def f():
            x = fetch(i)
            if p.shape and x.shape != p.shape and not p.vocab:
                x = _fit_rows(x, rows, lambda: ref_src.load(p.name))
            return x.reshape(-1)
        return f

    base = loader(p.base) if p.base is not None else None
    seeds = [dare_seed(seed, p.name, str(i)) for i in p.inputs]
    inputs = TensorInputs([loader(i) for i in p.inputs], base, p.per_model, p.params, seeds, DTYPES[p.cd],
                          DTYPES[code_name(p.out)], shape=p.shape)
    return METHODS[job.cfg.merge_method].run(inputs)


#: mlx's CPU buffer cache holds 32 MiB by default: larger freed buffers go back to the OS, and the
#: next tensor's arrays pay a page fault and a page zeroing per 4 KiB. Measured on a 300M-parameter
#: bf16 merge: 1 GiB cuts the minor faults by 35-50% and the system time by ~15%; peak RSS rises by
#: ~10% (the cache only keeps what the largest tensor had in flight anyway).
_CPU_BUFFER_CACHE = 1 << 30


@contextmanager
def _buffer_cache():
    """Raise mlx's buffer-cache limit on the CPU for the merge (never lower it), then restore it
    and release the cached buffers."""
    if mx.default_device() != mx.cpu:
        yield
        return
    prev = mx.set_cache_limit(_CPU_BUFFER_CACHE)
    if prev > _CPU_BUFFER_CACHE:
        mx.set_cache_limit(prev)
    try:
        yield
    finally:
        mx.set_cache_limit(prev)
        mx.clear_cache()



def input_paths(job: MergeJob, extra: tuple[Path, ...] = ()) -> list[Protected]:
    """Every path the merge reads, for :func:`check_out_dir`: each model directory (as given and
    as resolved), its adapter directory, the directories its files really live in (a hub cache's
    blobs), and ``extra`` files (the merge config)."""
    return source_paths(job.sources, extra)


def source_paths(sources, extra: tuple[Path, ...] = ()) -> list[Protected]:
    """:func:`input_paths` of a list of :class:`.sources.Source`."""
    items = [Protected(Path(f), "the merge config", is_dir=False) for f in extra]
    for s in sources:
        items.append(Protected(s.path, f"input model {s.ref}"))
        if s.given is not None:
            items.append(Protected(s.given, f"input model {s.ref}"))
        if s.adapter_path is not None:
            items.append(Protected(s.adapter_path, f"the LoRA adapter of model {s.ref}"))
        dirs = {f.resolve().parent for f in source_files(s) if f.exists()}
        items += [Protected(d, f"a directory holding files of model {s.ref}") for d in sorted(dirs)]
    return items


def source_files(s, *, model: bool = True) -> set[Path]:
    """The files a :class:`.sources.Source` is read from: with ``model`` its tensors' (quantized
    parts too), config and tokenizer files; its LoRA adapter's tensors and config. Some may not exist
    (a model without a tokenizer)."""
    files: set[Path] = set()
    if model:
        files = {t.file for t in s.tensors.values()} | {s.path / f for f in ("config.json", *TOKENIZER_FILES)}
        files |= {t.file for q in (s.quant or {}).values() for t in (q.scales, q.biases) if t is not None}
    if s.adapter_path is not None:
        files |= {t.file for t in (s.adapter or {}).values()} | {s.adapter_path / "adapter_config.json"}
    return files


def tokenizer_dir(job: MergeJob) -> Path:
    """Where the tokenizer files are copied from without tokenizer surgery (and in the ``slices:``
    form): ``tokenizer_source`` (a model), else the reference."""
    src = job.cfg.tokenizer_source
    if src and src != "base":
        match = [s for s in job.sources if s.ref == src]
        if not match:
            raise UserError(f"tokenizer_source {src} is not one of the models")
        return match[0].path
    return job.sources[job.reference].path



def _merge_tensors(job: MergeJob, writer: sio.ShardedWriter, seed: int, n_workers: int, progress: bool) -> None:
    """Merge every planned tensor into ``writer`` (on ``n_workers`` threads, largest first); the
    output does not depend on the order (each tensor's result depends only on its inputs, and DARE
    seeds on its name)."""
    def merge_one(p: TensorPlan) -> None:
        parts = merge_tensor(job, p, seed)
        mx.eval(parts)
        if p.quant is None:
            writer.write(p.name, [sio.to_bytes(x) for x in parts])
            return
        stored = Q.quantize_parts(p.name, parts, p.shape, *p.quant)
        del parts
        mx.eval(list(stored.values()))
        for name, x in stored.items():
            writer.write(name, [sio.to_bytes(x)])

    bar = progress_bar(len(job.plans), desc=f"merge {job.cfg.merge_method}", unit="tensor", enabled=progress)
    try:
        with _buffer_cache():
            if n_workers == 1:
                for p in job.plans:
                    merge_one(p)
                    bar.update()
            else:
                run_parallel(job.plans, merge_one, n_workers, bar.update, sizes=[math.prod(p.shape) for p in job.plans])
    finally:
        bar.close()


def output_config(job: MergeJob) -> dict:
    """The reference's ``config.json`` (:func:`.plan.base_output_config`: the output's layer count,
    no input quantization) with ``torch_dtype`` (and ``dtype``, if it has one) set to the output
    dtype when every merged tensor has the same one, and the output's ``quantization``."""
    conf = base_output_config(job)
    if any(p.quant for p in job.plans):
        oq = job.cfg.out_quantization
        conf["quantization"] = conf["quantization_config"] = Q.config_entry(oq.bits, oq.group_size, oq.mode)
    out_codes = {p.out for p in job.plans if not p.copy}
    if len(out_codes) == 1:
        dt = code_name(out_codes.pop())
        for key in ("torch_dtype", "dtype"):
            if key in conf or key == "torch_dtype":
                conf[key] = dt
    return conf


def merge_card(job: MergeJob, config_text: str, seed: int) -> Card:
    """The output's model card: the method, its global parameters and inputs, and the config as YAML
    (mergekit's card fields)."""
    cfg = job.cfg
    oq = cfg.out_quantization
    settings = {"merge method": cfg.merge_method, "base model": cfg.base_model, "dtype": cfg.dtype,
                "out dtype": cfg.out_dtype, "tokenizer source": cfg.tokenizer_source,
                "out quantization": f"{oq.mode} {oq.bits}-bit, group {oq.group_size}" if oq else None,
                "seed (random masks)": seed if METHODS[cfg.merge_method].sparsify else None}
    settings.update({f"parameters.{k}": v for k, v in (cfg.parameters or {}).items()})
    return Card("merge", tuple(s.ref for s in job.sources), settings, config_yaml=config_text or None,
                title=f"{cfg.merge_method} merge of {len(job.sources)} models")


def _write_side_files(job: MergeJob, tmp: Path, tok_src: Optional[Path], config_text: str, seed: int,
                      extra: Optional[dict[str, str]] = None) -> None:
    """config.json, the tokenizer files (from ``tok_src``, unless None; with tokenizer surgery the
    output vocabulary's, always, as mergekit saves it), the merge config, the model card and the
    caller's ``extra`` files (name -> text)."""
    for name, text in (extra or {}).items():
        (tmp / name).write_text(text)
    (tmp / "config.json").write_text(json.dumps(output_config(job), indent=2) + "\n")
    if job.vocab is not None:
        write_tokenizer(job.vocab, tmp)
    elif tok_src is not None:
        copy_tokenizer_files(tok_src, tmp)
    (tmp / "mergekit_config.yml").write_text(config_text or "")
    write_card(tmp, merge_card(job, config_text, seed))


def write_merge(job: MergeJob, out_dir: Path, *, overwrite: bool = False, out_shard_size: int | str = "5GB",
                copy_tokenizer: bool = True, seed: int = 0, config_text: str = "",
                progress: bool = True, workers: Optional[int] = None, overwrite_any: bool = False,
                protect: tuple[Path, ...] = (), side_files: Optional[dict[str, str]] = None) -> dict:
    """Merge every planned tensor into ``out_dir`` (atomic: built beside it, renamed at the end).
    ``workers`` tensors are merged side by side (:func:`.parallel.resolve_workers`); the output
    does not depend on it. ``out_dir`` is checked first (:func:`check_out_dir`) against every input
    and ``protect`` (other files the caller read, e.g. the merge config). ``side_files`` (name ->
    text) are written into the output with it (a multimerge's fingerprint: there only if the merge
    finished)."""
    check_out_dir(Path(out_dir), input_paths(job, tuple(protect)), overwrite=overwrite, overwrite_any=overwrite_any)
    tok_src = tokenizer_dir(job) if copy_tokenizer and job.vocab is None else None
    out_dir = Path(out_dir)
    # lexically absolute: a trailing '..' has no name to build the temporary sibling from
    target = Path(os.path.abspath(out_dir))
    shard_bytes = sio.parse_size(out_shard_size)
    t0 = time.perf_counter()
    with atomic_dir(target, overwrite=overwrite or overwrite_any) as tmp:
        writer = sio.ShardedWriter(tmp, planned_tensors(job), shard_bytes, metadata={MARK_KEY: MARK_VALUE})
        n_workers = resolve_workers(workers)
        try:
            _merge_tensors(job, writer, seed, n_workers, progress)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        _write_side_files(job, tmp, tok_src, config_text, seed, side_files)
    elapsed = time.perf_counter() - t0
    res = {"out_dir": str(out_dir), "tensors": len(job.plans), "bytes": writer.total_bytes,
           "shards": len(writer.names), "workers": n_workers, "seconds": round(elapsed, 3)}
    if job.cfg.out_quantization is not None:
        res["quantized"] = sum(p.quant is not None for p in job.plans)  # 0 would mean mlx-lm's names did not match
    trackers.log("", res, step=0)  # merge/seconds, merge/bytes, ... (mlx_ssp.trackers)
    return res


def planned_tensors(job: MergeJob) -> list[sio.PlannedTensor]:
    """The output's stored tensors in order (a quantized weight as its packed parts; a copy in the
    reference's dtype)."""
    return [t for p in job.plans for t in
            ([sio.PlannedTensor(p.name, p.out, p.shape)] if p.quant is None
             else Q.packed_tensors(p.name, p.shape, p.out, *p.quant))]


def write_skeleton(job: MergeJob, out_dir: Path, *, out_shard_size: int | str = "5GB",
                   copy_tokenizer: bool = True) -> None:
    """What :func:`write_merge` would write, with every tensor left as zeros (the shards are sized
    by ``ftruncate``: sparse, no data written): a later merge can be planned on it before this one
    has run (a multimerge's ``--dry-run``). Its shards carry :data:`SKELETON_KEY`, not the merge
    mark, so it is never taken for a merge output."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    writer = sio.ShardedWriter(out_dir, planned_tensors(job), sio.parse_size(out_shard_size),
                               metadata={SKELETON_KEY: SKELETON_VALUE})
    writer.abort()
    writer.write_index()
    tok_src = tokenizer_dir(job) if copy_tokenizer and job.vocab is None else None
    _write_side_files(job, out_dir, tok_src, "", 0)


def run_merge(cfg: MergeConfig, out_dir: Path, *, overwrite: bool = False, out_shard_size: int | str = "5GB",
              copy_tokenizer: bool = True, seed: int = 0, vocab_mismatch: str = "error", config_text: str = "",
              progress: bool = True, workers: Optional[int] = None, overwrite_any: bool = False,
              protect: tuple[Path, ...] = ()) -> dict:
    """Plan (all checks) then write: the one entry point the CLI and the pipeline share.
    ``overwrite`` replaces only a previous merge output, ``overwrite_any`` any directory that is
    not an input (:mod:`mlx_ssp.merge.outdir`)."""
    if Path(out_dir).exists() and not (overwrite or overwrite_any):
        raise UserError(f"{out_dir} already exists; pass --overwrite to replace it")
    job = plan_merge(cfg, vocab_mismatch=vocab_mismatch)
    if not config_text:
        import yaml

        config_text = yaml.safe_dump(cfg.model_dump(exclude_none=True), sort_keys=False)
    return write_merge(job, Path(out_dir), overwrite=overwrite, out_shard_size=out_shard_size,
                       copy_tokenizer=copy_tokenizer, seed=seed, config_text=config_text, progress=progress,
                       workers=workers, overwrite_any=overwrite_any, protect=protect)


def stage_to_config(models: list[Path], base: Optional[Path], stage: MergeStageConfig) -> MergeConfig:
    """The mergekit config equivalent to the pipeline's ``merge:`` section."""
    n = len(models)

    def per(v, what):
        if v is None:
            return [None] * n
        if isinstance(v, list):
            if len(v) != n:
                raise UserError(f"merge.{what} has {len(v)} values for {n} models")
            return v
        return [v] * n

    weights = per(stage.weights, "weights")
    dens = per(stage.density, "density")
    spec = METHODS[stage.method]
    if "weight" not in spec.model_params and stage.weights is not None:
        raise UserError(f"merge.weights: method {stage.method} takes no per-model weight "
                        f"(its per-model parameters: {', '.join(spec.model_params) or 'none'})")
    entries = []
    for m, w, d in zip(models, weights, dens):
        # methods without a per-model weight (slerp, model_stock, ...) get none: it would be an unknown key
        params: dict[str, Any] = {"weight": 1.0 if w is None else w} if "weight" in spec.model_params else {}
        if d is not None:
            params["density"] = d
        entries.append({"model": str(m), "parameters": params or None})
    data = {"models": entries, "merge_method": stage.method, "parameters": dict(stage.parameters) or None,
            "dtype": stage.dtype, "out_dtype": stage.out_dtype}
    if stage.out_quantization is not None:
        data["out_quantization"] = stage.out_quantization.model_dump()
    if spec.needs_base:
        if base is None:
            raise UserError(f"merge method {stage.method} needs a base model")
        data["base_model"] = str(base)

    return validate(MergeConfig, data, source="merge", prefix="merge")


def merge_models(models: list[Path], base: Optional[Path], stage_cfg: MergeStageConfig, out_dir: Path, *,
                 overwrite: bool = False, seed: Optional[int] = None, progress: bool = True) -> dict:
    """The pipeline's merge: fused specialists (+ the run's base) -> one model directory; the
    section's own seed, else ``seed`` (the run's), else 0."""
    cfg = stage_to_config([Path(m) for m in models], Path(stage_cfg.base_model) if stage_cfg.base_model else base,
                          stage_cfg)
    return run_merge(cfg, Path(out_dir), overwrite=overwrite, out_shard_size=stage_cfg.out_shard_size,
                     copy_tokenizer=stage_cfg.copy_tokenizer,
                     seed=section_seed(stage_cfg, seed or 0),
                     vocab_mismatch=stage_cfg.vocab_mismatch, progress=progress, workers=stage_cfg.workers)
