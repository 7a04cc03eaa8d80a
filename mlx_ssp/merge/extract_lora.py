"""LoRA extraction: a fine-tuned model as ``BASE`` + a low-rank mlx-lm adapter (the inverse of
``mlx_lm fuse``; mergekit's ``mergekit-extract-lora``). Not a step of the paper's recipe: it turns a
fused specialist back into a small adapter (to store, share or merge as ``BASE+ADAPTER``).

For every 2-D ``.weight`` inside the transformer layers (the linear layers mlx-lm's LoRA wraps),
the difference ``D = W_tuned - W_base`` (float32) is approximated at rank ``r`` by a randomized
truncated SVD (Halko, Martinsson & Tropp 2011, algorithm 4.4: a Gaussian sketch of ``r +
oversample`` columns, ``power_iters`` subspace iterations, QR, then the exact SVD of the small
projected matrix, in MLX). The adapter stores ``lora_b = U_r^T`` and ``lora_a = (S_r V_r^T)^T`` with
``scale = 1``, so ``W_base + scale * lora_b^T lora_a^T`` is the rank-r reconstruction
(mlx-lm's ``LoRALinear``: ``y = x W^T + scale * (x lora_a) lora_b``). With ``r`` at least the
smaller dimension the sketch spans D's whole column space and the reconstruction is D to float32
precision. Each module's relative reconstruction error ``||D - D_r||_F / ||D||_F`` is reported.

Deviations / limits: the singular values all go to ``lora_a`` (no square-root split, which would
divide by near-zero singular values); tensors outside the layers (embeddings, LM head, final norm)
and 1-D tensors (norms, biases) cannot be expressed in an mlx-lm LoRA adapter: they are listed
with their relative difference as "not captured" (mergekit can save them as full modules). Only
dense linear layers (no MoE expert stacks). The sketch is seeded per tensor name (PCG64), so the
output does not depend on the order of the tensors.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

import mlx_ssp  # noqa: F401
from mlx_ssp.errors import UserError
from mlx_ssp.io import atomic_dir
from mlx_ssp.merge.config import layer_index
from mlx_ssp.merge.engine import source_paths
from mlx_ssp.merge.outdir import check_clear_of_inputs
from mlx_ssp.merge.plan import layer_count
from mlx_ssp.merge.sources import Source, open_source, read_model_config

#: marks an adapter directory this module wrote (``--overwrite`` replaces only such a directory)
MARK = ("extracted_by", "mlx_ssp")
ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


@dataclass(frozen=True)
class ModuleFit:
    """One extracted linear layer: its name (without ``.weight``), shape and relative error."""

    module: str
    shape: tuple[int, int]
    rel_error: float


def sketch_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _orth(y: mx.array) -> mx.array:
    """An orthonormal basis of ``y``'s columns (reduced QR; MLX factorises on the CPU only)."""
    return mx.linalg.qr(y, stream=mx.cpu)[0]


def low_rank(d: mx.array, rank: int, *, oversample: int = 8, power_iters: int = 2,
             seed: int = 0) -> tuple[mx.array, mx.array]:
    """(U_r (m, r), S_r V_r^T (r, n)) of ``d`` (m, n, float32) by randomized SVD; columns past
    the matrix's rank are zero. The small matrix ``B = Q^T d`` (k, n) is factorised through the
    QR of ``B^T`` so the SVD is only k x k (MLX's SVD returns full n x n factors)."""
    m, n = d.shape
    k = min(rank + oversample, m, n)
    omega = mx.array(np.random.Generator(np.random.PCG64(seed)).standard_normal((n, k)).astype(np.float32))
    q = _orth(d @ omega)
    for _ in range(power_iters):  # subspace iteration, re-orthonormalised each half step
        q = _orth(d @ _orth(d.T @ q))
    b = q.T @ d  # (k, n)
    q2, r2 = mx.linalg.qr(b.T, stream=mx.cpu)  # b = r2^T q2^T
    ur, s, vrt = mx.linalg.svd(r2.T, stream=mx.cpu)
    r = min(rank, k)
    u = q @ ur[:, :r]
    sv = s[:r, None] * (vrt[:r] @ q2.T)
    if r < rank:  # pad to the adapter's rank
        u = mx.pad(u, [(0, 0), (0, rank - r)])
        sv = mx.pad(sv, [(0, rank - r), (0, 0)])
    mx.eval(u, sv)
    return u, sv


def relative_error(d: mx.array, u: mx.array, sv: mx.array) -> float:
    """``||d - u sv||_F / ||d||_F`` (0 for a zero difference)."""
    den = float(mx.sqrt(mx.sum(d * d)).item())
    if den == 0:
        return 0.0
    r = d - u @ sv
    return float(mx.sqrt(mx.sum(r * r)).item()) / den


def lora_targets(base: Source, tuned: Source) -> tuple[list[str], list[str]]:
    """(the 2-D layer ``.weight`` names to extract, every other tensor name), checked: both models
    have the same tensors with the same shapes."""
    missing = sorted(set(base.tensors) ^ set(tuned.tensors))
    if missing:
        n = missing[0]
        where = base.ref if n not in base.tensors else tuned.ref
        raise UserError(f"tensor '{n}' is missing from model {where}; base and tuned model must have the same tensors")
    targets, others = [], []
    for n in sorted(tuned.tensors):
        if base.tensors[n].shape != tuned.tensors[n].shape:
            raise UserError(f"tensor '{n}': shape {list(tuned.tensors[n].shape)} in {tuned.ref} differs from "
                            f"{list(base.tensors[n].shape)} in {base.ref}")
        lin = n.endswith(".weight") and len(tuned.tensors[n].shape) == 2 and layer_index(n) is not None
        (targets if lin else others).append(n)
    if not targets:
        raise UserError(f"model {tuned.ref} has no linear layers inside model layers to extract")
    return targets, others


