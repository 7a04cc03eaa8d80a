"""Policy-gradient objectives beyond PPO-clip: importance ratios, surrogates, token
selection and importance-sampling correction, each a small pure function over the [B, T] grid of
one batch, registered where there are variants (:data:`RATIOS`, :data:`SURROGATES`).

Ratios (``importance_sampling_level``):

- ``token`` (PPO / GRPO): ``rho_t = exp(logp_t - logp_old_t)``;
- ``sequence`` (GSPO, Zheng et al. 2025, arXiv:2507.18071, section 4): the length-normalised
  sequence ratio ``s_i = exp(mean_t (logp_t - logp_old_t))`` over the sample's completion tokens,
  one value per sequence broadcast to its tokens. With the clip it is clipped per sequence (its clip
  range is separate: GSPO's 3e-4 / 4e-4, section 5.1), and its gradient reaches every token through
  the mean: ``d s_i / d logp_t = s_i / |y_i|``. At the first update (logp == logp_old) it is 1.

Surrogates (``loss``), per token, with the sample's advantage A (MGPO-weighted or not):

- ``clip`` (PPO, Schulman et al. 2017; DAPO's decoupled eps_low / eps_high, arXiv:2503.14476):
  ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, optional dual clip (Ye et al. 2020);
- ``cispo`` (MiniMax-M1, arXiv:2506.13585, section 3.1): ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A
  logp_t``: the importance weight is clipped and detached, so every token keeps a gradient (none is
  zeroed by the clip) and no gradient flows through the weight. The paper sets no lower bound
  (``eps_low = 1``) and tunes the upper one (default 0.28 here, as verl-style implementations do).

Token selection (``top_entropy_quantile``, Wang et al. 2025, arXiv:2506.01939, "Beyond the 80/20
rule"): only the highest-entropy fraction q of the batch's completion tokens carries gradient;
:func:`entropy_threshold` finds the cut over the whole batch (so the micro-batch size changes
nothing) and :func:`top_entropy_mask` applies it.

Importance-sampling correction for rollouts from another engine (``tis_cap``; Yao et al. 2025,
"Your efficient RL framework secretly brings you off-policy RL training"): the trainer's log-probs of
the old policy and the sampler's behaviour log-probs differ; each token's loss is multiplied by the
detached weight ``w = exp(logp_old - logp_behaviour)``, truncated at the cap (``truncate``: min(w, C))
or masked above it (``mask``: w if w <= C else 0).

Entropy bonus (``entropy_coef``, as verl's ``actor.entropy_coeff``: ``policy_loss = pg_loss -
entropy_coeff * agg_loss(entropy, response_mask, loss_agg_mode)`` in its dp_actor; the classic
exploration bonus of A3C / PPO, Mnih et al. 2016, Schulman et al. 2017 eq. 9):
:func:`entropy_bonus` is ``coef * aggregate(H)`` over the policy loss's own mask and aggregation,
subtracted from the loss, so a positive coefficient raises the entropy of softmax(logits / T) at the
sampling temperature. Its gradient is exact (:func:`mlx_ssp.rl.logprobs.token_logprobs` with
``entropy_grad``). Deviations: the coefficient is a constant (no schedule); TIS weights do not
multiply the entropy term (as in verl); with ``top_entropy_quantile`` only the selected tokens carry
the bonus (the mask is the loss's). TRL's GRPOConfig has no entropy bonus (only the selection).

DAPO's overlong shaping and truncation masking act on rewards and samples, not on this grid: see
:func:`overlong_penalty` and :func:`truncation_mask`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import mlx.core as mx
import numpy as np

sg = mx.stop_gradient


def _masked_mean_rows(x: mx.array, m: mx.array) -> mx.array:
    return (x * m).sum(axis=-1, keepdims=True) / mx.maximum(m.sum(axis=-1, keepdims=True), 1.0)


# -- ratios ---------------------------------------------------------------------------------------


def token_ratio(logp: mx.array, logp_old: mx.array, mask: mx.array) -> mx.array:
    """Per-token ``exp(logp - logp_old)`` ([B, T])."""
    return mx.exp(logp - logp_old)


def sequence_ratio(logp: mx.array, logp_old: mx.array, mask: mx.array) -> mx.array:
    """GSPO's length-normalised sequence ratio, broadcast to every token of the row ([B, T])."""
    s = mx.exp(_masked_mean_rows(logp - logp_old, mask))
    return mx.broadcast_to(s, logp.shape)


