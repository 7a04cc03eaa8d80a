"""The MGPO-GRPO policy loss (:func:`policy_loss`): the objective's pieces from :mod:`.objectives`
(ratio, surrogate, aggregation, k3 KL, TIS weights) put together, and its statistics.

Per completion token t of sample i, with ``rho = exp(logp - logp_old)`` (logp_old: the behaviour
log-probs of the sampling policy, at the sampling temperature) and the sample's advantage A'_i:

    l_t = -min(rho * A', clip(rho, 1 - eps_low, 1 + eps_high) * A')      (PPO / GRPO; DAPO's
                                                                          decoupled eps_low/eps_high)
    dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games", c > 1): for A' < 0 the
    objective is additionally bounded, l_t = min(l_t, -c * A'), so a huge ratio on a bad token
    cannot blow the loss up.
    k3 KL (Schulman 2020, "Approximating KL Divergence"; GRPO, arXiv:2402.03300 eq. 4):
    kl_t = exp(ref - logp) - (ref - logp) - 1 >= 0, added as beta * kl_t to each token's loss.

Aggregation over the [B, T] token grid with the completion mask, chosen from :data:`.objectives.AGGREGATIONS`:

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
from typing import NamedTuple

import mlx.core as mx

from mlx_ssp.rl import objectives as O


class LossOutput(NamedTuple):
    loss: mx.array
    stats: dict[str, mx.array]  # this call's values: finalize_totals(totals)
    totals: dict[str, mx.array]  # sum/NAME, n/NAME, max/NAME (see the module docstring)


def token_totals(name: str, per_token: mx.array, mask: mx.array) -> dict[str, mx.array]:
    """Totals of a token-mean statistic: its masked sum and the token count."""
    return {f"sum/{name}": O.masked_sum(per_token, mask), f"n/{name}": mask.sum()}


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
        ratio_fn, sur_fn = O.RATIOS[ratio_level].fn, O.SURROGATES[surrogate].fn
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
        kl = O.k3_kl(logp, mx.stop_gradient(ref_logp.astype(mx.float32)))
        per_tok = per_tok + beta * kl
    loss = O.aggregate(per_tok, m, aggregation, max_tokens)
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
