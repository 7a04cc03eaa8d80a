"""Shared pieces of the three SSP experiments (see EXPERIMENTS.md): one config, cached steps, statistics.

Every step calls the product's own stage functions (``build_split``, ``run_rollouts``,
``run_select``, ``run_sft``, ``merge_models``, ``evaluate``, ``mlx_ssp.rl.trainer.train``) and caches
its output under ``WORK_DIR`` (default ``runs/experiments``), so the three scripts share work:
one task set and one rollout file feed experiments 1 and 2, experiment 2's merged model is
experiment 3's starting point, and every evaluation is a JSON file that a rerun reads back instead
of recomputing. Each cached step lives in a directory named by a hash of the config sections it
depends on (chained: rollouts <- tasks + model, selection <- rollouts, SFT <- selection, ...), so a
changed setting reruns exactly the steps it affects and never reuses a stale result; deleting a file
reruns that step.

Every model is evaluated on the same held-out tasks with the same sampling seed (common random
numbers), so model differences are paired per task; :func:`paired` gives the mean per-task
difference and its standard error (sd of the per-task differences / sqrt(number of tasks)).

``--profile testbed`` starts from :data:`TESTBED` instead of :data:`DEFAULTS`: the
testbed model ``testbed:multi`` (three synthetic domains, pretrained here in minutes) with the
learning round's measured SFT and RL settings, so that an experiment runs in minutes a seed and
``scripts/experiments/seeds.py`` can repeat it over 5 training seeds. The ``domains`` key narrows
either profile to some of its domains (``--set domains=[sum,diff]``).

``--tiny`` swaps the demo model for a tiny random model (:func:`mlx_ssp.testing.make_tiny_model`)
and a stand-in verifier (reward 1 when the completion has an even number of characters, so a random
model gets mixed rewards), with minimal sizes: it checks that the scripts run end to end in
seconds, it measures nothing.

The pieces live in modules of their own, which this one gathers for the scripts (``common.NAME``):
:mod:`exp_profiles` (the profiles), :mod:`exp_workspace` (:class:`Ctx` and its cached steps),
:mod:`exp_steps` (RL arms, fused checkpoints, the shared steps of experiments 1 and 2) and
:mod:`exp_stats` (statistics and tables); this module holds the command-line plumbing.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from pathlib import Path
from typing import Optional

import click

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx.core)
from mlx_ssp.config import apply_overrides
from mlx_ssp.errors import UserError
from mlx_ssp.io import write_json_atomic
from mlx_ssp.progress import turned_off

# the scripts reach every shared piece as common.NAME
from exp_profiles import (  # noqa: F401
    DEFAULTS, PROFILES, SPECTRUM_SOURCES, TESTBED, TINY_VERIFIER, TOOLS, _register_tiny_verifier, _tiny_defaults,
)
from exp_stats import (  # noqa: F401
    fdiff, fmt, md_table, mean_se, paired, pass_at_ks, samples_setting, scores, t_test, task_diff_map, task_diffs,
    task_table, two_way_se,
)
from exp_steps import (  # noqa: F401
    domains_with_data, fuse_checkpoint, prompt_key, rl_arm, rl_from, rl_from_dir, specialists, spectrum_data,
)
from exp_workspace import Ctx, _fingerprint  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


def write_results(ctx: Ctx, name: str, results: dict, text: str) -> None:
    """results JSON + the Markdown table, both under WORK_DIR/NAME/."""
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results = {**results, "config": ctx.raw, "tiny": ctx.tiny, "date": date, "command": " ".join(["python", *sys.argv])}
    write_json_atomic(ctx.path(name, "results.json"), results)
    ctx.path(name, "results.md").write_text(text + "\n")
    click.echo(text)


# ------------------------------------------------------------------------------------------------
# CLI plumbing shared by the scripts


def options(f):
    for opt in reversed([
        click.option("--tiny", is_flag=True,
                     help="Tiny random model, minimal sizes: checks the script runs end to end."),
        click.option("--work-dir", default=None,
                     help="Cache directory (default runs/experiments, or runs/experiments-tiny)."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Override a config key, e.g. --set sft.iters=40 --set sft_seeds=[0,1]."),
        click.option("--no-progress", is_flag=True, help="No progress bars."),
    ]):
        f = opt(f)
    return f


def make_ctx(tiny: bool, work_dir: Optional[str], overrides: tuple[str, ...], no_progress: bool,
             defaults: Optional[dict] = None, tiny_defaults: Optional[dict] = None, name: str = "experiments") -> Ctx:
    """The context of a run: ``defaults`` (default :data:`DEFAULTS`; ``tiny_defaults`` with ``--tiny``)
    with the ``--set`` overrides applied; keys outside the defaults are an error."""
    base = defaults if defaults is not None else DEFAULTS
    cfg = copy.deepcopy((tiny_defaults if tiny_defaults is not None else _tiny_defaults()) if tiny else base)
    cfg = apply_overrides(cfg, list(overrides))
    unknown = sorted(set(cfg) - set(base))
    if unknown:
        raise UserError(f"unknown experiment key(s) {', '.join(unknown)}; valid: {', '.join(sorted(base))}")
    if cfg.get("domains") is not None:  # a subset of the tasks' domains (its own cache keys: tasks change)
        have = cfg["tasks"]["domains"]
        bad = [d for d in cfg["domains"] if d not in have]
        if bad or not cfg["domains"]:
            raise UserError(f"domains: {', '.join(bad) or '(empty)'} not among the tasks' domains ({', '.join(have)})")
        cfg["tasks"] = {**cfg["tasks"], "domains": {d: have[d] for d in cfg["domains"]}}
    work = Path(work_dir or (f"runs/{name}-tiny" if tiny else f"runs/{name}"))
    if tiny:
        _register_tiny_verifier()
        if cfg["model"] == "demo":
            from mlx_ssp.testing import make_tiny_model

            mdir = work / "tiny_model"
            if not (mdir / "config.json").exists():
                make_tiny_model(mdir, "qwen3")
            cfg["model"] = str(mdir)
    work.mkdir(parents=True, exist_ok=True)
    return Ctx(cfg, work, tiny, progress=not no_progress)


def entry_point(run_fn, doc: str):
    """The click command of an experiment script: common options -> context -> ``run_fn``."""

    @click.command(help=doc)
    @options
    @click.option("--profile", type=click.Choice(sorted(PROFILES)), default="demo", show_default=True,
                  help="The defaults: the demo model, the testbed model (testbed:multi, three domains), or the "
                       "tool-use testbed model (testbed:tools, four backends).")
    def cli(tiny, work_dir, overrides, no_progress, profile):
        with turned_off() if no_progress else contextlib.nullcontext():  # also the bars no flag reaches (SFT)
            run_fn(make_ctx(tiny, work_dir, overrides, no_progress, defaults=PROFILES[profile],
                            name="experiments" if profile == "demo" else f"experiments-{profile}"))

    return cli


def main(fn):
    """Run a click command; UserError -> one line, exit 2 (as the CLI does)."""
    try:
        fn(standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
