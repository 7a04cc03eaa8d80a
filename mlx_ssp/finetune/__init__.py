"""The fine-tuning core shared by SFT (:mod:`mlx_ssp.sft`) and RL (:mod:`mlx_ssp.rl`).

One place for what both stages do to a model around their own training step: the LoRA config and
its attachment (:mod:`.lora`), the optimizer registry (:mod:`.optim`), the checkpoint layout with
resume checks (:mod:`.checkpoints`), the step-seed rule (:mod:`.seed`) and fusing (:mod:`.fuse`).
The stages keep only their algorithm: SFT the mlx-lm trainer + probes, RL the GRPO step.
"""

from mlx_ssp.finetune.lora import LoRAConfig, adapter_config, adapters_disabled, attach_lora, lora_modules
from mlx_ssp.finetune.optim import OPTIMIZERS, build_optimizer
from mlx_ssp.finetune.seed import step_seed

__all__ = [
    "OPTIMIZERS", "LoRAConfig", "adapter_config", "adapters_disabled", "attach_lora", "build_optimizer",
    "lora_modules", "step_seed",
]
