"""Sandbox limits, and the operator's bounds on what a task may ask for (import-light: config only).

A code task may carry ``metadata.sandbox`` (keys of :class:`Limits`) to change its limits. A task file
is input, so the operator's :class:`SandboxPolicy` (the top-level ``sandbox`` section of a run file, read by every stage command and ``mlx_ssp run``,
``mlx_ssp verify --sandbox KEY=VALUE``, or ``$MLX_SSP_SANDBOX`` for any command) bounds it: each numeric field is the most a task may ask
for (a task may always lower a limit), and ``network`` / ``site_packages`` say whether a task may
turn those on. A request above the policy is refused, never clamped: the task is reported before
any generation (a clamp would silently score a task that needs more time as a timeout). The
defaults are today's limits and no network from a task alone. The defaults themselves are lowered
to a ceiling set below them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Any, Optional, get_type_hints

from pydantic import Field, ValidationError, create_model, model_validator

from mlx_ssp.config import StrictModel, load_section


def _switch(default: bool, *, policy: bool) -> Any:
    """An on/off limit; ``policy``: the operator's default for whether a task may turn it on."""
    return field(default=default, metadata={"policy_default": policy})


@dataclass(frozen=True)
class Limits:
    """The one list of limit fields: :class:`SandboxPolicy` and :class:`TaskSandbox` are built from it."""

    wall_s: float = 10.0  # wall-clock seconds, enforced by the parent (and a backstop alarm)
    cpu_s: int = 5  # CPU seconds per process (RLIMIT_CPU; SIGXCPU then SIGKILL)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    nproc: int = 32  # processes/threads of the sandbox uid (RLIMIT_NPROC)
    fsize_mb: int = 16  # largest file the program may write (RLIMIT_FSIZE)
    nofile: int = 128  # open file descriptors
    output_kb: int = 256  # captured stdout+stderr; more and the program is killed
    tmpfs_mb: int = 64  # size of the work dir, the only writable place (Linux root only)
    network: bool = _switch(False, policy=False)  # allow network access
    # make installed packages (numpy...) importable; ~30 ms more per run; read-only, the policy allows it
    site_packages: bool = _switch(False, policy=True)


DEFAULT_LIMITS = Limits()
SWITCHES = tuple(f.name for f in fields(Limits) if "policy_default" in f.metadata)
NUMERIC = tuple(f.name for f in fields(Limits) if f.name not in SWITCHES)
_TYPES = get_type_hints(Limits)


def _known_keys(v: Any, what: str) -> Any:
    valid = [f.name for f in fields(Limits)]
    if isinstance(v, dict):
        bad = sorted(set(v) - set(valid))
        if bad:
            raise ValueError(f"unknown {what} key(s) {', '.join(map(str, bad))}; valid: {', '.join(valid)}")
    return v


class _PolicyKeys(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _keys(cls, v: Any) -> Any:
        return _known_keys(v, "sandbox policy")


class _TaskKeys(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _keys(cls, v: Any) -> Any:
        return _known_keys(v, "metadata.sandbox")


def _policy_field(f) -> tuple:
    """A ceiling (above 0, default: today's limit), or for a switch whether a task may turn it on."""
    if f.name in SWITCHES:
        return (bool, f.metadata["policy_default"])
    return (_TYPES[f.name], Field(f.default, gt=0))


def _task_field(f) -> tuple:
    """A task's own request: every key optional, no coercion (a task file is input)."""
    if f.name in SWITCHES:
        return (Optional[bool], Field(None, strict=True))
    return (Optional[_TYPES[f.name]], Field(None, gt=0, strict=True))


SandboxPolicy = create_model(
    "SandboxPolicy", __base__=_PolicyKeys, __module__=__name__,
    __doc__="""The operator's ceilings on a task's ``metadata.sandbox``; ``network`` / ``site_packages``:
    whether a task may turn them on.""",
    **{f.name: _policy_field(f) for f in fields(Limits)},
)
TaskSandbox = create_model(
    "TaskSandbox", __base__=_TaskKeys, __module__=__name__, __doc__="A task's ``metadata.sandbox``: every key optional.",
    **{f.name: _task_field(f) for f in fields(Limits)},
)


ENV = "MLX_SSP_SANDBOX"  # "KEY=VALUE,KEY=VALUE": the policy for every command that runs no other
_policy: Optional[SandboxPolicy] = None


def set_policy(policy: Optional[SandboxPolicy]) -> None:
    """Install the operator's policy for this process (None: back to $MLX_SSP_SANDBOX or the
    defaults). Stage loaders call it through :func:`install_from_config`; ``verify`` with ``--sandbox``."""
    global _policy
    _policy = policy


def install_from_config(data: dict, source: str) -> None:
    """Install the run file's top-level ``sandbox`` section, if it has one (validated: unknown keys
    and bad values are a UserError naming the key). Every stage that may verify code (rollout, eval,
    the SFT probes, RL, ``mlx_ssp run``) loads its config through a loader that calls this, so one
    section bounds them all, also when ``mlx_ssp run`` resumes past the rollout stage."""
    if data.get("sandbox") is None:
        return

    set_policy(load_section(data, "sandbox", source=source))


def get_policy() -> SandboxPolicy:
    if _policy is not None:
        return _policy
    return _env_policy(os.environ.get(ENV, "").strip())


@lru_cache(maxsize=8)
def _env_policy(env: str) -> SandboxPolicy:
    """$MLX_SSP_SANDBOX as a policy, parsed once per value (every code sample asks for it)."""
    if not env:
        return SandboxPolicy()
    try:
        return parse_policy([p for p in env.split(",") if p.strip()])
    except ValueError as e:
        raise ValueError(f"${ENV}: {e}") from None


def _first_error(e: ValidationError, what: str) -> str:
    err = e.errors()[0]
    key = ".".join(str(x) for x in err["loc"])
    return f"{what}.{key}: {err['msg']}" if key else f"{what}: {err['msg']}"


def task_limits(over: Any, policy: Optional[SandboxPolicy] = None) -> Limits:
    """The limits of a task whose ``metadata.sandbox`` is ``over``, within ``policy`` (default: the
    installed one). Raises ValueError naming the key for a bad or refused request."""
    policy = policy or get_policy()
    try:
        asked = TaskSandbox.model_validate(over or {}).model_dump(exclude_none=True)
    except ValidationError as e:
        raise ValueError(_first_error(e, "metadata.sandbox")) from None
    for k, v in asked.items():
        if k in SWITCHES:
            if v and not getattr(policy, k):
                raise ValueError(f"metadata.sandbox.{k}: true is not allowed by the operator's sandbox policy "
                                 f"(set sandbox.{k}: true to allow it)")
        elif v > getattr(policy, k):
            raise ValueError(f"metadata.sandbox.{k} = {v} is above the operator's ceiling {getattr(policy, k)} "
                             f"(raise sandbox.{k} to allow it)")
    base = {k: min(getattr(DEFAULT_LIMITS, k), getattr(policy, k)) for k in NUMERIC}
    return replace(DEFAULT_LIMITS, **{**base, **asked})


def parse_policy(pairs: list[str]) -> SandboxPolicy:
    """``KEY=VALUE`` strings (the CLI's ``--sandbox``) as a policy; ValueError names the bad one."""
    kv = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.strip():
            raise ValueError(f"--sandbox {p!r}: expected KEY=VALUE")
        kv[k.strip()] = v.strip()
    try:
        return SandboxPolicy.model_validate(kv)
    except ValidationError as e:
        raise ValueError(_first_error(e, "--sandbox")) from None
