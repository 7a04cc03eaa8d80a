"""The ``rl:`` section of a run file: MGPO-GRPO settings with documented defaults.

Neither VibeThinker paper gives lambda, the clip range, G or the temperature; the defaults below
are common GRPO/DAPO choices, not the paper's. See docs/rl.md for what each key does.

Three keys come from the VibeThinker-3B report (arXiv:2606.16140, section 2.2.2), each left out of
dumps while unset so that earlier runs keep their fingerprints: ``long2short`` (reward shaping,
:mod:`mlx_ssp.rl.shaping`), ``prompt_filter`` (drop the prompts the starting policy always or never
solves, :mod:`mlx_ssp.rl.prompt_filter`) and ``phases`` (sequential RL phases, each a set of
overrides of the other keys, :mod:`mlx_ssp.rl.phases`). The report gives lambda = 0.2; it gives no K
for the 0/1 filter (default 8 here).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from mlx_ssp.config import StrictModel, format_validation_error
from mlx_ssp.finetune.lora import LoRAConfig
from mlx_ssp.finetune.optim import OPTIMIZERS
from mlx_ssp.rl.mgpo import SCALE_REWARDS
from mlx_ssp.rl.objectives import AGGREGATIONS, RATIOS, SURROGATES, TIS_MODES
from mlx_ssp.rollout import SamplingConfig
from mlx_ssp.verify import VERIFIERS


class RLLoRAConfig(LoRAConfig):
    """The shared LoRA config (:class:`mlx_ssp.finetune.lora.LoRAConfig`) with RL's defaults: every
    block (``num_layers: -1``), plain LoRA only (the KL reference switches adapters off by setting
    their scale to 0, which does not give back the base layer of a DoRA wrapper)."""

    # left out of dumps: RL's resolved config (rl_config.json, the pipeline's stage fingerprint) is
    # as before the shared class had this key, so earlier runs resume instead of being redone
    fine_tune_type: Literal["lora"] = Field("lora", exclude=True)
    num_layers: int = -1


class Long2ShortConfig(StrictModel):
    """``rl.long2short``: shift rewards among a group's correct trajectories by brevity (1/L)."""

    # "lambda" is a Python keyword: the field is lambda_, read and written as "lambda"
    model_config = ConfigDict(validate_by_alias=True, validate_by_name=False, serialize_by_alias=True)
    lambda_: float = Field(0.2, ge=0.0, alias="lambda")


class OverlongConfig(StrictModel):
    """``rl.overlong``: DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13): a penalty falling
    linearly from 0 to ``-penalty`` over the last ``buffer`` tokens before ``sampling.max_tokens``."""

    buffer: int = Field(..., ge=1)
    penalty: float = Field(1.0, ge=0.0)


class PromptFilterConfig(StrictModel):
    """``rl.prompt_filter``: before training, K rollouts per prompt from the starting policy; the
    prompts whose accuracy is exactly 0 or exactly 1 are removed."""

    k: int = Field(8, ge=1)
    # default: rl.sampling (the policy's own sampling, as the phase will sample)
    sampling: Optional[SamplingConfig] = None


