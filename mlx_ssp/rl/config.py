"""The ``rl:`` section of a run file: MGPO-GRPO settings with documented defaults.

Neither VibeThinker paper gives lambda, the clip range, G or the temperature; the defaults below
are common GRPO/DAPO choices, not the paper's. See docs/rl.md for what each key does.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from mlx_ssp.config import StrictModel
from mlx_ssp.finetune.lora import LoRAConfig
from mlx_ssp.rollout import SamplingConfig


class RLLoRAConfig(LoRAConfig):
    """The shared LoRA config (:class:`mlx_ssp.finetune.lora.LoRAConfig`) with RL's defaults: every
    block (``num_layers: -1``), plain LoRA only (the KL reference switches adapters off by setting
    their scale to 0, which does not give back the base layer of a DoRA wrapper)."""

    # left out of dumps: RL's resolved config (rl_config.json, the pipeline's stage fingerprint) is
    # as before the shared class had this key, so earlier runs resume instead of being redone
    fine_tune_type: Literal["lora"] = Field("lora", exclude=True)
    num_layers: int = -1


class RLConfig(StrictModel):
    """MGPO-GRPO training (``mlx_ssp rl``)."""

    # data
    tasks: Optional[str] = None  # task JSONL; default: the run file's tasks: section, split "train"
    output: Optional[str] = None  # run directory of this stage; default: <run_dir>/rl
    system: Optional[str] = None  # system prompt for tasks without one
    seed: Optional[int] = None  # default: the run file's top-level seed, else 0

    # steps and batches
    steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1)  # prompts per step
    group_size: int = Field(8, ge=2)  # G rollouts per prompt
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=1.0, max_tokens=256))
    gen_batch_size: int = Field(64, ge=1)  # sequences decoded together by the rollout engine
    micro_batch_size: int = Field(16, ge=1)  # sequences per training forward/backward (grads accumulate)
    mu: int = Field(1, ge=1)  # inner updates per batch
    old_logprobs: Literal["recompute", "behaviour"] = "recompute"

    # MGPO / advantages
    mgpo_lambda: float = Field(1.0, ge=0.0)  # 0 = plain GRPO
    scale_rewards: Literal["group", "batch", "none"] = "group"
    adv_eps: float = Field(1e-6, gt=0)
    dynamic_sampling: bool = False  # drop groups with p in {0, 1} and refill
    max_refill_rounds: int = Field(2, ge=0)  # extra generation rounds per step to refill the batch

    # loss
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    eps_high: float = Field(0.2, ge=0.0)
    dual_clip: Optional[float] = Field(None, gt=1.0)
    aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    beta: float = Field(0.0, ge=0.0)  # k3 KL coefficient; reference = adapters off (LoRA)

    # model and optimizer
    fine_tune_type: Literal["lora", "full"] = "lora"
    lora: RLLoRAConfig = Field(default_factory=RLLoRAConfig)
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"  # entries of mlx_ssp.finetune.optim.OPTIMIZERS
    learning_rate: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: Optional[float] = Field(1.0, gt=0)
    train_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: float32 on CPU, else model's
    chunk_size: Optional[int] = Field(None, ge=1)  # tokens per log-prob chunk (None: ~64 MB of logits)
    kernels: Optional[Literal["auto", "reference", "metal", "cuda"]] = None  # default: $MLX_SSP_KERNELS / auto

    # robustness
    checkpoint_every: int = Field(10, ge=1)
    max_bad_steps: int = Field(3, ge=1)  # consecutive non-finite steps before the run stops
    progress: bool = True

    @model_validator(mode="after")
    def _check(self) -> "RLConfig":
        if self.sampling.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 for RL (greedy samples have no ratio to clip)")
        return self
