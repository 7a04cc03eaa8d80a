"""CLI plumbing shared by the stage commands: flags into a config section, the sampling flags of
rollout and eval, and :func:`load_stage_config` (rollout/eval form of :func:`mlx_ssp.stage_config.load_stage`)."""

from __future__ import annotations

from typing import Any, Optional

import click

from mlx_ssp.errors import UserError


def apply_flags(data: dict, section: str, flags: dict[str, Any]) -> dict:
    """Put non-None CLI flags into ``data[section]`` (dotted keys), so that flags beat the file."""
    sec = data.setdefault(section, {}) or {}
    if not isinstance(sec, dict):
        raise UserError(f"config section '{section}' must be a mapping")
    data[section] = sec
    for key, value in flags.items():
        if value is None or value == ():
            continue
        node = sec
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = list(value) if isinstance(value, tuple) else value
    return data


def sampling_options(f):
    """Sampling flags shared by rollout and eval."""
    for opt in reversed(
        [
            click.option("--temperature", type=float, default=None, help="Sampling temperature (0 = greedy). Default 1.0."),
            click.option("--top-p", type=float, default=None, help="Nucleus sampling mass (1 = off)."),
            click.option("--top-k", type=int, default=None, help="Keep the k most likely tokens (0 = off)."),
            click.option("--min-p", type=float, default=None, help="Min-p truncation (0 = off)."),
            click.option("--max-tokens", type=int, default=None, help="Most tokens per completion. Default 256."),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
            click.option("--batch-size", type=int, default=None, help="Sequences decoded together. Default 64."),
            click.option("--seed", type=int, default=None, help="Seed; each sample's key derives from (seed, task id, sample)."),
            click.option("--max-context", type=int, default=None, help="Context length (default: the model's)."),
        ]
    ):
        f = opt(f)
    return f


def sampling_flags(kw: dict) -> dict:
    """The dotted stage keys of the :func:`sampling_options` flags (for :func:`apply_flags`)."""
    return {
        "sampling.temperature": kw.get("temperature"),
        "sampling.top_p": kw.get("top_p"),
        "sampling.top_k": kw.get("top_k"),
        "sampling.min_p": kw.get("min_p"),
        "sampling.max_tokens": kw.get("max_tokens"),
        "sampling.stop": kw.get("stop") or None,
        "batch_size": kw.get("batch_size"),
        "seed": kw.get("seed"),
        "max_context": kw.get("max_context"),
    }


def load_stage_config(config_path, overrides, section: str, flags: dict, model: Optional[str]):
    """(ModelConfig, stage config with the seed rule applied, raw data): :func:`mlx_ssp.stage_config.load_stage`."""
    from mlx_ssp.stage_config import load_stage

    st = load_stage(config_path, overrides, section, flags=flags, model=model)
    return st.model, st.seeded(), st.data
