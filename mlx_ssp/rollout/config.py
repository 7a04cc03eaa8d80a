"""The rollout settings of a run file: how each completion is sampled, and the ``rollout:`` section."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from mlx_ssp.config import StrictModel


class SamplingConfig(StrictModel):
    """How each completion is sampled. ``temperature: 0`` is greedy decoding."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(256, ge=1)
    stop: list[str] = Field(default_factory=list)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class RolloutConfig(StrictModel):
    """The ``rollout:`` section of a run file."""

    k: int = Field(8, ge=1)  # samples per task
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    batch_size: int = Field(64, ge=1)  # sequences decoded together
    seed: Optional[int] = None  # default: the run file's top-level seed, else 0
    tasks: Optional[str] = None  # task JSONL (the --tasks flag beats it)
    output: Optional[str] = None  # rollouts JSONL (the -o flag beats it)
    max_context: Optional[int] = Field(None, ge=2)  # default: the model's max_position_embeddings
    system: Optional[str] = None  # system prompt added to tasks that have none
    verify_workers: int = Field(4, ge=1)  # threads for sandboxed (parallel) verifiers
    prefill_batch_size: Optional[int] = Field(None, ge=1)  # sequences prefilled together; None: 1 on CPU, 8 on GPU
    #: tasks without an answer (synthetic queries): sample them unverified (reward null) for
    #: select.pseudo_label, instead of refusing the task file
    unlabelled: bool = False
    OMIT_AT_DEFAULT = frozenset({"prefill_batch_size", "unlabelled"})  # added later: old fingerprints kept
