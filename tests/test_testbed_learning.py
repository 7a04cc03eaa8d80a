"""The learning regression test (issue 21): one Spectrum-phase round on the smallest testbed model
must raise held-out pass@1 by more than its seed-to-seed noise.

``testbed:micro:0`` (one domain, ``sum`` at 2-3 terms, 2 layers of width 64) is pretrained here from
scratch, then :func:`mlx_ssp.testbed.learning.learning_round` runs the project's own stages on it:
K=8 rollouts per train prompt, diverse selection of the correct ones, LoRA SFT, and pass@1 on
held-out prompts (never in the pretraining corpus) for the base and the specialist, paired (same
tasks, same sampling seed). A change that silently stops learning (an adapter that never updates,
a flipped loss sign, a mis-shifted target) leaves the gain at or below zero and fails.

The margin comes from ``python scripts/testbed.py spread --seeds 0-9`` (EXPERIMENTS.md, "The
testbed"). The build seed is fixed and the training seed varies. The rule is ``mean - 4 SD`` of the
gain, rounded down to 0.01, and it must be above 0: a learning rate of 0 gives a gain of exactly 0,
since the fused model is then the base and the eval is paired. NOT MEASURED YET: the machine was
saturated when this was written. Until ``MARGIN`` is set from a measured spread, the test skips and
names the command to run.
"""

from __future__ import annotations

import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp.testbed.learning import LearningConfig

#: the build seed and training seed this test runs (the spread was measured over training seeds)
BUILD_SEED, SEED = 0, 0
CONFIG = LearningConfig()
MARGIN: float | None = None  # mean - 4 SD of the measured gains (docstring); None: not measured yet


@pytest.mark.slow
def test_one_round_raises_held_out_pass1(tmp_path):
    if MARGIN is None:
        pytest.skip("the learning margin is not measured yet: run `python scripts/testbed.py spread --seeds 0-9`")
    from mlx_ssp.testbed.build import build
    from mlx_ssp.testbed.learning import learning_round

    model = build("micro", BUILD_SEED, tmp_path / "model", progress=False)
    r = learning_round(model, tmp_path / "work", CONFIG, seed=SEED)
    assert r["sft_records"] >= CONFIG.batch_size, r  # the round had something to learn from
    assert 0.05 <= r["base"] <= 0.7, r  # the base sits in the learnable band, so a gain is possible
    assert r["gain"] >= MARGIN, f"held-out pass@1 {r['base']:.3f} -> {r['specialist']:.3f} (gain {r['gain']:+.3f} < {MARGIN}): {r}"
