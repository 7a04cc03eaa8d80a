"""Nucleus (top-p) thresholds on the CPU, equal to mlx-lm's ``apply_top_p`` bit for bit, mostly
without sorting whole rows.

mlx-lm's ``apply_top_p`` sorts each row of log-probs, takes MLX's ``exp`` of the sorted values,
sums them from the top in float32 (a sequential reverse cumsum) and keeps the tokens whose
log-prob is at least the one where the running sum first reaches ``top_p`` times the row total.
Only the top of the row decides the threshold; the long tail only enters through the row total.

The shortcut. In a sequential float32 sum, adding ``x`` to a running sum ``s`` returns ``s``
unchanged when ``x < ulp(s) / 2`` (round to nearest), and a sum taken largest first only meets
smaller values after that. For a row of normalised log-probs the sum of the candidates, the
values with probability at least about 2^-25, is close to 1; once it is at least 0.5, half an ulp
is at least 2^-25, so every value below the candidates leaves the sum as it is: the candidates'
sum *is* mlx-lm's row total, exactly. So each row's candidates (log-prob >= -17.4, ~10% of the
demo model's 49k-token rows; the margin under ln 2^-25 = -17.33 covers MLX's ``exp`` rounding) are
sorted and summed, and the threshold is read off them. A row that does not qualify (a candidate
sum under 0.5 or not finite, which normalised log-probs never give; a NaN) is handled by the
full sort: NumPy's sort of the whole row, then the same arithmetic. The probabilities are MLX's
``exp`` of the float32 values in both cases (MLX's CPU ``exp`` is elementwise, so the value of an
element does not depend on the array it sits in; tests check it, and :func:`exp_exact_here` checks
it once per process, every row taking the full sort if it fails), and the sums run in the same
sequential float32 order as mlx-lm's reverse cumsum (tests check the masks against mlx-lm's on
peaked, flat, tied, truncated and float16 rows).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_ssp.keyed_noise import shifted_columns

#: candidates: log-prob >= this; exp(-17.4) < 2^-25 (= exp(-17.33)) with room for exp's rounding
CANDIDATE_LOGPROB = -17.4
#: the candidates' sum from which every smaller value is under half an ulp (2^-25 at 0.5)
MIN_EXACT_TOTAL = np.float32(0.5)


def _mlx_exp(values: np.ndarray) -> np.ndarray:
    """MLX's float32 exp of ``values`` (the probabilities mlx-lm computes, not NumPy's)."""
    return np.array(mx.exp(mx.array(values).astype(mx.float32)))


_EXP_EXACT: dict[str, bool] = {}


def exp_exact_here() -> bool:
    """Whether MLX's ``exp`` of columns gathered at shifted positions (an odd-sized subset, the row
    reversed) equals its ``exp`` of the full row there, bit for bit (checked once per device): the
    shortcut exponentiates the candidates apart from the rest of their row."""
    device = str(mx.default_device())
    if device not in _EXP_EXACT:
        row = np.linspace(-20.0, 0.0, 1001, dtype=np.float32) + np.float32(1e-3) * np.sin(np.arange(1001),
                                                                                          dtype=np.float32)
        full = _mlx_exp(row).view(np.uint32)
        _EXP_EXACT[device] = all(np.array_equal(_mlx_exp(row[c]).view(np.uint32), full[c])
                                 for c in shifted_columns(len(row)))
    return _EXP_EXACT[device]


def _threshold_full(row: np.ndarray, top_p: np.float32) -> np.ndarray:
    """mlx-lm's threshold of one row by sorting all of it (the fallback)."""
    ordered = np.sort(row)
    probs = _mlx_exp(ordered)
    # the sums from the top down, in the same sequential float32 order as mlx-lm's reverse cumsum
    from_top = np.cumsum(probs[::-1], dtype=np.float32)
    # mlx-lm's mass above the i-th smallest is from_top[V - 2 - i] (0 for the largest, never dropped)
    num_dropped = int((from_top[:-1] >= top_p * from_top[-1]).sum())
    return ordered[num_dropped]


def thresholds(x: np.ndarray, top_p: float) -> tuple[np.ndarray, list]:
    """For each row of the (B, V) float32 or float16 log-probs ``x``: the threshold of
    ``apply_top_p(x, top_p)`` (tokens with a log-prob below it are dropped), and the columns of
    the row's candidates (a superset of the kept tokens, ascending), or None where the row took the
    full sort. Returns ``(thresholds (B,) of x's dtype, [columns or None per row])``."""
    p = np.float32(top_p)
    lo = np.asarray(CANDIDATE_LOGPROB, dtype=x.dtype)
    has_nan = np.isnan(x).any(axis=-1)
    shortcut = exp_exact_here()  # else every row takes the full sort (mlx-lm's own arithmetic)
    cols = [None if bad or not shortcut else np.flatnonzero(row >= lo) for row, bad in zip(x, has_nan)]
    # one MLX exp for the candidates of every row, each row's sorted largest first
    tops = [np.sort(row[c])[::-1] if c is not None else row[:0] for row, c in zip(x, cols)]
    probs = _mlx_exp(np.concatenate(tops)) if tops else np.zeros(0, np.float32)
    out = np.empty(x.shape[0], dtype=x.dtype)
    start = 0
    for i, top in enumerate(tops):
        n = len(top)
        sums = np.cumsum(probs[start:start + n], dtype=np.float32)
        start += n
        total = sums[-1] if n else np.float32(0)
        if cols[i] is None or not (np.isfinite(total) and total >= MIN_EXACT_TOTAL):
            out[i] = _threshold_full(x[i], p)
            cols[i] = None
            continue
        # the first rank whose running sum reaches top_p * total (the last rank at the latest)
        out[i] = top[min(int(np.searchsorted(sums, p * total, side="left")), n - 1)]
    return out, cols


def kept_columns(x: np.ndarray, thr: np.ndarray, cols: list) -> list[np.ndarray]:
    """The columns each row keeps (log-prob >= its threshold), ascending, from its candidates
    where it has them."""
    return [np.flatnonzero(row >= t) if c is None else c[row[c] >= t] for row, t, c in zip(x, thr, cols)]
