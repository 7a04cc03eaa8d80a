"""The MGPO-GRPO policy loss: clipped surrogate, aggregation modes, k3 KL, statistics.

Per completion token t of sample i, with ``rho = exp(logp - logp_old)`` (logp_old: the behaviour
log-probs of the sampling policy, at the sampling temperature) and the sample's advantage A'_i:

    l_t = -min(rho * A', clip(rho, 1 - eps_low, 1 + eps_high) * A')      (PPO / GRPO; DAPO's
                                                                          decoupled eps_low/eps_high)
    dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games", c > 1): for A' < 0 the
    objective is additionally bounded, l_t = min(l_t, -c * A'), so a huge ratio on a bad token
    cannot blow the loss up.
    k3 KL (Schulman 2020, "Approximating KL Divergence"; GRPO, arXiv:2402.03300 eq. 4):
    kl_t = exp(ref - logp) - (ref - logp) - 1 >= 0, added as beta * kl_t to each token's loss.

Aggregation over the [B, T] token grid with the completion mask, chosen from :data:`AGGREGATIONS`:

- ``seq-mean-token-mean`` (GRPO as in DeepSeekMath and the VibeThinker papers): mean over each
  sequence's tokens, then mean over sequences;
- ``token-mean`` (DAPO, arXiv:2503.14476): sum over all tokens / number of tokens;
- ``seq-mean-token-sum-norm`` (Dr.GRPO, arXiv:2503.20783): each sequence's token sum divided by a
  constant (the generation budget ``max_tokens``; the longest sequence if not given), then mean
  over sequences.

Statistics (no gradient): clip fraction (tokens whose gradient the clip removed: rho < 1 - eps_low
with A' < 0, or rho > 1 + eps_high with A' > 0), dual-clip fraction, mean ratio, max ratio, mean
KL, mean entropy when given. All computed in float32. Each is also returned as *totals*
(:data:`LossOutput.totals`): ``sum/NAME`` and ``n/NAME`` (a token-weighted sum and its token count)
or ``max/NAME``. Totals of several micro-batches, inner updates or ranks combine exactly with
:func:`merge_totals` (sums add, maxima take the max) and become the whole batch's values once, at
the end, with :func:`finalize_totals`; averaging per-micro-batch means instead weights them by the
micro-batch's share of the loss, which is not its share of the tokens.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import mlx.core as mx

from mlx_ssp.rl import objectives as O


def _masked_sum(x: mx.array, mask: mx.array, axis=None) -> mx.array:
    return (x * mask).sum(axis=axis)


def seq_mean_token_mean(per_token: mx.array, mask: mx.array, max_tokens: int | None = None) -> mx.array:
    """Mean over each sequence's valid tokens, then over sequences that have any."""
    n_tok = mask.sum(axis=-1)
    per_seq = _masked_sum(per_token, mask, axis=-1) / mx.maximum(n_tok, 1.0)
    has = (n_tok > 0).astype(mx.float32)
    return (per_seq * has).sum() / mx.maximum(has.sum(), 1.0)


def token_mean(per_token: mx.array, mask: mx.array, max_tokens: int | None = None) -> mx.array:
    """Sum over all valid tokens of the batch / their number (DAPO)."""
    return _masked_sum(per_token, mask) / mx.maximum(mask.sum(), 1.0)


def seq_mean_token_sum_norm(per_token: mx.array, mask: mx.array, max_tokens: int | None = None) -> mx.array:
    """Each sequence's token sum / a constant (``max_tokens``, else the grid's T), mean over sequences."""
    norm = float(max_tokens) if max_tokens else float(per_token.shape[-1])
    return (_masked_sum(per_token, mask, axis=-1) / norm).mean()


def _token_units(mask: mx.array) -> mx.array:
    return mask.sum()


def _sequence_units(mask: mx.array) -> mx.array:
    return (mask.sum(axis=-1) > 0).sum().astype(mx.float32)


def _row_units(mask: mx.array) -> mx.array:
    return mx.array(float(mask.shape[0]))


class Aggregation(NamedTuple):
    """One aggregation mode: its reduction and the denominator it averages over (the units a
    micro-batch's loss is weighted by, so summed micro-batch gradients equal the full batch's)."""

    reduce: Callable[..., mx.array]  # fn(per_token [B, T], mask [B, T] float, max_tokens) -> scalar
    units: Callable[[mx.array], mx.array]  # fn(mask [B, T]) -> scalar


#: name -> Aggregation(reduce, units)
AGGREGATIONS: dict[str, Aggregation] = {
    "seq-mean-token-mean": Aggregation(seq_mean_token_mean, _sequence_units),
    "token-mean": Aggregation(token_mean, _token_units),
    "seq-mean-token-sum-norm": Aggregation(seq_mean_token_sum_norm, _row_units),
}


def aggregation_units(mode: str, mask: mx.array) -> mx.array:
    """The denominator ``mode`` averages over (for exact micro-batch accumulation)."""
    return AGGREGATIONS[mode].units(mask)


def aggregate(per_token: mx.array, mask: mx.array, mode: str, max_tokens: int | None = None) -> mx.array:
    try:
        fn = AGGREGATIONS[mode]
    except KeyError:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}") from None
    return fn.reduce(per_token, mask.astype(mx.float32), max_tokens)