class Ratio(NamedTuple):
    """An importance-ratio level: ``fn(logp, logp_old, mask) -> [B, T]`` and the config keys of its
    clip range (a surrogate with its own range overrides them)."""

    fn: Callable[[mx.array, mx.array, mx.array], mx.array]
    clip_keys: tuple[str, str]


#: ``importance_sampling_level`` -> its ratio and clip-range keys
RATIOS: dict[str, Ratio] = {
    "token": Ratio(token_ratio, ("eps_low", "eps_high")),
    "sequence": Ratio(sequence_ratio, ("seq_eps_low", "seq_eps_high")),  # GSPO's own range (its 5.1)
}


# -- surrogates -----------------------------------------------------------------------------------


class Surrogate(NamedTuple):
    """Per-token loss [B, T] and the masks of the tokens the clip acted on (statistics)."""

    loss: mx.array
    clipped: mx.array
    dual_clipped: mx.array


def clip_surrogate(ratio: mx.array, logp: mx.array, adv: mx.array, *, eps_low: float, eps_high: float,
                   dual_clip: Optional[float] = None) -> Surrogate:
    """PPO's clipped surrogate (``logp`` unused: the gradient flows through the ratio)."""
    s1 = ratio * adv
    s2 = mx.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -mx.minimum(s1, s2)
    clipped = ((ratio < 1.0 - eps_low) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))
    dual = mx.zeros(loss.shape, dtype=mx.bool_)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = mx.where(adv < 0, mx.minimum(loss, bound), loss)
    return Surrogate(loss, clipped, dual)


