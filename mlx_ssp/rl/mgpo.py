"""MGPO: MaxEnt-Guided Policy Optimization weights and group-relative advantages.

Source: VibeThinker-1.5B (arXiv:2511.06221) section 3.4; VibeThinker-3B (arXiv:2606.16140)
section 2.2.1. For a prompt q with G rollouts and rewards r_1..r_G:

- group accuracy ``p(q) = mean(r)`` (binary rewards; with continuous rewards in [0, 1] it is the
  mean reward, clipped to [0, 1] for the divergence);
- ``D_ME(p || 0.5) = p ln(2p) + (1 - p) ln(2(1 - p))`` with ``0 ln 0 = 0``: the KL divergence of
  Bernoulli(p) from the maximum-entropy Bernoulli(0.5); 0 at p = 0.5, ln 2 at p in {0, 1};
- ``w(q) = exp(-lambda * D_ME)`` in [2^-lambda, 1]; lambda = 0 gives w = 1 (plain GRPO);
- group-relative advantage (GRPO, DeepSeekMath arXiv:2402.03300 section 4.1.2)
  ``A_i = (r_i - mean(r)) / (std(r) + eps)``, and ``A'_i = w(q) * A_i`` with no gradient through w.

Choices the papers leave open (the custom kernels must match them exactly):

- std is the *sample* standard deviation (divisor G - 1), as TRL's and verl's GRPO compute it;
  ``eps`` is added to the std, outside the square root: ``(r - mean) / (std + eps)``;
- ``scale_rewards``: ``group`` divides by the group's std, ``batch`` by the sample std of all
  rewards in the batch (one number), ``none`` does not divide (Dr.GRPO, arXiv:2503.20783);
- a group whose rewards are all equal (including a group of size 1) has A = 0 exactly, whatever
  the float rounding of its mean (its std is 0 and ``(r - mean)`` would be rounding noise / eps);
- every group id in [0, G) that has no sample gets p = 0, w = 2^-lambda (unused).

All functions take MLX arrays (lists and NumPy arrays are converted) and return float32 arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

SCALE_REWARDS = ("group", "batch", "none")


class MGPOAdvantages(NamedTuple):
    """Output of :func:`mgpo_advantages`. Per sample [N]: ``advantages`` (A' = w * A),
    ``raw_advantages`` (A), ``weights`` (w of the sample's group). Per group [G]: ``p``,
    ``d_me``, ``w``, ``mean``, ``std`` (sample std), ``count``."""

    advantages: mx.array
    raw_advantages: mx.array
    weights: mx.array
    p: mx.array
    d_me: mx.array
    w: mx.array
    mean: mx.array
    std: mx.array
    count: mx.array


def _xlog2x(x: mx.array) -> mx.array:
    """x ln(2x) with 0 ln 0 = 0 (no NaN for x = 0)."""
    safe = mx.where(x > 0, x, 1.0)
    return mx.where(x > 0, x * mx.log(2.0 * safe), 0.0)


def me_divergence(p) -> mx.array:
    """D_ME(p || 0.5) = p ln(2p) + (1 - p) ln(2(1 - p)), 0 ln 0 = 0 (VibeThinker-1.5B eq. in 3.4).

    p is clipped to [0, 1]; the result is in [0, ln 2]."""
    p = mx.clip(mx.array(p, dtype=mx.float32), 0.0, 1.0)
    return _xlog2x(p) + _xlog2x(1.0 - p)


def mgpo_weight(p, lam: float) -> mx.array:
    """MGPO weight w = exp(-lambda * D_ME(p || 0.5)): 1 at p = 0.5, 2^-lambda at p in {0, 1}."""
    if lam < 0:
        raise ValueError(f"lambda must be >= 0, got {lam}")
    return mx.exp(-float(lam) * me_divergence(p))


def _onehot(group_ids: mx.array, num_groups: int) -> mx.array:
    return (group_ids[:, None] == mx.arange(num_groups)[None, :]).astype(mx.float32)


def group_stats(rewards, group_ids, num_groups: int | None = None):
    """Per-group (count, mean, sample std, all-equal flag) of rewards [N] by group_ids [N]."""
    r = mx.array(rewards, dtype=mx.float32)
    gid = mx.array(group_ids).astype(mx.int32)
    if r.ndim != 1 or gid.shape != r.shape:
        raise ValueError(f"rewards and group_ids must be 1-D of equal length, got {r.shape} and {gid.shape}")
    G = int(num_groups) if num_groups is not None else (int(gid.max().item()) + 1 if r.size else 0)
    oh = _onehot(gid, G)  # [N, G]; N = batch x group size is small, so a one-hot matmul is fine
    count = oh.sum(axis=0)
    mean = (r @ oh) / mx.maximum(count, 1.0)
    centered = r - mean[gid]
    var = ((centered * centered) @ oh) / mx.maximum(count - 1.0, 1.0)
    std = mx.sqrt(var)
    hi = mx.where(oh > 0, r[:, None], -mx.inf).max(axis=0)
    lo = mx.where(oh > 0, r[:, None], mx.inf).min(axis=0)
    equal = hi <= lo  # also true for a group of one sample
    return count, mean, std, equal


def group_advantages(rewards, group_ids, *, scale_rewards: str = "group", eps: float = 1e-6,
                     num_groups: int | None = None) -> mx.array:
    """GRPO advantages (r - mean_group) / (std + eps); see the module docstring for the choices."""
    return mgpo_advantages(rewards, group_ids, lam=0.0, scale_rewards=scale_rewards, eps=eps,
                           num_groups=num_groups).raw_advantages


def mgpo_advantages(rewards, group_ids, *, lam: float = 1.0, scale_rewards: str = "group", eps: float = 1e-6,
                    num_groups: int | None = None) -> MGPOAdvantages:
    """MGPO-weighted group advantages A' = w(p(q)) * A for rewards [N] and group_ids [N] in [0, G).

    lam = 0 is plain GRPO (w = 1 exactly). No gradient flows through w (stop_gradient)."""
    if lam < 0:
        raise ValueError(f"lambda must be >= 0, got {lam}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    r = mx.array(rewards, dtype=mx.float32)
    gid = mx.array(group_ids).astype(mx.int32)
    count, mean, std, equal = group_stats(r, gid, num_groups)
    centered = mx.where(equal[gid], 0.0, r - mean[gid])
    if scale_rewards == "group":
        adv = centered / (std[gid] + eps)
    elif scale_rewards == "batch":
        n = r.size
        bstd = mx.sqrt(((r - r.mean()) ** 2).sum() / max(n - 1, 1))
        adv = centered / (bstd + eps)
    else:
        adv = centered
    p = mx.clip(mean, 0.0, 1.0)
    d = me_divergence(p)
    w = mx.stop_gradient(mx.exp(-float(lam) * d)) if lam else mx.ones_like(d)
    weights = w[gid]
    return MGPOAdvantages(weights * adv, adv, weights, p, d, w, mean, std, count)