def layer_key(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``self_attn.q_proj`` (mlx-lm's LoRA ``keys``:
    relative to a layer; a module outside the layers keeps its full path, as mlx-lm matches it)."""
    stem = name[: -len(".weight")]
    i = layer_index(name)
    if i is None:
        return stem
    marker = f".{i}."
    return stem[stem.index(marker) + len(marker):]


def _diff(base: Source, tuned: Source, name: str) -> Optional[float]:
    """Relative difference of a tensor the adapter cannot hold (None: identical)."""
    a, b = base.load(name).astype(mx.float32), tuned.load(name).astype(mx.float32)
    d = float(mx.sqrt(mx.sum((b - a) ** 2)).item())
    if d == 0:
        return None
    n = float(mx.sqrt(mx.sum(a * a)).item())
    return d / n if n else float("inf")


def extract_lora(base: Source, tuned: Source, rank: int, *, n_layers: int, oversample: int = 8,
                 power_iters: int = 2, seed: int = 0, dtype: str = "float32",
                 on_module: Optional[Callable[[ModuleFit], None]] = None) -> tuple[dict, dict, list[ModuleFit], dict]:
    """(adapter tensors, adapter_config, one fit per module, {not captured tensor: rel. diff})."""
    if rank < 1:
        raise UserError(f"rank must be at least 1, got {rank}")
    targets, others = lora_targets(base, tuned)
    out_dt = getattr(mx, dtype)
    weights: dict[str, mx.array] = {}
    fits = []
    for name in targets:
        d = tuned.load(name).astype(mx.float32) - base.load(name).astype(mx.float32)
        mx.eval(d)
        u, sv = low_rank(d, rank, oversample=oversample, power_iters=power_iters, seed=sketch_seed(seed, name))
        fit = ModuleFit(name[: -len(".weight")], tuple(d.shape), relative_error(d, u, sv))
        stem = name[: -len(".weight")]
        weights[stem + ".lora_a"] = sv.T.astype(out_dt)  # (in, r)
        weights[stem + ".lora_b"] = u.T.astype(out_dt)  # (r, out)
        mx.eval(weights[stem + ".lora_a"], weights[stem + ".lora_b"])
        fits.append(fit)
        if on_module:
            on_module(fit)
    skipped = {n: r for n in others if (r := _diff(base, tuned, n)) is not None}
    config = {"fine_tune_type": "lora", "num_layers": n_layers,
              "lora_parameters": {"rank": rank, "scale": 1.0, "dropout": 0.0,
                                  "keys": sorted({layer_key(n) for n in targets})},
              "base_model": base.ref, MARK[0]: MARK[1]}
    return weights, config, fits, skipped


def round_sig(x) -> float:
    """``x`` to 4 significant digits (the reports' errors)."""
    return float(f"{float(x):.4g}")


def is_adapter_output(d: Path, mark: tuple[str, str] = MARK, extra_files: tuple[str, ...] = ()) -> bool:
    """``d`` holds only an adapter directory (plus ``extra_files``) whose config carries ``mark``:
    one a command of ours wrote."""
    try:
        names = {e.name for e in d.iterdir()}
        conf = json.loads((d / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return names <= {*ADAPTER_FILES, *extra_files} and isinstance(conf, dict) and conf.get(mark[0]) == mark[1]


def check_adapter_out_dir(out_dir: Path, *, overwrite: bool, mark: tuple[str, str] = MARK,
                          extra_files: tuple[str, ...] = ()) -> None:
    """An existing OUT_DIR is replaced only with ``overwrite``, and only when it is empty or an
    adapter directory the same command wrote (:func:`is_adapter_output`)."""
    if not out_dir.exists():
        return
    if not overwrite:
        raise UserError(f"{out_dir} already exists; pass --overwrite to replace it")
    if not (out_dir.is_dir() and (not any(out_dir.iterdir()) or is_adapter_output(out_dir, mark, extra_files))):
        raise UserError(f"{out_dir} is not an adapter directory this command wrote; choose another OUT_DIR")


def run_extract(base_ref: str, tuned_ref: str, out_dir: Path, rank: int, *, oversample: int = 8,
                power_iters: int = 2, seed: int = 0, dtype: str = "float32", overwrite: bool = False,
                on_module: Optional[Callable[[ModuleFit], None]] = None) -> dict:
    """Extract and write the adapter directory atomically; returns a summary."""
    out_dir = Path(out_dir)
    base, tuned = open_source(base_ref), open_source(tuned_ref)
    check_clear_of_inputs(out_dir, source_paths([base, tuned]))
    check_adapter_out_dir(out_dir, overwrite=overwrite)
    t0 = time.perf_counter()
    n_layers = layer_count(base, read_model_config(base))
    weights, config, fits, skipped = extract_lora(base, tuned, rank, n_layers=n_layers, oversample=oversample,
                                                  power_iters=power_iters, seed=seed, dtype=dtype,
                                                  on_module=on_module)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        mx.save_safetensors(str(tmp / "adapters.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    errs = [f.rel_error for f in fits]
    return {"out_dir": str(out_dir), "rank": rank, "modules": len(fits),
            "mean_rel_error": round_sig(np.mean(errs)), "max_rel_error": round_sig(np.max(errs)),
            "not_captured": {k: round_sig(v) for k, v in skipped.items()},
            "seconds": round(time.perf_counter() - t0, 3)}
