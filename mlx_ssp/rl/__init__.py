"""MGPO-GRPO: the Signal phase (RL with verifiable rewards and MaxEnt-guided prompt weighting).

Pure functions (importable without a model): :mod:`mlx_ssp.rl.mgpo` (group accuracy, D_ME, MGPO
weight, advantages), :mod:`mlx_ssp.rl.objectives` (every piece of the objective, each variant a
registry entry with its settings), :mod:`mlx_ssp.rl.loss` (the policy loss that composes them, its
statistics), :mod:`mlx_ssp.rl.logprobs` (the chunked selective log-softmax op; its parts:
:mod:`mlx_ssp.rl.lm_heads`, :mod:`mlx_ssp.rl.chunk_engines`, :mod:`mlx_ssp.rl.chunked_op`). The
training loop is :mod:`mlx_ssp.rl.trainer`, its parts :mod:`mlx_ssp.rl.policy` (loading and setting
up the policy), :mod:`mlx_ssp.rl.collect` (rollouts), :mod:`mlx_ssp.rl.batch` (advantages, the
training batch), :mod:`mlx_ssp.rl.step` (the update) and :mod:`mlx_ssp.rl.pieces` (the loss and
gradient of a piece of rows); the stage on its own is :mod:`mlx_ssp.rl.stage`; the command
``mlx_ssp rl`` is :mod:`mlx_ssp.commands.rl`.
"""

from mlx_ssp.rl.logprobs import (
    model_token_logprobs,
    naive_token_logprobs,
    selective_log_softmax_reference,
    token_logprobs,
)
from mlx_ssp.rl.loss import policy_loss
from mlx_ssp.rl.objectives import AGGREGATIONS, aggregate, clipped_surrogate, k3_kl
from mlx_ssp.rl.mgpo import (
    SCALE_REWARDS,
    MGPOAdvantages,
    group_advantages,
    group_stats,
    me_divergence,
    mgpo_advantages,
    mgpo_weight,
)

__all__ = [
    "AGGREGATIONS",
    "SCALE_REWARDS",
    "MGPOAdvantages",
    "aggregate",
    "clipped_surrogate",
    "group_advantages",
    "group_stats",
    "k3_kl",
    "me_divergence",
    "mgpo_advantages",
    "mgpo_weight",
    "model_token_logprobs",
    "naive_token_logprobs",
    "policy_loss",
    "selective_log_softmax_reference",
    "token_logprobs",
]