def k3_kl(logp: mx.array, ref_logp: mx.array) -> mx.array:
    """k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp - logp
    return mx.exp(d) - d - 1.0


def clipped_surrogate(logp, logp_old, advantages, *, eps_low: float = 0.2, eps_high: float = 0.2,
                      dual_clip: float | None = None):
    """Per-token PPO-clip loss and masks. advantages broadcast against logp ([B, 1] or [B, T]).

    Returns (loss [B, T], ratio, clipped mask, dual-clipped mask)."""
    ratio = O.token_ratio(logp, logp_old, None)
    sur = O.clip_surrogate(ratio, logp, advantages, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    return sur.loss, ratio, sur.clipped, sur.dual_clipped


class LossOutput(NamedTuple):
    loss: mx.array
    stats: dict[str, mx.array]  # this call's values: finalize_totals(totals)
    totals: dict[str, mx.array]  # sum/NAME, n/NAME, max/NAME (see the module docstring)


def token_totals(name: str, per_token: mx.array, mask: mx.array) -> dict[str, mx.array]:
    """Totals of a token-mean statistic: its masked sum and the token count."""
    return {f"sum/{name}": _masked_sum(per_token, mask), f"n/{name}": mask.sum()}


def _max(a: float, b: float) -> float:
    """max that propagates NaN whichever side it is on (Python's max does not), as mx.maximum does."""
    return a + b if math.isnan(a) or math.isnan(b) else max(a, b)


def merge_totals(a: dict, b: dict) -> dict:
    """Totals of the union of two sets of tokens: ``sum/`` and ``n/`` keys add, ``max/`` keys take the
    max; a key on one side only is kept as it is. Python floats (the micro-batches' values read back)."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif k.startswith("max/"):
            out[k] = _max(out[k], v)
        else:
            out[k] = out[k] + v
    return out


def finalize_totals(totals: dict) -> dict:
    """Statistic name -> value: ``sum / n`` (0 where no token counted), or the max."""
    out = {}
    for k, v in totals.items():
        kind, _, name = k.partition("/")
        if kind == "sum":
            n = totals[f"n/{name}"]
            out[name] = v / mx.maximum(n, 1.0) if isinstance(v, mx.array) else (v / n if n > 0 else 0.0)
        elif kind == "max":
            out[name] = v
    return out


def policy_loss(
    logp: mx.array,
    logp_old: mx.array,
    advantages: mx.array,
    mask: mx.array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "seq-mean-token-mean",
    max_tokens: int | None = None,
    beta: float = 0.0,
    ref_logp: mx.array | None = None,
    entropy: mx.array | None = None,
    ratio_level: str = "token",
    surrogate: str = "clip",
    weights: mx.array | None = None,
) -> LossOutput:
    """The MGPO-GRPO loss over a [B, T] completion grid. ``advantages`` [B] are the per-sample
    A' (already MGPO-weighted, no gradient); ``mask`` [B, T] marks completion tokens.
    ``ratio_level`` / ``surrogate`` pick entries of :data:`mlx_ssp.rl.objectives.RATIOS` /
    :data:`~mlx_ssp.rl.objectives.SURROGATES` (defaults: token-level PPO clip, i.e. GRPO), with
    ``eps_low`` / ``eps_high`` the chosen one's clip range; ``weights`` [B, T] (no gradient: TIS)
    multiply each token's surrogate."""
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    advantages = mx.stop_gradient(advantages.astype(mx.float32))
    logp = logp.astype(mx.float32)
    logp_old = mx.stop_gradient(logp_old.astype(mx.float32))
    m = mask.astype(mx.float32)
    try:
        ratio_fn, sur_fn = O.RATIOS[ratio_level], O.SURROGATES[surrogate]
    except KeyError:
        raise ValueError(f"unknown ratio level {ratio_level!r} or surrogate {surrogate!r}; valid: "
                         f"{', '.join(O.RATIOS)} / {', '.join(O.SURROGATES)}") from None
    ratio = ratio_fn(logp, logp_old, m)
    sur = sur_fn(ratio, logp, advantages, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    per_tok, clipped, dual = sur.loss, sur.clipped, sur.dual_clipped
    if weights is not None:
        per_tok = per_tok * mx.stop_gradient(weights.astype(mx.float32))
    kl = None
    if beta and ref_logp is not None:
        kl = k3_kl(logp, mx.stop_gradient(ref_logp.astype(mx.float32)))
        per_tok = per_tok + beta * kl
    loss = aggregate(per_tok, m, aggregation, max_tokens)
    sg = mx.stop_gradient
    totals = {
        **token_totals("clip_frac", clipped.astype(mx.float32), m),
        **token_totals("dual_clip_frac", dual.astype(mx.float32), m),
        **token_totals("ratio_mean", sg(ratio), m),
        "max/ratio_max": mx.where(m > 0, sg(ratio), 0.0).max(),  # ratios are > 0: 0 = no token
    }
    if kl is not None:
        totals.update(token_totals("kl", sg(kl), m))
    if entropy is not None:
        totals.update(token_totals("entropy", sg(entropy.astype(mx.float32)), m))
    if weights is not None:
        totals.update(token_totals("tis_weight", sg(weights.astype(mx.float32)), m))
    return LossOutput(loss, finalize_totals(totals), totals)
