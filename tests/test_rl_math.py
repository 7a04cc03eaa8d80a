"""MGPO math and the policy loss: exact properties on small arrays."""

from __future__ import annotations

import math

import mlx_ssp  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from mlx_ssp.rl import (
    AGGREGATIONS,
    aggregate,
    clipped_surrogate,
    group_advantages,
    k3_kl,
    me_divergence,
    mgpo_advantages,
    mgpo_weight,
    policy_loss,
)


def test_me_divergence_values():
    d = np.array(me_divergence([0.0, 0.5, 1.0, 0.3]))
    assert d[1] == 0.0
    assert d[0] == pytest.approx(math.log(2), abs=1e-6) and d[2] == pytest.approx(math.log(2), abs=1e-6)
    assert d[3] == pytest.approx(0.3 * math.log(0.6) + 0.7 * math.log(1.4), abs=1e-6)
    assert not np.isnan(d).any()


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0, 3.0])
def test_mgpo_weight_range(lam):
    w = np.array(mgpo_weight(mx.array([0.0, 0.5, 1.0, 0.25, 0.75]), lam))
    assert w[1] == 1.0
    assert w[0] == pytest.approx(2.0**-lam, rel=1e-6) and w[2] == pytest.approx(2.0**-lam, rel=1e-6)
    assert w[3] == pytest.approx(w[4], rel=1e-6)  # symmetric around 0.5
    assert (w >= 2.0**-lam - 1e-7).all() and (w <= 1.0).all()


def _groups(seed=0, G=6, n=5, binary=True):
    rng = np.random.default_rng(seed)
    r = (rng.random(G * n) < 0.5).astype(np.float32) if binary else rng.random(G * n).astype(np.float32)
    gid = np.repeat(np.arange(G), n)
    return r, gid


@pytest.mark.parametrize("binary", [True, False])
def test_advantages_sum_to_zero_per_group(binary):
    r, gid = _groups(binary=binary)
    out = mgpo_advantages(r, gid, lam=2.0)
    a = np.array(out.advantages)
    for g in range(6):
        assert abs(a[gid == g].sum()) < 1e-5


def test_advantages_match_numpy_sample_std():
    r, gid = _groups(seed=3, binary=False)
    out = mgpo_advantages(r, gid, lam=1.5, eps=1e-6)
    for g in range(6):
        x = r[gid == g]
        p = x.mean()
        d = p * np.log(2 * p) + (1 - p) * np.log(2 * (1 - p))
        w = np.exp(-1.5 * d)
        ref = w * (x - x.mean()) / (x.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(np.array(out.advantages)[gid == g], ref, rtol=1e-4, atol=1e-6)
        assert float(out.w[g]) == pytest.approx(w, rel=1e-5)


def test_lambda_zero_is_grpo_exactly():
    r, gid = _groups(seed=1)
    a0 = mgpo_advantages(r, gid, lam=0.0)
    assert (np.array(a0.weights) == 1.0).all()
    assert np.array_equal(np.array(a0.advantages), np.array(group_advantages(r, gid)))


def test_equal_rewards_and_singletons_give_zero():
    r = mx.array([0.7, 0.7, 0.7, 1.0, 1.0, 0.0, 0.0, 0.3])
    gid = mx.array([0, 0, 0, 1, 1, 2, 2, 3])
    for scale in ("group", "batch", "none"):
        a = np.array(mgpo_advantages(r, gid, lam=1.0, scale_rewards=scale).advantages)
        assert (a == 0.0).all(), scale


def test_scale_modes():
    r, gid = _groups(seed=5, binary=False)
    none = np.array(mgpo_advantages(r, gid, lam=0.0, scale_rewards="none").advantages)
    batch = np.array(mgpo_advantages(r, gid, lam=0.0, scale_rewards="batch").advantages)
    means = np.array([r[gid == g].mean() for g in gid])
    np.testing.assert_allclose(none, r - means, atol=1e-6)
    np.testing.assert_allclose(batch, (r - means) / (r.std(ddof=1) + 1e-6), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="group, batch, none"):
        mgpo_advantages(r, gid, scale_rewards="std")


def test_no_gradient_through_weight():
    r, gid = _groups(seed=2, binary=False)
    x = mx.array(r)
    g_mgpo = mx.grad(lambda v: (mgpo_advantages(v, gid, lam=2.0).advantages * mx.arange(30)).sum())(x)
    w = np.array(mgpo_advantages(x, gid, lam=2.0).weights)
    g_grpo = mx.grad(lambda v: (group_advantages(v, gid) * mx.array(w) * mx.arange(30)).sum())(x)
    np.testing.assert_allclose(np.array(g_mgpo), np.array(g_grpo), rtol=1e-5, atol=1e-6)


# -- loss -------------------------------------------------------------------------------------


def test_clipped_surrogate_cases():
    logp_old = mx.zeros((4,))
    logp = mx.log(mx.array([1.0, 1.5, 0.5, 3.0]))
    adv = mx.array([2.0, 1.0, -1.0, -1.0])
    loss, ratio, clipped, dual = clipped_surrogate(logp, logp_old, adv, eps_low=0.2, eps_high=0.3, dual_clip=2.0)
    np.testing.assert_allclose(np.array(loss), [-2.0, -1.3, 0.8, 2.0], rtol=1e-6)
    assert np.array(clipped).tolist() == [False, True, True, False]
    assert np.array(dual).tolist() == [False, False, False, True]
    # the clip removes the gradient of a clipped token
    g = mx.grad(lambda lp: clipped_surrogate(lp, logp_old, adv, eps_low=0.2, eps_high=0.3)[0].sum())(logp)
    assert float(g[1]) == 0.0 and float(g[2]) == 0.0 and float(g[0]) != 0.0


def test_aggregations_match_definitions():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    m = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]], np.float32)
    X, M = mx.array(x), mx.array(m)
    assert set(AGGREGATIONS) == {"seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"}
    seq = np.mean([(x[i] * m[i]).sum() / m[i].sum() for i in range(3)])
    assert float(aggregate(X, M, "seq-mean-token-mean")) == pytest.approx(seq, rel=1e-5)
    assert float(aggregate(X, M, "token-mean")) == pytest.approx((x * m).sum() / m.sum(), rel=1e-5)
    assert float(aggregate(X, M, "seq-mean-token-sum-norm", max_tokens=8)) == pytest.approx(
        ((x * m).sum(1) / 8).mean(), rel=1e-5)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(X, M, "sum")


