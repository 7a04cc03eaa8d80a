"""The loss of an RL step and its gradient, for one piece of rows at a time.

Step 4 of a step (VibeThinker-1.5B section 3.4; GRPO, DeepSeekMath arXiv:2402.03300 section 4):
the forward runs on prompt + completion, log-probs come from the chunked op
(:func:`mlx_ssp.rl.logprobs.token_logprobs`) at the sampling temperature, and the policy loss
(:func:`mlx_ssp.rl.loss.policy_loss`: clipped surrogate against the old log-probs, optional k3 KL
to the reference, the entropy bonus) is scaled by the piece's share of the batch's aggregation
units, so that summed piece gradients equal the full batch's (:func:`make_loss`).

A piece's rows may share a prefix (the prompt of a group: :mod:`mlx_ssp.rl.prefix`): its keys and
values are computed once per block of rows, each piece's gradient reaches them
(:func:`piece_value_and_grad`), and the prefix's own backward runs once with their sum
(:func:`prefix_grads`). A piece whose log-prob tokens span more than one chunk of the op takes the
two-phase path (:func:`piece_value_and_grad`, ``two_phase``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_ssp.rl import objectives
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.lm_heads import head_of
from mlx_ssp.rl.logprobs import token_logprobs
from mlx_ssp.rl.loss import policy_loss, token_totals
from mlx_ssp.rl.objectives import aggregation_units
from mlx_ssp.rl.prefix import hidden_after, prefix_kv, suffix_hidden


def sequence_hidden_states(model: nn.Module, inputs, prefix: int = 0) -> mx.array:
    """Final hidden states of ``inputs`` [B, L]: of every position, or with ``prefix`` > 0 of the
    positions after the shared prefix (run once: :mod:`mlx_ssp.rl.prefix`), [B, L - prefix, D]."""
    return model.model(inputs) if prefix <= 0 else suffix_hidden(model, inputs, prefix)


def sequence_logprobs(model: nn.Module, inputs, targets, temperature: float, chunk_size, *, entropy: bool = False,
                      save_grad: bool = False, entropy_grad: bool = False, prefix: int = 0,
                      hidden: mx.array | None = None):
    """Per-token log-probs of ``targets`` after ``inputs`` (prompt + completion) at temperature T
    (and the entropy with ``entropy``). ``prefix`` > 0: the rows' first ``prefix`` tokens are
    identical and carry no loss; they run once and their positions get log-prob and entropy 0.
    ``hidden``: the body's output (:func:`sequence_hidden_states`) when the caller has it."""
    h = sequence_hidden_states(model, inputs, prefix) if hidden is None else hidden
    out = token_logprobs(h, head_of(model), targets[:, prefix:], temperature, chunk_size, return_entropy=entropy,
                         save_grad=save_grad, entropy_grad=entropy_grad)
    if prefix <= 0:
        return out
    pad = mx.zeros((inputs.shape[0], prefix), mx.float32)
    if entropy:
        return tuple(mx.concatenate([pad, x], axis=1) for x in out)
    return mx.concatenate([pad, out], axis=1)


def set_params(model: nn.Module, names, arrays) -> None:
    """Put ``arrays`` (the trainable parameters' flat values, or a transform's tracers) into the model."""
    model.update(tree_unflatten(list(zip(names, arrays))))


def flat_kv(kv) -> list:
    """[(k, v), ...] -> [k, v, ...] (the cache as a flat list of arrays for the transforms)."""
    return [x for pair in kv for x in pair] if kv else []


