"""The learning regression test: one round of the recipe on the smallest testbed must raise
held-out pass@1 by a margin that its seed-to-seed spread makes safe.

The model is ``testbed:ci:0`` (pretrained from scratch by the conftest in a background process while
the rest of the suite runs; about 3 minutes of one core). The round is
:func:`mlx_ssp.testbed.learning.learning_round` with its defaults: 60 MGPO-GRPO steps of 8 prompts x
8 samples with LoRA, then pass@1 of the base and the trained model on the same 128 held-out prompts,
8 samples each, with the same sampling seed.

The Spectrum round (``stage: sft``: 8 rollouts per train prompt, diverse selection of the correct
ones, 160 LoRA SFT iterations, fused) is checked the same way on the same model.

The margins: ``python scripts/testbed.py spread --stage rl --seeds 0-9`` (and ``--stage sft``)
measured each round's gain over ten training seeds on build seed 0, and ``--build-seeds 1-2`` over
three builds (another CPU's BLAS kernels may round differently, which makes another build). Each
margin is the lower of the two ``mean - 4 SD``, rounded down to 0.01, so a working pipeline falls
below it about 3 times in 100,000 if the gains are roughly normal (EXPERIMENTS.md, "The learning
regression test", has the tables):

- RL: training seeds mean 0.279, SD 0.012 (0.229); build seeds 0.284 / 0.212 / 0.249, mean 0.248,
  SD 0.036 (0.104): margin 0.10;
- SFT: training seeds mean 0.094, SD 0.019 (0.019); build seeds 0.076 / 0.089 / 0.085 (0.057):
  margin 0.01.

Defects patched in and measured there (one seed each): below the RL margin are an optimizer step
that never updates (gain 0.000), the advantage's sign flipped (-0.365), the targets shifted by one
token (-0.294) and the loss mask shifted one token later (+0.014); the mask shifted one token
earlier is **not** caught (+0.200: it still trains the token that chooses between working and
guessing). SFT: a learning rate of 0 and the loss's sign flipped (EXPERIMENTS.md).
"""

from __future__ import annotations

import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)

#: stage -> the margin: the lower mean - 4 SD of the measured gains, rounded down (module docstring)
MARGINS = {"rl": 0.10, "sft": 0.01}


@pytest.mark.learning
@pytest.mark.slow
@pytest.mark.parametrize("stage", list(MARGINS))
def test_one_round_raises_held_out_pass1(ci_testbed, tmp_path, stage):
    from mlx_ssp.testbed.learning import LearningConfig, learning_round

    r = learning_round(ci_testbed, tmp_path, LearningConfig(stage=stage), seed=0)
    trace = (f"per-step reward {[round(x, 2) for x in r['rewards']]}" if stage == "rl"
             else f"{r['sft_records']} SFT records")
    assert r["gain"] is not None and r["gain"] > MARGINS[stage], (
        f"{stage}: held-out pass@1 {r['base']:.3f} -> {r['trained']} (gain {r['gain']}) is not above the margin "
        f"{MARGINS[stage]}; {trace}")
    assert r["tasks_improved"] > r["tasks_worse"]
