"""The ``select:`` section of a run file and its sub-sections (validated at load time)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from mlx_ssp.config import StrictModel
from mlx_ssp.select.distance import DISTANCE_CHOICES


class RepetitionConfig(StrictModel):
    """``select.repetition``: drop degenerate traces (:func:`mlx_ssp.quality.repetition_stats`)."""

    n: int = Field(8, ge=2)  # words per n-gram
    #: a trace whose share of n-grams repeating earlier ones is above this is degenerate (None: no limit)
    max_repeated_fraction: Optional[float] = Field(0.5, gt=0.0, lt=1.0)
    #: ... or which copies one stretch of this many words or more (None: no limit)
    max_repeated_span: Optional[int] = Field(200, ge=2)


class DecontaminateConfig(StrictModel):
    """``select.decontaminate``: drop training prompts sharing an n-gram with held-out prompts
    (:func:`mlx_ssp.quality.find_contaminated`)."""

    #: benchmark files (JSONL) whose prompts must not be trained on, besides the held-out task files
    against: list[str] = Field(default_factory=list)
    n: int = Field(13, ge=1)  # words per n-gram
    #: compare with the run's held-out task files (``mlx_ssp run``: eval and probe; the CLI: --held-out)
    held_out: bool = True
    #: an n-gram in at least this share of a domain's training prompts (and 2 of them) is template text
    boilerplate_fraction: float = Field(0.5, gt=0.0, le=1.0)
    #: the field of a benchmark row holding its prompt: the first of these that the row has
    fields: list[str] = Field(default_factory=lambda: ["prompt", "question", "problem"], min_length=1)


class PseudoLabelConfig(StrictModel):
    """``select.pseudo_label``: write tasks labelled by the majority vote of their K samples
    (:func:`mlx_ssp.quality.majority_vote`) to ``OUT_DIR/pseudo_labels.jsonl``."""

    #: the least share of the K samples that must agree for a label to be written
    min_agreement: float = Field(0.5, gt=0.0, le=1.0)
    min_votes: int = Field(2, ge=1)  # ... and the least number of samples
    #: label only tasks without an answer (those with one are still voted on: the report measures
    #: how often the vote equals their answer); false: every votable task, its answer replaced
    only_unlabelled: bool = True


class SelectConfig(StrictModel):
    """The ``select:`` section of a run file."""

    # added after runs existed (gold, the quality filters): left out of dumps while unset, so fingerprints hold
    OMIT_AT_DEFAULT = frozenset({"gold", "repetition", "decontaminate", "pseudo_label"})

    policy: Literal["diverse", "first", "all"] = "diverse"
    per_prompt: int = Field(4, ge=1)  # M: most solutions kept per prompt (diverse)
    #: ngram | edit (wording) | steps | ast | calls (strategy: mlx_ssp.strategy) | auto (per prompt,
    #: from its solutions: strategy_kind). ngram stays the default so existing runs keep their outputs.
    distance: Literal[DISTANCE_CHOICES] = "ngram"
    ngram: int = Field(3, ge=1)  # n of the n-gram distance
    near_duplicate: float = Field(0.1, ge=0.0, lt=1.0)  # distance at or below which two are duplicates
    min_reward: float = Field(1.0, gt=0.0, le=1.0)  # a completion is correct at reward >= this
    drop_truncated: bool = True  # drop completions cut by max_tokens
    valid_fraction: float = Field(0.1, ge=0.0, lt=1.0)  # prompts held out for valid.jsonl
    seed: int = 0  # of the valid split
    #: episode tasks: also offer each task's gold episode (its ground truth played through the
    #: environment, ``source: gold``) as a candidate; needs the task file and the student's tokenizer
    gold: bool = False
    repetition: Optional[RepetitionConfig] = None  # None: no repetition filter
    decontaminate: Optional[DecontaminateConfig] = None  # None: no decontamination
    pseudo_label: Optional[PseudoLabelConfig] = None  # None: no pseudo-labels
    input: Optional[str] = None  # rollouts JSONL (the positional argument beats it)
    output: Optional[str] = None  # OUT_DIR (-o beats it)
