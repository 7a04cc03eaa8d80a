"""Grouped MGPO advantages in one kernel launch, beside their reference :func:`mlx_ssp.rl.mgpo.mgpo_advantages`.

The kernel (``grouped_advantages.metal`` / ``.cu`` beside this module) computes per group the count,
mean, sample std, p, ``D_ME(p || 0.5)`` and MGPO weight ``w = exp(-lambda * D_ME)``, then per sample the
weighted normalized advantage ``w * (r - mean) / (std + eps)`` (VibeThinker-1.5B, arXiv:2511.06221,
section 3.4), with exactly the reference's conventions (sample std, all-equal groups get 0,
``scale_rewards`` group / batch / none) and the same ``MGPOAdvantages`` result.

It is one threadgroup; each thread scans the reward vector for the groups it owns, O(G * N / TG): fine
for a batch of rollouts (hundreds to thousands). Above ``ADV_KERNEL_MAX_N`` samples, or with group ids
outside [0, G), the reference runs instead. Its vjp (never needed by the loss: advantages are
constants) is the reference's, differentiated in plain MLX.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from mlx_ssp.rl.kernels.dispatch import backend
from mlx_ssp.rl.kernels.sources import get_kernel, template_args
from mlx_ssp.rl.mgpo import MGPOAdvantages, mgpo_advantages

ADV_KERNEL_MAX_N = 65536
SCALE_CODES = {"none": 0, "group": 1, "batch": 2}
ADV_OUTPUTS = ("adv", "raw", "weight", "gp", "gd", "gw", "gmean", "gstd", "gcount", "gequal")


def _adv_threadgroup(n: int) -> int:
    return min(1024, max(32, -(-n // 32) * 32))


def _adv_gpu(backend: str, rewards, group_ids, params, sizes, scale: str, num_groups: int):
    n = rewards.shape[0]
    tg = _adv_threadgroup(max(n, num_groups))
    return get_kernel("grouped_advantages", backend)(
        inputs=[rewards, group_ids, params, sizes],
        template=template_args("grouped_advantages", backend, {"TG": tg, "SCALE": SCALE_CODES[scale]}),
        grid=(tg, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(n,)] * 3 + [(num_groups,)] * 7,
        output_dtypes=[mx.float32] * 10,
    )


# backend -> launcher(backend, rewards, group_ids, params, sizes, scale, num_groups) -> the 10 outputs
ADV_LAUNCHERS: dict[str, Callable] = {"metal": _adv_gpu, "cuda": _adv_gpu}


@functools.cache
def _adv_op(backend: str, scale: str, num_groups: int):
    launch = ADV_LAUNCHERS[backend]

    @mx.custom_function
    def adv_op(rewards: mx.array, group_ids: mx.array, params: mx.array, sizes: mx.array):
        outs = list(launch(backend, rewards, group_ids, params, sizes, scale, num_groups))
        return tuple(outs[:2]) + tuple(mx.stop_gradient(o) for o in outs[2:])

    @adv_op.vjp
    def adv_vjp(primals, cotangents, outputs):
        # Advantages are constants of the loss (the RL loop never differentiates them); for
        # completeness the vjp is the reference's, differentiated in plain MLX on the small vector.
        rewards, group_ids, params, sizes = primals
        lam, eps = (float(v) for v in params.tolist())

        def f(r):
            out = mgpo_advantages(r, group_ids, lam=lam, scale_rewards=scale, eps=eps, num_groups=num_groups)
            return [out.advantages, out.raw_advantages]

        _, (dr,) = mx.vjp(f, [rewards], list(cotangents[:2]))
        return dr, mx.zeros_like(group_ids), mx.zeros_like(params), mx.zeros_like(sizes)

    return adv_op


def grouped_advantages_on(
    backend_name: str,
    rewards,
    group_ids,
    *,
    lam: float = 1.0,
    scale_rewards: str = "group",
    eps: float = 1e-6,
    num_groups: int | None = None,
):
    """:func:`grouped_advantages` on a named backend (``metal``, ``cuda``, ``reference`` or a test launcher)."""
    if scale_rewards not in SCALE_CODES:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_CODES)}, got {scale_rewards!r}")
    r = mx.array(rewards, dtype=mx.float32)
    gid = mx.array(group_ids).astype(mx.int32)

    def reference():
        return mgpo_advantages(r, gid, lam=lam, scale_rewards=scale_rewards, eps=eps, num_groups=num_groups)

    if backend_name == "reference" or r.ndim != 1 or gid.shape != r.shape or not 0 < r.size <= ADV_KERNEL_MAX_N:
        return reference()
    lo, hi = mx.stack([gid.min(), gid.max()]).tolist()  # one sync; the reference needs G too
    n_groups = int(num_groups) if num_groups is not None else hi + 1
    if lo < 0 or hi >= n_groups:  # ids outside [0, G): leave it to the reference, never index out of bounds
        return reference()
    params = mx.array([float(lam), float(eps)], dtype=mx.float32)
    sizes = mx.array([r.size, n_groups], dtype=mx.int32)
    outs = _adv_op(backend_name, scale_rewards, n_groups)(r, gid, params, sizes)
    return MGPOAdvantages(*outs[:9])  # the 10th output (all-equal flag per group) is internal


def grouped_advantages(rewards, group_ids, **options) -> MGPOAdvantages:
    """MGPO-weighted group-relative advantages on the best backend -> ``MGPOAdvantages``.

    Same signature and result as :func:`mlx_ssp.rl.mgpo.mgpo_advantages` (the reference, used
    wherever no kernel runs and for more than ``ADV_KERNEL_MAX_N`` samples); ``options`` are its
    keywords ``lam``, ``scale_rewards``, ``eps``, ``num_groups``."""
    return grouped_advantages_on(backend(), rewards, group_ids, **options)
