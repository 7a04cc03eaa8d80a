"""Task vectors: how far fine-tunes moved from their base, and in which directions.

A fine-tune's task vector is ``model - base`` over every tensor they share (Ilharco et al. 2023,
"Editing models with task arithmetic"). Their norms and pairwise cosines say what a merge can do:
near-orthogonal vectors of similar norm add without much interference (a linear merge then scales
each skill by 1/N); vectors that point the same way teach overlapping skills, and their average
behaves like a model soup (Wortsman et al. 2022) more than like a union of skills.

Streams one tensor at a time through :mod:`mlx_ssp.merge.sources` (headers scanned, LoRA adapters
fused on read), accumulating dot products in float64 block by block, so memory stays at one tensor per model.
"""

from __future__ import annotations

import math

import numpy as np

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx

from mlx_ssp.errors import UserError
from mlx_ssp.merge.sources import open_source

#: elements per float64 block of the offsets (8 MiB per model)
BLOCK = 1 << 20


def task_vectors(base: str, models: list[str]) -> dict:
    """``{"norms": [|t_i|], "cosine": [[cos(t_i, t_j)]], "tensors": n, "elements": n}`` of the task
    vectors ``t_i = models[i] - base`` over the floating-point tensors all of them hold with one
    shape (others are skipped and counted in ``skipped``). A zero vector's cosines are NaN."""
    if not models:
        raise UserError("task vectors need at least one fine-tuned model")
    b = open_source(base)
    ms = [open_source(m) for m in models]
    n = len(ms)
    gram = np.zeros((n, n), dtype=np.float64)
    used = elements = skipped = 0
    for name, info in b.tensors.items():
        if not all(name in m.tensors and m.tensors[name].shape == info.shape for m in ms) or info.dtype not in (
                "F32", "F16", "BF16"):
            skipped += 1
            continue
        x0 = np.asarray(b.load(name).astype(mx.float32)).ravel()
        xs = [np.asarray(m.load(name).astype(mx.float32)).ravel() for m in ms]
        for lo in range(0, x0.size, BLOCK):  # float64 offsets a block at a time: memory stays at one tensor per model
            ts = np.stack([x[lo:lo + BLOCK].astype(np.float64) for x in xs]) - x0[lo:lo + BLOCK]
            gram += ts @ ts.T
        used += 1
        elements += x0.size
    norms = np.sqrt(np.diag(gram))
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = gram / np.outer(norms, norms)
    return {"norms": [float(v) for v in norms],
            "cosine": [[float(c) if math.isfinite(c) else float("nan") for c in row] for row in cos],
            "tensors": used, "elements": elements, "skipped": skipped}

