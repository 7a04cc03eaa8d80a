"""The training batch of an RL step: rewards shaped, MGPO advantages, padded rows and the loss mask.

Step 3 of a step (VibeThinker-1.5B section 3.4): with ``long2short`` set, the kept groups' rewards
are shaped first (:mod:`mlx_ssp.rl.shaping`: zero-sum among each group's correct samples, so p(q)
is unchanged; VibeThinker-3B section 2.2.2); MGPO advantages A' = w(p) * A
(:func:`mlx_ssp.rl.mgpo.mgpo_advantages`, or its kernel twin); the rows are prompt + completion,
right-padded, and the completion mask selects the tokens that carry the loss (an episode's: the
model's own messages only, not the tool results between them; :func:`build_batch`). DAPO's
overlong filtering (``mask_truncated_completions``) masks the samples cut at the token limit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_ssp.rl import objectives
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.kernels import grouped_advantages
from mlx_ssp.rl.shaping import apply_shapings, shaping_on


def build_batch(records: list[dict], advantages: np.ndarray) -> dict:
    """Right-padded [B, L] inputs/targets of prompt + completion, the loss mask, the behaviour
    log-probs on the mask, and the per-sample advantages.

    Episodes: ``token_ids`` is the whole conversation after the prompt (the model's
    messages and the tool results / user turns rendered between them) and ``model_mask`` marks the
    tokens the model sampled. The forward still runs over the whole conversation (the model's later
    messages are conditioned on the tool results), but the mask is the completion span times
    ``model_mask``, so tool-result and user tokens get no loss, no gradient and no weight in any
    aggregation or statistic. Records without ``model_mask`` (single-turn) are all the model's.
    ``tokens`` counts the forward's tokens (prompt + conversation), ``model_tokens`` the loss's."""
    seqs = [list(r["prompt_token_ids"]) + list(r["token_ids"]) for r in records]
    L = max(len(s) for s in seqs) - 1
    B = len(seqs)
    inputs = np.zeros((B, L), np.int32)
    targets = np.zeros((B, L), np.int32)
    mask = np.zeros((B, L), np.float32)
    old = np.zeros((B, L), np.float32)
    for i, (r, s) in enumerate(zip(records, seqs)):
        n = len(s) - 1
        inputs[i, :n] = s[:-1]
        targets[i, :n] = s[1:]
        p, c = len(r["prompt_token_ids"]), len(r["token_ids"])
        # target position j predicts token j+1: completion tokens are targets p-1 .. p+c-2
        mask[i, p - 1 : p - 1 + c] = model_mask(r)
        # episodes record 0.0 off the model's tokens; masked there anyway, zeroed so no stray value counts
        old[i, p - 1 : p - 1 + c] = np.asarray(r["logprobs"], np.float32)[:c] * mask[i, p - 1 : p - 1 + c]
    return {
        "inputs": mx.array(inputs),
        "targets": mx.array(targets),
        "mask": mx.array(mask),
        "behaviour": mx.array(old),
        "adv": mx.array(advantages.astype(np.float32)),
        "tokens": int(sum(len(s) for s in seqs)),
        "model_tokens": int(mask.sum()),
    }


def mask_truncated(batch: dict, records: list[dict]) -> tuple[dict, int]:
    """The batch with the rows of samples cut at the token limit masked out (DAPO's overlong
    filtering), and how many there were."""
    keep = mx.array(objectives.truncation_mask([r.get("finish_reason") for r in records]))[:, None]
    batch = {**batch, "mask": batch["mask"] * keep}
    batch["model_tokens"] = int(batch["mask"].sum().item())
    return batch, int(len(records) - float(keep.sum().item()))


def model_mask(record: dict) -> np.ndarray:
    """1.0 on the completion tokens the model sampled: ``model_mask`` of an episode record, else
    every token (a single-turn completion is all the model's)."""
    c = len(record["token_ids"])
    m = record.get("model_mask")
    if m is None:
        return np.ones(c, np.float32)
    if len(m) != c:
        raise ValueError(f"record {record.get('task_id')!r}: model_mask has {len(m)} entries for {c} token ids")
    return np.asarray(m, np.float32)


def slice_rows(batch: dict, i: int, j: int) -> dict:
    """Rows ``i:j`` of every array of the batch (the counts and other scalars as they are)."""
    return {k: (v[i:j] if isinstance(v, mx.array) else v) for k, v in batch.items()}


def trim_padding(piece: dict, keep: int = 1) -> dict:
    """The piece's per-token arrays ([rows, L]) cut after its last column with a loss token (at least
    ``keep`` columns). The rows are right-padded to the batch's longest sequence; the columns after
    a piece's last loss token carry no loss and, causal attention looking only back, change nothing
    before them, so the piece's loss and gradient are the same up to float32 rounding (summation
    orders over fewer positions) for less work: a piece of one short row no longer runs as long
    as the longest."""
    mask = np.asarray(piece["mask"])
    L = mask.shape[1]
    used = np.flatnonzero(mask.any(axis=0))
    end = max(keep, int(used[-1]) + 1 if used.size else 0)
    if end >= L:
        return piece
    return {k: (v[:, :end] if isinstance(v, mx.array) and v.ndim == 2 and v.shape[1] == L else v)
            for k, v in piece.items()}


def advantage_batch(cfg: RLConfig, groups: list[list[dict]], rec: dict) -> dict:
    """MGPO advantages A' = w(p) * A of the kept groups (their statistics into ``rec``) and the
    training batch built from them."""
    recs = [r for g in groups for r in g]
    gids = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    rewards = np.array([float(r["reward"]) for r in recs], np.float32)
    if shaping_on(cfg):  # reward shaping: Long2Short, DAPO's overlong penalty
        lengths = np.array([float(r["num_tokens"]) for r in recs], np.float64)
        shaped = apply_shapings(cfg, rewards, lengths, gids)
        rec["shaping_abs_mean"] = float(np.abs(shaped - rewards).mean())
        rewards = shaped.astype(np.float32)
    # the one-pass kernel on Metal/CUDA, the plain-MLX reference (mgpo_advantages) elsewhere
    adv = grouped_advantages(rewards, gids, lam=cfg.mgpo_lambda, scale_rewards=cfg.scale_rewards, eps=cfg.adv_eps,
                             num_groups=len(groups))
    rec["mgpo_weight_mean"] = float(adv.w.mean().item())
    rec["adv_abs_mean"] = float(mx.abs(adv.advantages).mean().item())
    batch = build_batch(recs, np.array(adv.advantages))
    if cfg.mask_truncated_completions:  # DAPO: a sample cut at max_tokens carries no gradient
        batch, rec["truncated_masked"] = mask_truncated(batch, recs)
    return batch
