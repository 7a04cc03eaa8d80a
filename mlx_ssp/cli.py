"""The ``mlx_ssp`` command: a click group with one subcommand per stage.

Subcommands are imported lazily (``mlx_ssp --help`` must not pay for mlx, datasets or torch).
Each lives in its own module of :mod:`mlx_ssp.commands` as a click command named ``cli``; a stage that is not built in this
version exits non-zero with one line saying so. A :class:`UserError` anywhere becomes one line on
stderr and exit status 2, never a traceback; so does a full disk or quota (``ENOSPC``/``EDQUOT``,
from any stage: every output is written atomically or resumably, so a rerun after freeing space
is safe).
"""

from __future__ import annotations

import errno
import importlib
import sys

import click

from mlx_ssp.errors import UserError

#: name -> (import path of the click command, one-line help shown in ``mlx_ssp --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("mlx_ssp.commands.doctor:cli", "Check the platform, backends, BLAS and matmul speed."),
    "models": ("mlx_ssp.commands.models:cli", "Resolve model specs (local dir, hub id, 'demo') to directories."),
    "tasks": ("mlx_ssp.commands.tasks:cli", "Export task files from GSM8K, reasoning-gym, HumanEval, BFCL, JSONL, HF."),
    "verify": ("mlx_ssp.commands.verify:cli", "Score completions with the tasks' verifiers (re-score old rollouts)."),
    "rollout": ("mlx_ssp.commands.rollout:cli", "Sample K completions per task with behaviour log-probs and rewards."),
    "select": ("mlx_ssp.commands.select:cli", "Pick diverse correct solutions from rollouts as SFT data."),
    "eval": ("mlx_ssp.commands.eval:cli", "pass@1 / pass@k per domain with the unbiased estimator."),
    "sft": ("mlx_ssp.commands.sft:cli", "Train one LoRA specialist per domain, keep the best Pass@K checkpoint, fuse."),
    "merge": ("mlx_ssp.commands.merge:cli", "Merge models from a mergekit YAML (linear, TIES, DARE, della, slerp, model_stock, passthrough, ...)."),
    "merge-lora": ("mlx_ssp.commands.merge_lora:cli", "Merge LoRA adapters of one base into one adapter (linear exact; TIES/DARE via SVD)."),
    "extract-lora": ("mlx_ssp.commands.extract_lora:cli", "A fine-tuned model as a LoRA adapter of its base (truncated SVD)."),
    "rl": ("mlx_ssp.commands.rl:cli", "MGPO-weighted GRPO with verifiable rewards."),
    "run": ("mlx_ssp.commands.run:cli", "Run the whole SSP loop from one config, resumably."),
    "report": ("mlx_ssp.commands.report:cli", "Markdown summary and plots of a run directory."),
}


def _not_built(name: str, help_text: str, reason: str) -> click.Command:
    @click.command(
        name,
        help=f"{help_text}\n\n(Not built in this version.)",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=True,
    )
    def cmd() -> None:
        click.echo(f"mlx_ssp {name}: this stage is not built yet in mlx_ssp ({reason})", err=True)
        sys.exit(3)

    return cmd


#: errnos that mean "the disk (or the quota) is full": the user's to fix, not a bug
DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def disk_full_message(exc: BaseException) -> str | None:
    """One line for an exception caused (anywhere in its chain) by a full disk, else None."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            where = f" writing {e.filename}" if e.filename else ""
            what = "disk quota exceeded" if e.errno != errno.ENOSPC else "no space left on device"
            return f"{what}{where}; free some space (or write elsewhere) and rerun"
        e = e.__cause__ or e.__context__
    return None


class StageGroup(click.Group):
    """Lazy subcommands; UserError and a full disk -> one clean line."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target, help_text = COMMANDS[name]
        mod, _, attr = target.partition(":")
        try:
            cmd = getattr(importlib.import_module(mod), attr)
        except ModuleNotFoundError as e:
            if e.name and (e.name == mod or mod.startswith(e.name + ".")):
                return _not_built(name, help_text, f"module {mod} is missing")
            raise
        except AttributeError:
            return _not_built(name, help_text, f"{target} is missing")
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # use the table's help so that --help imports nothing heavy
        rows = [(name, help_text) for name, (_, help_text) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(2)
        except Exception as e:  # noqa: BLE001 - only a full disk is answered here; the rest re-raised
            msg = disk_full_message(e)
            if msg is None:
                raise
            click.echo(f"error: {msg}", err=True)
            ctx.exit(2)


@click.group(cls=StageGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlx_ssp")
def main() -> None:
    """mlx_ssp: the Spectrum-to-Signal recipe (diverse K-rollouts, specialist SFT, merge,
    MGPO-GRPO) on MLX and mlx-lm.

    Typical loop: `mlx_ssp run configs/quickstart.yaml`; or each stage on its own. Every stage
    that takes a config file reads its own section of a run YAML and accepts `--set key=value`.
    """


if __name__ == "__main__":  # pragma: no cover
    main()
