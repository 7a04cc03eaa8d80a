"""Reward shaping applied to a step's rewards before the advantages (pure NumPy functions).

Long2Short (VibeThinker-3B technical report, arXiv:2606.16140, section 2.2.2, a second stage of math
RL): inside one group, incorrect trajectories keep their reward; for the correct set C,
s_i = 1 / L_i (L = response length in tokens) and

    r'_i = r_i + lambda * (s_i - mean_C s) / max_{j in C} |s_j - mean_C s|,

so the shortest correct answer gains up to ``lambda``, the longest loses, and the shifts sum to zero
over C: the group mean (hence MGPO's p(q) and its weight) is unchanged. When every correct length is
equal (or C has fewer than two members) nothing changes.

Deviations / choices the report does not spell out:
- "correct" is ``reward >= CORRECT_AT`` (0.999, the rule of :class:`mlx_ssp.verify.VerifyResult`);
- L is the record's ``num_tokens`` (the model-sampled tokens; an episode's tool results do not count);
  a length of 0 is read as 1 so that 1/L stays finite;
- groups are shaped after dynamic sampling has chosen them (it looks at the raw rewards), so an
  all-correct group is kept or dropped exactly as without shaping.

:data:`SHAPINGS` maps each ``rl:`` key that turns a shaping on to the function that applies it;
the loop applies every one whose key is set (:func:`apply_shapings`). ``overlong`` is
DAPO's soft length penalty in the last ``buffer`` tokens before the generation limit.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mlx_ssp.rl.objectives import overlong_penalty

#: a reward at or above this is a correct trajectory (as :class:`mlx_ssp.verify.VerifyResult.correct`)
CORRECT_AT = 0.999


def is_correct(rewards) -> np.ndarray:
    return np.asarray(rewards, np.float64) >= CORRECT_AT


def long2short_group(rewards, lengths, lam: float = 0.2) -> np.ndarray:
    """Long2Short shaped rewards of one group (float64 copy; the input is not modified)."""
    r = np.asarray(rewards, np.float64).copy()
    L = np.maximum(np.asarray(lengths, np.float64), 1.0)
    if r.shape != L.shape:
        raise ValueError(f"long2short: {r.shape[0]} rewards but {L.shape[0]} lengths")
    c = is_correct(r)
    if c.sum() < 2:
        return r
    s = 1.0 / L[c]
    dev = s - s.mean()
    scale = np.abs(dev).max()
    # equal lengths: every deviation is 0 (up to rounding); the report says nothing changes
    if scale <= 1e-12 * s.max():
        return r
    r[c] += lam * dev / scale
    return r


def long2short(rewards, lengths, group_ids, lam: float = 0.2) -> np.ndarray:
    """:func:`long2short_group` applied to every group of a batch (``group_ids[i]``: sample i's group)."""
    r = np.asarray(rewards, np.float64)
    L = np.asarray(lengths, np.float64)
    g = np.asarray(group_ids)
    out = r.copy()
    for gid in np.unique(g):
        sel = g == gid
        out[sel] = long2short_group(r[sel], L[sel], lam)
    return out


def _long2short(cfg: Any, rewards, lengths, group_ids, rl_cfg: Any) -> np.ndarray:
    return long2short(rewards, lengths, group_ids, cfg.lambda_)


def _overlong(cfg: Any, rewards, lengths, group_ids, rl_cfg: Any) -> np.ndarray:
    """DAPO's soft overlong punishment (arXiv:2503.14476 section 3.4; :func:`mlx_ssp.rl.objectives.overlong_penalty`)."""
    pen = overlong_penalty([int(n) for n in lengths], rl_cfg.sampling.max_tokens, cfg.buffer, cfg.penalty)
    return np.asarray(rewards, np.float64) + np.asarray(pen, np.float64)


#: ``rl:`` key -> fn(its config, rewards, lengths, group ids, the rl config) -> shaped rewards;
#: applied in this order: Long2Short first, on the verifier's rewards (its correct set is the
#: reward >= 0.999 one; a length penalty applied before it would turn correct answers "incorrect")
SHAPINGS: dict[str, Callable[..., np.ndarray]] = {
    "long2short": _long2short,
    "overlong": _overlong,
}


def shaping_on(rl_cfg: Any) -> bool:
    return any(getattr(rl_cfg, key, None) is not None for key in SHAPINGS)


def apply_shapings(rl_cfg: Any, rewards, lengths, group_ids) -> np.ndarray:
    """Every shaping whose key is set in ``rl_cfg``, in registry order; unchanged when none is."""
    out = np.asarray(rewards, np.float64)
    for key, fn in SHAPINGS.items():
        sub = getattr(rl_cfg, key, None)
        if sub is not None:
            out = fn(sub, out, lengths, group_ids, rl_cfg)
    return out


def correct_length_metrics(groups: list[list[dict]]) -> dict:
    """``pass@1`` (the fraction of correct samples) and ``correct_len_mean`` (mean ``num_tokens`` of
    the correct ones; None when there is none) over every sampled group of a step."""
    recs = [r for g in groups for r in g]
    ok = is_correct([float(r["reward"]) for r in recs]) if recs else np.zeros(0, bool)
    lens = np.array([float(r.get("num_tokens", len(r.get("token_ids", ())))) for r in recs], np.float64)
    return {
        "pass@1": float(ok.mean()) if ok.size else 0.0,
        "correct_len_mean": float(lens[ok].mean()) if ok.any() else None,
        "len_mean": float(lens.mean()) if lens.size else None,
    }
