"""A constructed RL batch with known ratios, and a worker that logs its
statistics: ``python tests/rl_defects_worker.py MODEL_DIR OUT.json [MICRO_BATCH]``, as one
process or on each rank under ``mlx.launch -n 2``.

Three completions of 2, 5 and 8 tokens. The behaviour log-probs are set from the trainer's own
log-probs so that ``rho = exp(logp - logp_behaviour)`` takes the values in :data:`RATIOS`; with
eps 0.2 and the advantages in :data:`ADV` exactly 5 of the 15 tokens are clipped (1 + 2 + 2).
"""

from __future__ import annotations

import json
import math
import sys

import mlx.core as mx
import numpy as np

import mlx_ssp  # noqa: F401

RATIOS = [
    [1.7, 1.0],  # A > 0: 1.7 > 1.2 is clipped
    [0.5, 0.7, 1.0, 1.3, 0.9],  # A < 0: 0.5 and 0.7 < 0.8 are clipped
    [1.25, 1.5, 1.0, 1.0, 0.6, 1.1, 1.0, 1.0],  # A > 0: 1.25 and 1.5 are clipped
]
ADV = [1.0, -1.0, 0.5]
#: the whole batch's values, by hand
CLIP_FRAC = 5 / 15
RATIO_MAX = 1.7
RATIO_MEAN = sum(map(sum, RATIOS)) / 15
ABSDIFF = sum(abs(math.log(r)) for row in RATIOS for r in row) / 15


def rl_config(micro_batch_size: int):
    from mlx_ssp.rl.config import RLConfig

    return RLConfig(steps=1, batch_size=3, group_size=2, sampling={"temperature": 0.8, "max_tokens": 8}, mu=1,
                    old_logprobs="behaviour", eps_low=0.2, eps_high=0.2, optimizer="sgd", learning_rate=1e-3,
                    micro_batch_size=micro_batch_size, progress=False)


def constructed_case(model, temperature: float = 0.8):
    """(records, advantages) of the constructed batch for this model."""
    from mlx_ssp.rl.batch import build_batch
    from mlx_ssp.rl.pieces import sequence_logprobs

    rng = np.random.default_rng(0)
    recs = [{"prompt_token_ids": rng.integers(3, 200, 3).tolist(), "token_ids": rng.integers(3, 200, len(r)).tolist(),
             "logprobs": [0.0] * len(r)} for r in RATIOS]
    adv = np.array(ADV, np.float32)
    batch = build_batch(recs, adv)
    logp = np.array(sequence_logprobs(model, batch["inputs"], batch["targets"], temperature, None))
    for i, (r, rho) in enumerate(zip(recs, RATIOS)):
        p = len(r["prompt_token_ids"])
        trainer = logp[i, p - 1 : p - 1 + len(rho)]
        r["logprobs"] = (trainer - np.log(np.array(rho, np.float32))).tolist()
    return recs, adv


def logged_stats(model_dir: str, micro_batch_size: int) -> dict:
    """The statistics one training update of the constructed batch logs."""
    from mlx_ssp.models import load_model
    from mlx_ssp.rl.batch import build_batch
    from mlx_ssp.rl.policy import setup_model
    from mlx_ssp.rl.trainer import Trainer

    cfg = rl_config(micro_batch_size)
    model, tok, _ = load_model(model_dir)
    setup_model(model, cfg)
    recs, adv = constructed_case(model, cfg.sampling.temperature)
    tr = Trainer(model, tok, [], cfg, "/nonexistent", seed=0)
    ok, stats = tr.updater.update(build_batch(recs, adv))
    assert ok
    return stats


if __name__ == "__main__":
    from mlx_ssp import distributed as dist

    res = logged_stats(sys.argv[1], int(sys.argv[3]) if len(sys.argv) > 3 else 16)
    if dist.is_main():
        with open(sys.argv[2], "w") as f:
            json.dump({"size": dist.size(), **res}, f)
