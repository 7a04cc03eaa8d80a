"""Flags shared by the stage commands: ``--set``, ``--config``, ``--no-progress``, ``--report-to``,
``--upload-repo``/``--public``, ``--export-gguf`` and the sampling flags of rollout and eval
(:func:`sampling_flags` names their keys in the stage's section, for
:func:`mlx_ssp.stage_config.apply_flags`; :func:`mlx_ssp.stage_config.load_task_stage` loads both)."""

from __future__ import annotations

import click

from mlx_ssp.progress import turned_off
from mlx_ssp.trackers import choices


def set_option(f):
    """``--set key=value`` (repeatable; dotted keys; beats the YAML file)."""
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a config value, e.g. --set rollout.k=8 (repeatable; beats the YAML file).",
    )(f)


def no_progress_option(f):
    """``--no-progress``: no progress bar from any stage while the command runs
    (:func:`mlx_ssp.progress.turned_off`, left when the command's context closes)."""

    def turn_off(ctx: click.Context, param, value: bool) -> None:
        if value:
            ctx.with_resource(turned_off())

    return click.option("--no-progress", is_flag=True, expose_value=False, callback=turn_off,
                        help="No progress bars (from any stage).")(f)


def report_to_option(f):
    """``--report-to NAME`` (repeatable or comma-separated; beats the run file's ``report_to``); the
    command gets the raw values, :func:`mlx_ssp.trackers.from_cli` reads them."""
    return click.option(
        "--report-to", "report_to", multiple=True, metavar="NAME",
        help=f"Send the metrics to these experiment trackers ({', '.join(choices())}; repeatable or "
             "comma-separated; beats the run file's report_to).",
    )(f)


def upload_options(what: str):
    """``--upload-repo ORG/NAME`` and ``--public`` (:func:`mlx_ssp.hub.upload_model`); ``what`` names
    the model the command uploads."""

    def deco(f):
        f = click.option("--public", is_flag=True,
                         help="Create the Hub repo public (default: private; an existing repo keeps its visibility).")(f)
        return click.option("--upload-repo", metavar="ORG/NAME", default=None,
                            help=f"Upload {what} to this Hugging Face Hub model repo (with its model card), created "
                                 "private unless --public. The token comes from HF_TOKEN or `hf auth login`.")(f)

    return deco


def export_gguf_option(what: str):
    """``--export-gguf``: :func:`mlx_ssp.gguf_export.export_gguf` on the model the command writes."""
    return click.option("--export-gguf", is_flag=True,
                        help=f"Also write {what} as GGUF (ggml-model-f16.gguf beside its weights; mlx-lm's "
                             "converter: llama, mistral, mixtral, unquantized).")


def config_option(f):
    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="Run YAML file; this command reads its own section(s). Flags beat the file.",
    )(f)


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
    """The dotted stage keys of the :func:`sampling_options` flags (for :func:`mlx_ssp.stage_config.apply_flags`)."""
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
