"""The optimizer registry (``mlx.optimizers`` classes by config name) and RL's warmup schedule."""

from __future__ import annotations

from typing import Any, NamedTuple

from mlx_ssp.errors import UserError


class OptimizerEntry(NamedTuple):
    cls_name: str  # the class in mlx.optimizers
    weight_decay: bool  # takes a ``weight_decay`` argument (RL's ``weight_decay`` key goes there)
    moments: int  # full-size state arrays per trainable parameter (the memory model's count; at most)


#: optimizer name -> its mlx.optimizers class (a registry, not an if/elif chain)
OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adam": OptimizerEntry("Adam", False, 2),  # m and v
    "adamw": OptimizerEntry("AdamW", True, 2),
    "sgd": OptimizerEntry("SGD", True, 1),  # v (momentum)
    # factored second moments (a row and a column vector per matrix) and no first moment by default:
    # one full-size array bounds it
    "adafactor": OptimizerEntry("Adafactor", True, 1),
}


def build_optimizer(name: str, learning_rate, options: dict[str, Any] | None = None, *, what: str = "optimizer"):
    """``mlx.optimizers.<class>(learning_rate=..., **options)``; a bad option is a UserError naming ``what``."""
    import mlx.optimizers as optim

    cls = getattr(optim, OPTIMIZERS[name].cls_name)
    try:
        return cls(learning_rate=learning_rate, **(options or {}))
    except TypeError as e:
        raise UserError(f"{what}: {e}") from None


def warmup_constant(learning_rate: float, warmup_steps: int):
    """Linear warmup from lr/1000 to lr over ``warmup_steps``, then constant (lr itself when 0)."""
    import mlx.optimizers as optim

    if not warmup_steps:
        return learning_rate
    warm = optim.linear_schedule(learning_rate * 1e-3, learning_rate, warmup_steps)
    return optim.join_schedules([warm, lambda _: learning_rate], [warmup_steps])
