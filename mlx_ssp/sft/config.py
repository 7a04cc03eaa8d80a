"""The ``sft:`` section: data, LoRA, optimizer, schedule, probe and selection settings."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from mlx_ssp.config import StrictModel
from mlx_ssp.finetune.lora import LoRAConfig  # the shared config; SFT uses its defaults (16 blocks)
from mlx_ssp.finetune.optim import OPTIMIZERS
from mlx_ssp.rollout import SamplingConfig
from mlx_ssp.sft.curriculum import CurriculumConfig
from mlx_ssp.sft.loss import CE_KINDS


class ScheduleConfig(StrictModel):
    """An ``mlx.optimizers.schedulers`` schedule (mlx-lm's ``lr_schedule``): ``arguments`` are the
    scheduler's positional arguments, the first being the peak learning rate."""

    name: Literal["cosine_decay", "linear_schedule", "exponential_decay", "step_decay"]
    arguments: list[float] = Field(min_length=1)
    warmup: int = Field(0, ge=0)
    warmup_init: float = 0.0


SELECT_RULES = ("pass@k", "pass@1", "val_loss")


class ProbeConfig(StrictModel):
    """How each checkpoint is probed."""

    k: int = Field(8, ge=1)
    #: samples per probe task (>= k; more samples = a less noisy pass@k); null = k
    n: Optional[int] = Field(None, ge=1)
    #: the first N probe tasks of the domain (in file order); null = all
    max_tasks: Optional[int] = Field(32, ge=1)
    batch_size: int = Field(64, ge=1)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    system: Optional[str] = None  # system prompt added to probe tasks that have none
    #: sampling seed, the same at every checkpoint; null = the SFT seed
    seed: Optional[int] = None
    progress: bool = True

    @model_validator(mode="after")
    def _n_ge_k(self) -> "ProbeConfig":
        if self.n is not None and self.n < self.k:
            raise ValueError(f"probe.n ({self.n}) must be >= probe.k ({self.k})")
        if max(self.n or self.k, self.k) > 1 and self.sampling.temperature == 0:
            raise ValueError("more than one sample per task at temperature 0 are all the same; raise the temperature")
        return self


class DomainSpec(StrictModel):
    """Where one domain's data lives. Every field is optional: ``data`` defaults to
    ``{data_dir}/{domain}`` (the ``mlx_ssp select`` layout), probe tasks to the run file's
    ``tasks:`` section (its probe split, this domain's tasks)."""

    #: a JSONL file, or a directory with train.jsonl (and valid.jsonl)
    data: Optional[str] = None
    #: validation JSONL (overrides valid.jsonl in the data directory)
    valid: Optional[str] = None
    #: a task JSONL used as the probe set (only this domain's tasks are used)
    probe_tasks: Optional[str] = None
    OMIT_AT_DEFAULT = frozenset({"probe_domains"})  # added after runs existed: old fingerprints kept
    #: the domains whose probe tasks choose this one's checkpoint (default: its own; a blend: all)
    probe_domains: Optional[list[str]] = None


class SFTConfig(StrictModel):
    """The ``sft:`` section."""

    # added after runs existed: old fingerprints kept
    OMIT_AT_DEFAULT = frozenset({"blend", "curriculum", "gather_targets", "loss", "pack"})

    #: required by the command; the pipeline fills it from the tasks section when empty
    domains: dict[str, DomainSpec] = Field(default_factory=dict)
    data_dir: Optional[str] = None  # default {run_dir}/select
    out_dir: Optional[str] = None  # default {run_dir}/sft
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    optimizer: Literal[tuple(OPTIMIZERS)] = "adam"
    optimizer_config: dict[str, Any] = Field(default_factory=dict)
    learning_rate: float = Field(1e-5, gt=0)
    lr_schedule: Optional[ScheduleConfig] = None
    iters: int = Field(200, ge=1)
    batch_size: int = Field(4, ge=1)
    max_seq_length: int = Field(2048, ge=2)
    mask_prompt: bool = True
    grad_accumulation_steps: int = Field(1, ge=1)
    grad_checkpoint: bool = False
    #: how the cross-entropy is computed (mlx_ssp.sft.loss.CE_KINDS): "chunked" (the log-prob op,
    #: logits one chunk of tokens at a time) or "logits" (mlx-lm's, the whole logits); same value
    loss: Literal[tuple(CE_KINDS)] = "chunked"
    #: with the chunked loss, run the LM head only at the targets that carry weight (the completion,
    #: not the prompt or padding); false = at every position (the same value up to float rounding)
    gather_targets: bool = True
    #: pack each batch's records into as few rows as fit (a block-diagonal mask keeps them apart);
    #: the same records and loss per batch, less padding
    pack: bool = False
    report_every: int = Field(10, ge=1)
    save_every: int = Field(50, ge=1)
    #: validation batches per checkpoint; -1 = the whole validation set, 0 = no validation loss
    val_batches: int = Field(25, ge=-1)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    select: Literal[SELECT_RULES] = "pass@k"
    seed: Optional[int] = None  # default: the run file's top-level seed, else 0
    dequantize: bool = False  # fuse a quantized base into a dequantized specialist
    overwrite: bool = False  # discard earlier checkpoints/specialists instead of resuming
    #: `mlx_ssp run`: also train one LoRA on every domain's data mixed (the blend the merge is compared
    #: with in the negative-transfer experiment); evaluated, never merged
    blend: bool = False
    #: curriculum stage 2 of every specialist (mlx_ssp.sft.curriculum); null = one stage
    curriculum: Optional[CurriculumConfig] = None

    @field_validator("domains", mode="before")
    @classmethod
    def _domain_list(cls, v: Any) -> Any:
        # "domains: [math, code]" is shorthand for "domains: {math: {}, code: {}}"
        if isinstance(v, (list, tuple)):
            return {str(d): {} for d in v}
        if isinstance(v, dict):
            return {k: ({} if s is None else s) for k, s in v.items()}
        return v

    @model_validator(mode="after")
    def _probe_fits(self) -> "SFTConfig":
        if self.select == "val_loss" and self.val_batches == 0:
            raise ValueError("select=val_loss needs validation loss; set val_batches to -1 or > 0")
        return self


