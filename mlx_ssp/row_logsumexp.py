"""MLX's CPU ``logsumexp`` of float32 rows, bit for bit, taking ``exp`` only where a term can
change the sum.

MLX's CPU kernel (mlx/backend/cpu/logsumexp.cpp, mlx 0.32) takes each row's maximum ``m``, sums
``exp(x_i - m)`` in float32 in index order (one accumulator where the CPU build has no vector
unit, as on x86-64), and returns ``log(sum) + m`` (``m`` itself when it is infinite).

The shortcut. A float32 sum ``s`` is left unchanged by adding ``t < ulp(s) / 2`` (round to
nearest). Every running sum is at least each term already added (the terms are >= 0), and
``ulp(u) / 2 > u * 2^-25`` for any ``u > 0``; so a term under 2^-25 times an earlier term never
changes the sum. Terms are compared in log space: ``x_i`` below the largest ``x`` of the earlier
blocks of the row (blocks of 512) minus 17.5 (< ln 2^-25 = -17.33, room for ``exp``'s rounding)
is skipped; the rest, the candidates (a few thousand of a 49k-token row), go through MLX's own
``exp`` (elementwise, so an element's value does not depend on the array it sits in) and are
summed in index order. :func:`exact_here` checks the result against ``mx.logsumexp`` once per
process (a build whose kernel sums in vector lanes, or an MLX that changes the kernel, falls back
to MLX's op); the tests check it on real-looking rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

BLOCK = 512
#: ln 2^-25 = -17.33: a term exp(-17.5) times an earlier one is under half an ulp of the sum
MARGIN = np.float32(17.5)


def _earlier_block_max(x: np.ndarray) -> np.ndarray:
    """(B, n_blocks): the largest value of the blocks before each block (-inf for the first)."""
    b, v = x.shape
    full = v // BLOCK
    maxes = [x[:, : full * BLOCK].reshape(b, full, BLOCK).max(axis=-1)] if full else []
    if v % BLOCK:
        maxes.append(x[:, full * BLOCK:].max(axis=-1, keepdims=True))
    block_max = np.concatenate(maxes, axis=1)
    out = np.full_like(block_max, -np.inf)
    out[:, 1:] = np.maximum.accumulate(block_max, axis=1)[:, :-1]
    return out


def candidates(x: np.ndarray) -> np.ndarray:
    """(B, V) bool: the terms that may change the sum (those not under an earlier block's largest
    value minus :data:`MARGIN`)."""
    b, v = x.shape
    full = v // BLOCK
    bound = _earlier_block_max(x) - MARGIN
    parts = [(x[:, : full * BLOCK].reshape(b, full, BLOCK) >= bound[:, :full, None]).reshape(b, -1)]
    if v % BLOCK:
        parts.append(x[:, full * BLOCK:] >= bound[:, full:])
    return np.concatenate(parts, axis=1)


def logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """``mx.logsumexp(x, axis=-1)`` of the (B, V) float32 rows ``x`` without NaN, as float32 (B,)."""
    b, v = x.shape
    m = x.max(axis=-1)
    cols = [np.flatnonzero(row) for row in candidates(x)]
    with np.errstate(invalid="ignore"):  # inf - inf in a row whose maximum is infinite: its result is m
        diffs = np.concatenate([row[c] - mi for row, c, mi in zip(x, cols, m)]) if b else np.zeros(0, np.float32)
    terms = np.array(mx.exp(mx.array(diffs)))
    sums = np.empty(b, dtype=np.float32)
    start = 0
    for i, c in enumerate(cols):
        n = len(c)
        sums[i] = np.cumsum(terms[start:start + n], dtype=np.float32)[-1] if n else np.float32(0)
        start += n
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.array(mx.log(mx.array(sums)) + mx.array(m))
    return np.where(np.isinf(m), m, out)


_EXACT: dict[str, bool] = {}


def exact_here() -> bool:
    """Whether :func:`logsumexp_rows` equals ``mx.logsumexp`` on this MLX and device (checked
    once, on rows whose sum depends on the order of its terms)."""
    device = str(mx.default_device())
    if device not in _EXACT:
        rng = np.random.default_rng(0)
        x = (rng.normal(0, 3, (4, 3001)) - 20 * rng.random((4, 1)) * np.arange(3001) / 3001).astype(np.float32)
        x[1, 5] = -np.inf
        want = np.array(mx.logsumexp(mx.array(x), axis=-1))
        _EXACT[device] = np.array_equal(logsumexp_rows(x).view(np.uint32), want.view(np.uint32))
    return _EXACT[device]
