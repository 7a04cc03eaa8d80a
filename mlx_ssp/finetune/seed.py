"""The step-seed rule: MLX's global RNG (LoRA dropout) is re-seeded from (seed, step), so a run
resumed at step k draws what an uninterrupted run draws, with no RNG state to save."""

from __future__ import annotations


def step_seed(seed: int, step: int) -> int:
    """The MLX RNG seed used from ``step`` on: a fixed function of (seed, step).

    Reduced mod 2**32 (what every RNG seeds from). SFT used to reduce mod 2**62: the two agree
    whenever seed * 1_000_003 + step * 7_919 + 17 < 2**32 (e.g. any seed <= 1000 for 400,000 steps)."""
    return (int(seed) * 1_000_003 + int(step) * 7_919 + 17) % (2**32)
