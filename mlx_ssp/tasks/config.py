"""The ``tasks:`` section of a run file: several domains, each with a source, a verifier, its
answer-format instruction, an optional system prompt and the sizes of three disjoint splits
(``train``: rollouts / RL prompts, ``probe``: SFT checkpoint choice, ``eval``: held out).

See docs/tasks.md for every key and the splitting rules.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import Field, ValidationInfo, field_validator

from mlx_ssp.config import StrictModel
from mlx_ssp.tasks.sources import parse_source
from mlx_ssp.verify import UNAVAILABLE, VERIFIERS
from mlx_ssp.verify.extract import MODES
from mlx_ssp.verify.sandbox import Limits

SPLITS = ("train", "probe", "eval")


class SplitSizes(StrictModel):
    """Number of tasks per split. ``train: null`` means "every remaining row" for file sources."""

    train: Optional[int] = Field(default=None, ge=0)
    probe: int = Field(default=0, ge=0)
    eval: int = Field(default=0, ge=0)

    def of(self, split: str) -> Optional[int]:
        return getattr(self, split)


class DomainConfig(StrictModel):
    source: str  # KIND:ARG, e.g. reasoning_gym:basic_arithmetic, gsm8k:/path/train.jsonl, humaneval
    params: dict[str, Any] = Field(default_factory=dict)  # source parameters (see docs/tasks.md)
    verifier: Optional[str] = None  # default: the source's own (gsm8k -> math, humaneval -> code, ...)
    instruction: Optional[str] = None  # appended to each prompt; None = the source's default, "" = none
    system: Optional[str] = None  # system prompt put in each task's messages
    answer_extraction: Literal[MODES] = "strict"  # math / reasoning_gym answer extraction
    sandbox: dict[str, Any] = Field(default_factory=dict)  # code tasks: overrides of the sandbox limits
    sizes: SplitSizes = Field(default_factory=SplitSizes)

    @field_validator("source")
    @classmethod
    def _source_ok(cls, v: str) -> str:
        parse_source(v)  # raises ValueError naming the valid kinds
        return v

    @field_validator("params")
    @classmethod
    def _params_ok(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "source" not in info.data:  # the source itself was invalid: that error is reported
            return v
        src, _ = parse_source(info.data["source"])
        if src.check_params is not None:
            src.check_params(v)  # ValueError naming the valid keys / choices, at load time
        return v

    @field_validator("verifier")
    @classmethod
    def _verifier_ok(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v

        if v not in VERIFIERS and v not in UNAVAILABLE:
            raise ValueError(f"unknown verifier '{v}'; valid: {', '.join(sorted(VERIFIERS))}")
        return v

    @field_validator("sandbox")
    @classmethod
    def _sandbox_ok(cls, v: dict[str, Any]) -> dict[str, Any]:
        from dataclasses import fields


        valid = {f.name: f.type for f in fields(Limits)}
        bad = sorted(set(v) - set(valid))
        if bad:
            raise ValueError(f"unknown sandbox limit(s) {', '.join(bad)}; valid: {', '.join(sorted(valid))}")
        for k, x in v.items():
            if str(valid[k]) == "bool":
                if not isinstance(x, bool):
                    raise ValueError(f"sandbox.{k} must be true or false")
            elif isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0:
                raise ValueError(f"sandbox.{k} must be a positive number (got {x!r})")
        return v


class TasksConfig(StrictModel):
    seed: int = 1234
    domains: dict[str, DomainConfig] = Field(default_factory=dict)

    @field_validator("domains")
    @classmethod
    def _names_ok(cls, v: dict[str, DomainConfig]) -> dict[str, DomainConfig]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
                raise ValueError(f"domain name '{name}' must be letters, digits, '_', '-' or '.'")
        return v