def piece_value_and_grad(model: nn.Module, loss_fn: Callable, mb: dict, kv, names, arrays, two_phase: bool):
    """((loss, aux), d loss / d trainable arrays, d loss / d prefix kv) of one piece of rows.

    ``kv``: the block's shared-prefix keys and values (:func:`mlx_ssp.rl.prefix.prefix_kv`,
    evaluated, no graph) that the rows' suffixes attend to, or None (no prefix: the rows run
    whole). Their gradient is returned so that the prefix's own backward runs once per block
    (:func:`prefix_grads`), however many pieces the block has.

    ``two_phase`` (a piece whose log-prob tokens span more than one chunk of the op: a row longer
    than a chunk): the chunked op evaluates its input chunk by chunk, and inside a gradient trace
    that evaluation keeps every intermediate of the body's forward for the tape (2.5x the body's
    memory at 4 rows of 384 tokens on the demo model, BENCHMARKS "RL step memory"). So the body's
    output h is evaluated outside any trace, dL/dh comes from the loss as a function of h, and the
    body's gradient is its vjp with that cotangent: one more body forward, the body's own memory.
    The head must be frozen there (LoRA). The model holds ``arrays`` again afterwards."""
    n, p = len(arrays), mb.get("prefix", 0)
    kv_flat = flat_kv(kv)

    def body(*xs):
        set_params(model, names, xs[:n])
        if not kv_flat:
            return model.model(mb["inputs"])
        return hidden_after(model, mb["inputs"][:, p:], list(zip(xs[n::2], xs[n + 1::2])))

    primals = [*arrays, *kv_flat]
    try:
        if not two_phase:
            grad_fn = mx.value_and_grad(lambda *xs: loss_fn(model, mb, body(*xs)), argnums=list(range(len(primals))))
            (loss, aux), g = grad_fn(*primals)
        else:
            h = body(*primals)
            mx.eval(h)
            (loss, aux), dh = mx.value_and_grad(lambda x: loss_fn(model, mb, x))(h)
            mx.eval(loss, aux, dh)
            del h
            _, g = mx.vjp(body, primals, [dh])
    finally:
        set_params(model, names, arrays)  # the parameters again, not the transform's tracers
    return (loss, aux), list(g[:n]), list(g[n:])


def prefix_grads(model: nn.Module, tokens: mx.array, dkv: list, names, arrays) -> list:
    """d loss / d trainable arrays through a block's shared prefix ``tokens`` [1, P], given the
    summed gradient ``dkv`` of its keys and values over the block's pieces (chain rule: the
    prefix's forward, then its backward, once per block)."""
    def f(*xs):
        set_params(model, names, xs)
        return flat_kv(prefix_kv(model, tokens))

    try:
        _, g = mx.vjp(f, list(arrays), dkv)
    finally:
        set_params(model, names, arrays)
    return list(g)


def make_loss(cfg: RLConfig, units_total: float) -> Callable:
    """loss(model, mb, hidden=None) for one micro-batch, scaled by its share of the batch's
    aggregation units so that summed micro-batch gradients equal the full batch's; ``hidden``: the
    body's output when the caller computed it (:func:`piece_value_and_grad`)."""
    T = cfg.sampling.temperature
    eps_low, eps_high = objectives.clip_range(cfg)
    bonus = bool(cfg.entropy_coef)  # off (None or 0): the op's entropy stays a statistic, the loss as before

    def loss_fn(model, mb, hidden=None):
        logp, ent = sequence_logprobs(model, mb["inputs"], mb["targets"], T, cfg.chunk_size, entropy=True,
                                      save_grad=True, entropy_grad=bonus, prefix=mb.get("prefix", 0), hidden=hidden)
        old = mb["old"] if mb.get("old") is not None else mx.stop_gradient(logp)
        weights = None
        if cfg.tis_cap is not None:  # rollouts from another engine: truncated importance weights
            weights = objectives.tis_weight(old, mb["behaviour"], cfg.tis_cap, cfg.tis_mode)
        out = policy_loss(
            logp, old, mb["adv"], mb["mask"], eps_low=eps_low, eps_high=eps_high, dual_clip=cfg.dual_clip,
            aggregation=cfg.aggregation, max_tokens=cfg.sampling.max_tokens, beta=cfg.beta,
            ref_logp=mb.get("ref"), entropy=ent, ratio_level=cfg.importance_sampling_level, surrogate=cfg.loss,
            weights=weights,
        )
        loss = out.loss
        if bonus:  # verl's entropy_coeff: the entropy aggregated as the policy loss is, subtracted
            loss = loss - objectives.entropy_bonus(ent, mb["mask"], cfg.entropy_coef, cfg.aggregation,
                                                   cfg.sampling.max_tokens)
        share = aggregation_units(cfg.aggregation, mb["mask"]) / units_total
        return loss * share, (out.totals, mx.stop_gradient(logp))

    return loss_fn


def behaviour_totals(logp: mx.array, behaviour: mx.array, mask: mx.array) -> dict[str, mx.array]:
    """Totals (:func:`mlx_ssp.rl.loss.token_totals`) of |trainer - sampler| log-prob per token."""
    return token_totals("behaviour_logp_absdiff", mx.abs(logp - behaviour), mask)