class RLConfig(StrictModel):
    """MGPO-GRPO training (``mlx_ssp rl``)."""

    # keys added after runs existed: left out of dumps while unset, so fingerprints hold
    OMIT_AT_DEFAULT: ClassVar[frozenset[str]] = frozenset({
        "long2short", "prompt_filter", "phases",
        # the policy-gradient menu
        "loss", "importance_sampling_level", "seq_eps_low", "seq_eps_high", "cispo_eps_low", "cispo_eps_high",
        "overlong", "mask_truncated_completions", "top_entropy_quantile", "tis_cap", "tis_mode", "entropy_coef",
        "share_prefix",  # shared prompt prefixes in training
        "auto_micro_batch",  # the memory model's rows per update piece
        "trim_padding",  # update pieces cut after their last loss token
        "gen_fold_lora",  # generation on the adapters folded into the weights
    })

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
    # decode with the LoRA adapters folded into a copy of the float32 weights (finetune/lora.py:
    # folded_adapters); bf16/fp16 layers keep their adapters (folding would round the update away)
    gen_fold_lora: bool = True
    micro_batch_size: int = Field(16, ge=1)  # at most this many sequences per training forward/backward (grads accumulate)
    # fewer rows per piece where the memory model (rl/memory.py) says more would raise the step's peak
    auto_micro_batch: bool = True
    # run the prompt prefix a block of rows (a group) shares once per pass, as a broadcast KV cache (rl/prefix.py)
    share_prefix: bool = True
    # each update piece runs only up to its last loss token, not to the batch's longest row (rl/batch.py)
    trim_padding: bool = True
    mu: int = Field(1, ge=1)  # inner updates per batch
    old_logprobs: Literal["recompute", "behaviour"] = "recompute"

    # MGPO / advantages
    mgpo_lambda: float = Field(1.0, ge=0.0)  # 0 = plain GRPO
    scale_rewards: Literal[SCALE_REWARDS] = "group"
    adv_eps: float = Field(1e-6, gt=0)
    dynamic_sampling: bool = False  # drop groups with p in {0, 1} and refill
    max_refill_rounds: int = Field(2, ge=0)  # extra generation rounds per step to refill the batch

    # loss
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    eps_high: float = Field(0.2, ge=0.0)
    dual_clip: Optional[float] = Field(None, gt=1.0)
    aggregation: Literal[tuple(AGGREGATIONS)] = "seq-mean-token-mean"
    beta: float = Field(0.0, ge=0.0)  # k3 KL coefficient; reference = adapters off (LoRA)
    # the policy-gradient menu (mlx_ssp.rl.objectives; docs/rl.md): surrogate, ratio level and their clip ranges
    loss: Literal[tuple(SURROGATES)] = "clip"
    importance_sampling_level: Literal[tuple(RATIOS)] = "token"  # sequence: GSPO
    seq_eps_low: float = Field(3e-4, ge=0.0, lt=1.0)  # GSPO's clip range (its section 5.1)
    seq_eps_high: float = Field(4e-4, ge=0.0)
    cispo_eps_low: float = Field(1.0, ge=0.0, le=1.0)  # MiniMax-M1: no lower bound on the weight
    cispo_eps_high: float = Field(0.28, ge=0.0)
    overlong: Optional[OverlongConfig] = None  # DAPO's soft overlong punishment (a reward shaping)
    mask_truncated_completions: bool = False  # DAPO: samples cut at max_tokens carry no gradient
    top_entropy_quantile: Optional[float] = Field(None, gt=0.0, le=1.0)  # only the top-entropy fraction trains
    tis_cap: Optional[float] = Field(None, gt=0.0)  # IS correction for another engine's rollouts
    tis_mode: Literal[TIS_MODES] = "truncate"
    # entropy bonus (verl's entropy_coeff): loss -= coef * aggregated entropy; None or 0 = off
    entropy_coef: Optional[float] = Field(None, ge=0.0)

    # model and optimizer
    fine_tune_type: Literal["lora", "full"] = "lora"
    lora: RLLoRAConfig = Field(default_factory=RLLoRAConfig)
    optimizer: Literal[tuple(OPTIMIZERS)] = "adamw"
    learning_rate: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: Optional[float] = Field(1.0, gt=0)
    train_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: float32 on CPU, else model's
    chunk_size: Optional[int] = Field(None, ge=1)  # tokens per log-prob chunk (None: ~64 MB of logits)
    kernels: Optional[Literal["auto", "reference", "metal", "cuda"]] = None  # default: $MLX_SSP_KERNELS / auto

    # reward shaping, the 0/1 prompt filter, sequential phases
    long2short: Optional[Long2ShortConfig] = None
    prompt_filter: Optional[PromptFilterConfig] = None
    phases: Optional[list["RLPhaseConfig"]] = Field(None, min_length=1)

    # robustness
    checkpoint_every: int = Field(10, ge=1)
    max_bad_steps: int = Field(3, ge=1)  # consecutive non-finite steps before the run stops
    progress: bool = True

    @model_validator(mode="after")
    def _check(self) -> "RLConfig":
        if self.sampling.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 for RL (greedy samples have no ratio to clip)")
        if self.tis_cap is not None and self.old_logprobs != "behaviour":
            raise ValueError("tis_cap corrects rollouts from another engine: set old_logprobs: behaviour "
                             "(the loop then recomputes the old policy itself and weights tokens by the mismatch)")
        if self.overlong is not None and self.overlong.buffer >= self.sampling.max_tokens:
            raise ValueError(f"overlong.buffer ({self.overlong.buffer}) must be below sampling.max_tokens "
                             f"({self.sampling.max_tokens})")
        if self.phases is not None:
            names = [p.name for p in self.phases]
            if len(set(names)) != len(names):
                raise ValueError(f"phases: names must differ (they name the phases' directories); got {names}")
            self.resolved_phases()  # every phase's merged settings validate at load time
        return self

    def resolved_phases(self) -> list[tuple["RLPhaseConfig", "RLConfig"]]:
        """(phase, its full RLConfig) for every phase: the phase's keys deep-merged over this
        section's (phases left out). Raises ValueError naming ``phases.N.key`` on a bad value."""
        if not self.phases:
            return []
        base = self.model_dump(mode="json", exclude={"phases"})
        out = []
        for i, ph in enumerate(self.phases):
            merged = _deep_merge(base, ph.overrides())
            try:
                out.append((ph, RLConfig.model_validate(merged)))
            except ValidationError as e:
                raise ValueError(format_validation_error(e, RLConfig, "", prefix=f"phases.{i}")) from None
        return out


