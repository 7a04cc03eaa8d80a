"""The policy-gradient objectives (GSPO, CISPO, entropy selection, TIS) against independent NumPy formulas on fixed numbers (value and gradient)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx

from mlx_ssp.rl import objectives as O

RNG = np.random.default_rng(0)
LOGP = RNG.normal(-1.5, 0.5, (3, 5)).astype(np.float32)
OLD = (LOGP + RNG.normal(0, 0.3, (3, 5))).astype(np.float32)
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], np.float32)
ADV = np.array([[1.0], [-0.5], [2.0]], np.float32)


def test_gspo_ratio_value_gradient_and_sequence_clip():
    n = MASK.sum(1)
    s = np.exp(((LOGP - OLD) * MASK).sum(1) / n)
    r = np.array(O.sequence_ratio(mx.array(LOGP), mx.array(OLD), mx.array(MASK)))
    assert np.allclose(r, np.repeat(s[:, None], 5, 1), rtol=1e-6)
    assert np.allclose(np.array(O.sequence_ratio(mx.array(LOGP), mx.array(LOGP), mx.array(MASK))), 1.0)  # first update

    def loss(lp):  # seq-mean-token-mean of the unclipped surrogate: -sum_i s_i A_i
        rr = O.sequence_ratio(lp, mx.array(OLD), mx.array(MASK))
        per = -rr * mx.array(ADV)
        return ((per * MASK).sum(1) / MASK.sum(1)).sum()

    g = np.array(mx.grad(loss)(mx.array(LOGP)))
    assert np.allclose(g, -(ADV * s[:, None] / n[:, None]) * MASK, atol=1e-6)  # d s_i / d logp_t = s_i / |y_i|
    # the clip acts on whole sequences: every token of a row is clipped or none is
    far = O.sequence_ratio(mx.array(LOGP + 0.01 * np.arange(3)[:, None]), mx.array(LOGP), mx.array(MASK))
    sur = O.clip_surrogate(far, mx.array(LOGP), mx.array(np.ones((3, 1), np.float32)), eps_low=3e-4, eps_high=4e-4)
    c = np.array(sur.clipped)
    assert [bool(c[i, MASK[i] > 0].all()) for i in range(3)] == [False, True, True]
    assert all(c[i, MASK[i] > 0].all() or not c[i, MASK[i] > 0].any() for i in range(3))


def test_cispo_weight_is_clipped_and_detached():
    eps_low, eps_high = 1.0, 0.28
    ratio = np.exp(LOGP - OLD)
    w = np.clip(ratio, 1 - eps_low, 1 + eps_high)

    def total(lp):
        r = O.token_ratio(lp, mx.array(OLD), mx.array(MASK))
        return (O.cispo_surrogate(r, lp, mx.array(ADV), eps_low=eps_low, eps_high=eps_high).loss * MASK).sum()

    assert np.isclose(float(total(mx.array(LOGP))), float((-w * ADV * LOGP * MASK).sum()), rtol=1e-5)
    g = np.array(mx.grad(total)(mx.array(LOGP)))
    assert np.allclose(g, -w * ADV * MASK, atol=1e-6)  # no term through the weight
    assert (np.abs(g[MASK > 0]) > 0).all()  # clipped tokens keep their gradient (PPO's clip zeroes them)


def test_entropy_selection_keeps_the_stated_fraction():
    ent = mx.array(RNG.random((3, 5)).astype(np.float32))
    for q in (0.2, 0.5, 1.0):
        thr = O.entropy_threshold(ent, mx.array(MASK), q)
        kept = np.array(O.top_entropy_mask(ent, mx.array(MASK), thr))
        assert kept.sum() == math.ceil(q * MASK.sum()) and (kept <= MASK).all()
        e = np.array(ent)
        assert e[kept > 0].min() >= e[(MASK > 0) & (kept == 0)].max(initial=-1)
    assert O.entropy_threshold(ent, mx.zeros((3, 5)), 0.5) == float("inf")


def test_tis_caps_or_masks_the_weight_without_gradient():
    beh = OLD - np.array([[0.0, 0.5, 2.0, 0.0, 0.0]] * 3, np.float32)
    w = np.exp(OLD - beh)
    t = np.array(O.tis_weight(mx.array(OLD), mx.array(beh), 2.0, "truncate"))
    m = np.array(O.tis_weight(mx.array(OLD), mx.array(beh), 2.0, "mask"))
    assert np.allclose(t, np.minimum(w, 2.0)) and np.allclose(m, np.where(w <= 2.0, w, 0.0))
    assert float(mx.grad(lambda o: O.tis_weight(o, mx.array(beh), 2.0).sum())(mx.array(OLD)).sum()) == 0.0
    with pytest.raises(ValueError, match="tis_mode"):
        O.tis_weight(mx.array(OLD), mx.array(beh), 2.0, "clip")


def test_dapo_overlong_penalty_and_truncation_mask():
    assert O.overlong_penalty([10, 80, 90, 100, 120], max_tokens=100, buffer=20) == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert O.overlong_penalty([100, 101], max_tokens=100, buffer=0, factor=2.0) == [0.0, -2.0]
    assert O.truncation_mask(["stop", "length", None]) == [1.0, 0.0, 1.0]