def cispo_surrogate(ratio: mx.array, logp: mx.array, adv: mx.array, *, eps_low: float, eps_high: float,
                    dual_clip: Optional[float] = None) -> Surrogate:
    """CISPO: ``-sg(clip(ratio)) * A * logp`` (``dual_clip`` does not apply)."""
    w = sg(mx.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    loss = -w * adv * logp
    clipped = (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)  # the weight was capped (the gradient stays)
    return Surrogate(loss, clipped, mx.zeros(loss.shape, dtype=mx.bool_))


class SurrogateEntry(NamedTuple):
    """A surrogate: ``fn(ratio, logp, adv, *, eps_low, eps_high, dual_clip) -> Surrogate`` and the
    config keys of its own clip range (None: the ratio level's)."""

    fn: Callable[..., Surrogate]
    clip_keys: Optional[tuple[str, str]]


#: ``loss`` -> its surrogate and clip-range keys
SURROGATES: dict[str, SurrogateEntry] = {
    "clip": SurrogateEntry(clip_surrogate, None),
    "cispo": SurrogateEntry(cispo_surrogate, ("cispo_eps_low", "cispo_eps_high")),  # bounds on the weight
}


def clip_range(cfg) -> tuple[float, float]:
    """``(eps_low, eps_high)`` of the configured objective (an ``rl:`` config): the surrogate's own
    range if it has one (CISPO's weight bounds), else the ratio level's (GSPO's sequence range,
    PPO's token range)."""
    keys = SURROGATES[cfg.loss].clip_keys or RATIOS[cfg.importance_sampling_level].clip_keys
    return getattr(cfg, keys[0]), getattr(cfg, keys[1])


# -- aggregation and KL ---------------------------------------------------------------------------


def masked_sum(x: mx.array, mask: mx.array, axis=None) -> mx.array:
    return (x * mask).sum(axis=axis)


def seq_mean_token_mean(per_token: mx.array, mask: mx.array, max_tokens: int | None = None) -> mx.array:
    """Mean over each sequence's valid tokens, then over sequences that have any."""
    n_tok = mask.sum(axis=-1)
    per_seq = masked_sum(per_token, mask, axis=-1) / mx.maximum(n_tok, 1.0)
    has = (n_tok > 0).astype(mx.float32)
    return (per_seq * has).sum() / mx.maximum(has.sum(), 1.0)


def token_mean(per_token: mx.array, mask: mx.array, max_tokens: int | None = None) -> mx.array:
    """Sum over all valid tokens of the batch / their number (DAPO)."""
    return masked_sum(per_token, mask) / mx.maximum(mask.sum(), 1.0)


def seq_mean_token_sum_norm(per_token: mx.array, mask: mx.array, max_tokens: int | None = None) -> mx.array:
    """Each sequence's token sum / a constant (``max_tokens``, else the grid's T), mean over sequences."""
    norm = float(max_tokens) if max_tokens else float(per_token.shape[-1])
    return (masked_sum(per_token, mask, axis=-1) / norm).mean()


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
    ratio = token_ratio(logp, logp_old, None)
    sur = clip_surrogate(ratio, logp, advantages, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    return sur.loss, ratio, sur.clipped, sur.dual_clipped



# -- token selection and IS correction ------------------------------------------------------------


def entropy_threshold(entropy: mx.array, mask: mx.array, quantile: float) -> float:
    """The entropy at or above which a token is among the top ``quantile`` fraction of the masked
    tokens (ties at the cut are all kept; at least one token is kept when any is masked)."""
    e = np.asarray(entropy, np.float32)[np.asarray(mask) > 0]
    if e.size == 0:
        return float("inf")
    k = max(1, int(np.ceil(quantile * e.size)))
    return float(np.sort(e)[::-1][k - 1])


def top_entropy_mask(entropy: mx.array, mask: mx.array, threshold: float) -> mx.array:
    """``mask`` restricted to tokens with entropy >= ``threshold`` (float32)."""
    return mask.astype(mx.float32) * (entropy >= threshold).astype(mx.float32)


TIS_MODES = ("truncate", "mask")


def tis_weight(logp_old: mx.array, behaviour: mx.array, cap: float, mode: str = "truncate") -> mx.array:
    """Detached per-token weight ``exp(logp_old - behaviour)``, truncated at or masked above ``cap``."""
    w = mx.exp(sg(logp_old) - sg(behaviour))
    if mode == "truncate":
        return mx.minimum(w, cap)
    if mode == "mask":
        return mx.where(w <= cap, w, 0.0)
    raise ValueError(f"unknown tis_mode {mode!r}; valid: {', '.join(TIS_MODES)}")


def entropy_bonus(entropy: mx.array, mask: mx.array, coef: float, aggregation: str,
                  max_tokens: Optional[int] = None) -> mx.array:
    """``coef * aggregate(entropy)`` with the policy loss's mask and aggregation (a scalar to subtract
    from the loss; the gradient flows through ``entropy``)."""
    return coef * aggregate(entropy.astype(mx.float32), mask, aggregation, max_tokens)


# -- DAPO's reward-side pieces (pure, on Python lists) ---------------------------------------------


def overlong_penalty(lengths: list[int], max_tokens: int, buffer: int, factor: float = 1.0) -> list[float]:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), added to each sample's reward: 0
    up to ``max_tokens - buffer`` tokens, then falling linearly to ``-factor`` at ``max_tokens``
    (and ``-factor`` beyond)."""
    start = max_tokens - buffer
    out = []
    for n in lengths:
        if n <= start or buffer <= 0:
            out.append(0.0 if n <= max_tokens else -factor)
        elif n <= max_tokens:
            out.append(factor * (start - n) / buffer)
        else:
            out.append(-factor)
    return out


def truncation_mask(finish_reasons: list[Optional[str]]) -> list[float]:
    """DAPO's overlong filtering: 0 for a sample cut off by the token limit, else 1."""
    return [0.0 if r == "length" else 1.0 for r in finish_reasons]