def _deep_merge(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s keys set; mappings merge key by key (``sampling: {max_tokens: 512}``
    keeps the rest of ``sampling``), anything else (``null`` included) replaces."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


#: rl: keys a phase cannot override: phases do not nest, and each phase's output is its own directory
NOT_PER_PHASE = ("phases", "output")


class _PhaseBase(StrictModel):
    """One entry of ``rl.phases``: a name, which tasks, an optional verifier for all of them, and any
    other rl: key as an override of the section's value (validated on the merged settings)."""

    name: str
    domains: Optional[list[str]] = None  # keep only train tasks of these domains
    verifier: Optional[str] = None  # score every task of the phase with this verifier

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        import re

        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", v or ""):
            raise ValueError("must be letters, digits, '_', '.' or '-' (it names the phase's directory)")
        return v

    @field_validator("domains")
    @classmethod
    def _some_domains(cls, v):
        if v is not None and not v:
            raise ValueError("must name at least one domain (leave it out for every domain)")
        return v

    @field_validator("verifier")
    @classmethod
    def _known_verifier(cls, v):
        if v is not None:
            if v not in VERIFIERS:
                raise ValueError(f"unknown verifier {v!r}; valid: {', '.join(sorted(VERIFIERS))}")
        return v

    @model_serializer(mode="wrap")
    def _omit_new_defaults(self, handler):  # replaces StrictModel's: a phase dumps only what it sets
        data = handler(self)
        return {k: v for k, v in data.items() if k == "name" or k in self.model_fields_set}

    def overrides(self) -> dict[str, Any]:
        """The rl: keys this phase sets (explicit nulls included: ``long2short: null`` turns it off)."""
        return self.model_dump(mode="json", exclude_unset=True, exclude={"name", "domains", "verifier"})


RLPhaseConfig = create_model(
    "RLPhaseConfig",
    __base__=_PhaseBase,
    __doc__=_PhaseBase.__doc__,
    **{k: (Optional[Any], None) for k in RLConfig.model_fields if k not in NOT_PER_PHASE},
)
RLConfig.model_rebuild()