def test_k3_kl():
    lp = mx.array([-1.0, -2.0, -0.5])
    ref = mx.array([-1.0, -1.0, -3.0])
    kl = np.array(k3_kl(lp, ref))
    d = np.array(ref) - np.array(lp)
    np.testing.assert_allclose(kl, np.exp(d) - d - 1, rtol=1e-6)
    assert kl[0] == 0.0 and (kl >= 0).all()


def test_policy_loss_lambda_zero_equals_grpo_loss_and_grad():
    r, gid = _groups(seed=4, G=3, n=4)
    rng = np.random.default_rng(1)
    logp = mx.array(rng.normal(size=(12, 7)).astype(np.float32) - 2)
    old = mx.array(np.array(logp) + rng.normal(scale=0.1, size=(12, 7)).astype(np.float32))
    mask = mx.array((rng.random((12, 7)) < 0.8).astype(np.float32))
    a_mgpo = mgpo_advantages(r, gid, lam=0.0).advantages
    a_grpo = group_advantages(r, gid)

    def f(a):
        return lambda lp: policy_loss(lp, old, a, mask, eps_low=0.2, eps_high=0.28).loss

    l1, g1 = mx.value_and_grad(f(a_mgpo))(logp)
    l2, g2 = mx.value_and_grad(f(a_grpo))(logp)
    assert float(l1) == float(l2)
    assert np.array_equal(np.array(g1), np.array(g2))
    # and lambda > 0 changes it (non-trivial groups have p != 0.5 here)
    l3 = f(mgpo_advantages(r, gid, lam=2.0).advantages)(logp)
    assert float(l3) != float(l1)


def test_policy_loss_stats():
    logp = mx.array([[0.0, -1.0], [-0.5, -0.5]])
    out = policy_loss(logp, logp, mx.array([1.0, -1.0]), mx.ones((2, 2)), beta=0.1, ref_logp=logp,
                      entropy=mx.full((2, 2), 2.0))
    assert float(out.stats["clip_frac"]) == 0.0
    assert float(out.stats["ratio_mean"]) == 1.0
    assert float(out.stats["kl"]) == 0.0
    assert float(out.stats["entropy"]) == pytest.approx(2.0)
    assert float(out.loss) == pytest.approx(0.0)  # -mean(A) over sequences
