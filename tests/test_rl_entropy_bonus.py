"""The entropy bonus (``rl.entropy_coef``): the chunked op's entropy gradient against
mx.grad of a naive unchunked entropy, the loss with the bonus against a naive full-logits formula,
masked tokens carry none of it, coef 0 is the loss of before, and a loop step trains LoRA only."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_ssp  # noqa: F401
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_ssp.rl import objectives
from mlx_ssp.rl.chunk_engines import FusedEngine, KernelEngine, chunk_engine
from mlx_ssp.rl.logprobs import token_logprobs
from mlx_ssp.rl.batch import build_batch
from mlx_ssp.rl.pieces import make_loss
from mlx_ssp.rl.trainer import Trainer
from mlx_ssp.rl.loss import policy_loss
from mlx_ssp.rl.objectives import aggregate, aggregation_units
from test_rl_loop import _cfg, _nested, _policy, _tasks
from test_rl_menu import _records

T = 0.7


def _naive(logits: mx.array, targets: mx.array, temperature: float = T):
    """(log-prob of the targets, entropy) from the full log-softmax: the definition."""
    z = logits.astype(mx.float32) / temperature
    lsm = z - mx.logsumexp(z, axis=-1, keepdims=True)
    ent = -(mx.exp(lsm) * lsm).sum(axis=-1)
    return mx.take_along_axis(lsm, targets[..., None], axis=-1)[..., 0], ent


def _close(a, b, atol=2e-6, rtol=1e-5):
    np.testing.assert_allclose(np.array(a), np.array(b), atol=atol, rtol=rtol)


def _problem(N=13, D=8, V=37, seed=0):
    mx.random.seed(seed)
    head = nn.Linear(D, V, bias=True)
    h = mx.random.normal((N, D))
    t = mx.random.randint(0, V, (N,))
    a, b = mx.random.normal((N,)), mx.random.normal((N,))  # cotangents of log-prob and entropy
    return head, h, t, a, b


@pytest.mark.parametrize("chunk", [1, 5, 13, None])
@pytest.mark.parametrize("path", ["trained_head", "frozen_recompute", "frozen_saved"])
def test_op_entropy_gradient_equals_naive(chunk, path):
    head, h, t, a, b = _problem()
    w0, b0 = head.weight, head.bias
    if path != "trained_head":
        head.freeze()

    def naive(x, w, bias):
        lp, ent = _naive(x @ w.T + bias, t)
        return (lp * a + ent * b).sum()

    def chunked(x, w, bias):
        head.weight, head.bias = w, bias
        lp, ent = token_logprobs(x, head, t, T, chunk, return_entropy=True, entropy_grad=True,
                                 save_grad=path == "frozen_saved")
        return (lp * a + ent * b).sum()

    argnums = (0, 1, 2) if path == "trained_head" else (0,)
    got = mx.grad(chunked, argnums=argnums)(h, w0, b0)
    want = mx.grad(naive, argnums=argnums)(h, w0, b0)
    head.weight, head.bias = w0, b0
    for g, n in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        _close(g, n)
    # and the value is the naive entropy
    _, ent = token_logprobs(h, head, t, T, chunk, return_entropy=True, entropy_grad=True)
    _close(ent, _naive(head(h), t)[1])


def test_tied_and_unknown_heads_entropy_gradient():
    mx.random.seed(3)
    emb = nn.Embedding(29, 8)  # tied head: logits = h @ E^T
    h, t, b = mx.random.normal((2, 6, 8)), mx.random.randint(0, 29, (2, 6)), mx.random.normal((2, 6))

    class Odd(nn.Module):  # not in HEADS: the unchunked path
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 29)

        def __call__(self, x):
            return self.lin(x) * 2.0

    odd = Odd()
    for head, logits_of in ((emb, emb.as_linear), (odd, odd)):
        got = mx.grad(lambda x: (token_logprobs(x, head, t, T, 4, return_entropy=True, entropy_grad=True)[1] * b).sum())(h)
        want = mx.grad(lambda x: (_naive(logits_of(x), t)[1] * b).sum())(h)
        _close(got, want)


def test_without_entropy_grad_the_entropy_is_a_statistic_and_unused_entropy_costs_nothing():
    head, h, t, a, _ = _problem(seed=1)
    head.freeze()
    for save in (False, True):
        g_stat = mx.grad(lambda x: token_logprobs(x, head, t, T, 4, return_entropy=True, save_grad=save)[1].sum())(h)
        assert float(mx.abs(g_stat).max()) == 0.0  # entropy_grad off: as before, no gradient
        # entropy_grad on but only the log-prob used: the log-prob gradient alone
        g_lp = mx.grad(lambda x: (token_logprobs(x, head, t, T, 4, return_entropy=True, entropy_grad=True,
                                                 save_grad=save)[0] * a).sum())(h)
        g_ref = mx.grad(lambda x: (token_logprobs(x, head, t, T, 4, save_grad=save) * a).sum())(h)
        _close(g_lp, g_ref, atol=1e-7)
    with pytest.raises(ValueError, match="return_entropy"):
        token_logprobs(h, head, t, T, entropy_grad=True)


def test_kernels_fall_back_to_the_reference_for_the_entropy_gradient():
    def fake_kernel(logits, targets, temperature):  # stands for a Metal / CUDA launcher
        raise AssertionError("not called")

    assert isinstance(chunk_engine(fake_kernel, T, entropy_grad=False), KernelEngine)
    assert isinstance(chunk_engine(fake_kernel, T, entropy_grad=True), FusedEngine)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_masked_tokens_carry_no_entropy_gradient(aggregation):
    mx.random.seed(4)
    head = nn.Linear(8, 23)
    head.freeze()
    h, t = mx.random.normal((3, 7, 8)), mx.random.randint(0, 23, (3, 7))
    mask = (mx.arange(7)[None] < mx.array([7, 2, 5])[:, None]).astype(mx.float32)

    def bonus(x):
        _, ent = token_logprobs(x, head, t, T, 5, return_entropy=True, entropy_grad=True, save_grad=True)
        return objectives.entropy_bonus(ent, mask, 0.3, aggregation, max_tokens=7)

    g = np.array(mx.grad(bonus)(h))
    m = np.array(mask) > 0
    assert np.abs(g[~m]).max() == 0.0 and np.abs(g[m]).min() > 0
    # the value: coef times the policy loss's aggregation of the naive entropy
    _close(bonus(h), 0.3 * aggregate(_naive(head(h), t)[1], mask, aggregation, 7))


# -- the loss inside the loop ---------------------------------------------------------------------


def _mb(model, recs, adv):
    b = build_batch(recs, adv)
    return {k: b[k] for k in ("inputs", "targets", "mask", "adv", "behaviour")} | {"old": None}


def _lora_model(path, cfg):
    model, tok = _policy(path, cfg)
    for name, p in tree_flatten(model.trainable_parameters()):  # non-zero lora_b: every path is live
        if name.endswith("lora_b"):
            model.update(_nested(name, mx.random.normal(p.shape, key=mx.random.key(1)) * 0.1))
    return model, tok


def test_coef_zero_is_the_loss_of_before(tiny_llama):
    adv = np.random.default_rng(5).normal(size=8).astype(np.float32)
    model, _ = _lora_model(tiny_llama, _cfg())
    mb = _mb(model, _records(), adv)
    units = float(aggregation_units("seq-mean-token-mean", mb["mask"]).item())

    def before(model, mb):  # make_loss as it was: the op's entropy a statistic, no bonus
        h = model.model(mb["inputs"])
        logp, ent = token_logprobs(h, model.lm_head, mb["targets"], 1.0, None, return_entropy=True, save_grad=True)
        out = policy_loss(logp, mx.stop_gradient(logp), mb["adv"], mb["mask"], max_tokens=4, entropy=ent)
        return out.loss * (aggregation_units("seq-mean-token-mean", mb["mask"]) / units)

    want_l, want_g = nn.value_and_grad(model, before)(model, mb)
    for cfg in (_cfg(), _cfg(entropy_coef=0.0)):
        (got_l, _), got_g = nn.value_and_grad(model, make_loss(cfg, units))(model, mb)
        assert np.array_equal(np.array(got_l), np.array(want_l))
        for (k, g), (_, w) in zip(tree_flatten(got_g), tree_flatten(want_g)):
            assert np.array_equal(np.array(g), np.array(w)), k
    assert "entropy_coef" not in _cfg().model_dump() and _cfg(entropy_coef=0.1).model_dump()["entropy_coef"] == 0.1
    with pytest.raises(ValueError, match="entropy_coef"):
        _cfg(entropy_coef=-0.1)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_bonus_gradient_equals_the_naive_formula(tiny_llama, aggregation):
    adv = np.random.default_rng(6).normal(size=8).astype(np.float32)
    cfg = _cfg(entropy_coef=0.05, aggregation=aggregation, chunk_size=7, sampling={"temperature": T, "max_tokens": 4})
    model, _ = _lora_model(tiny_llama, cfg)
    mb = _mb(model, _records(), adv)
    units = float(aggregation_units(aggregation, mb["mask"]).item())

    def naive(model, mb):  # full logits, plain MLX autodiff through log-softmax and entropy
        lp, ent = _naive(model(mb["inputs"]), mb["targets"])
        out = policy_loss(lp, mx.stop_gradient(lp), mb["adv"], mb["mask"], aggregation=aggregation, max_tokens=4)
        share = aggregation_units(aggregation, mb["mask"]) / units
        return (out.loss - 0.05 * aggregate(ent, mb["mask"], aggregation, 4)) * share

    want_l, want_g = nn.value_and_grad(model, naive)(model, mb)
    (got_l, _), got_g = nn.value_and_grad(model, make_loss(cfg, units))(model, mb)
    _close(got_l, want_l, atol=1e-6)
    scale = max(float(mx.abs(w).max()) for _, w in tree_flatten(want_g))
    for (k, g), (_, w) in zip(tree_flatten(got_g), tree_flatten(want_g)):
        _close(g, w, atol=1e-4 * scale, rtol=1e-3)
    # the bonus is not a no-op: without it the gradient differs
    (_, _), g0 = nn.value_and_grad(model, make_loss(_cfg(aggregation=aggregation, chunk_size=7,
                                                         sampling={"temperature": T, "max_tokens": 4}), units))(model, mb)
    assert max(float(mx.abs(a - b).max()) for (_, a), (_, b) in zip(tree_flatten(got_g), tree_flatten(g0))) > 1e-3 * scale


def test_loop_step_logs_entropy_raises_it_and_trains_lora_only(tiny_llama):
    cfg = _cfg(entropy_coef=1.0, optimizer="sgd", learning_rate=0.5, max_grad_norm=None, chunk_size=5)
    model, tok = _lora_model(tiny_llama, cfg)
    before_all = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    tr = Trainer(model, tok, _tasks(), cfg, "/tmp", seed=0)
    recs = _records()
    batch = build_batch(recs, np.zeros(8, np.float32))  # no advantage: only the bonus moves the policy
    ent0 = tr.updater.entropies(batch)
    ok, stats = tr.updater.update(batch)
    assert ok and np.isfinite(stats["entropy"]) and stats["entropy"] > 0
    after = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    changed = {k for k in after if not np.array_equal(after[k], before_all[k])}
    assert changed and changed <= trainable
    # the step ascends the entropy: the mean over completion tokens rises
    m = batch["mask"]
    ent1 = tr.updater.entropies(batch)
    assert float((ent1 * m).sum() / m.sum()) > float((ent0 * m).sum() / m.sum())
