"""``mlx_ssp tasks``: export task files from sources (:func:`mlx_ssp.tasks.build.export_source`,
:func:`mlx_ssp.tasks.export.export_yaml`), list sources, show a task file."""

from __future__ import annotations

from collections import Counter

import click

from mlx_ssp.agents.episode import is_episode
from mlx_ssp.agents.gold import gold_messages
from mlx_ssp.commands.options import set_option
from mlx_ssp.config import parse_override
from mlx_ssp.errors import UserError
from mlx_ssp.io import write_jsonl_atomic
from mlx_ssp.tasks import load_tasks, write_tasks
from mlx_ssp.tasks.build import export_source
from mlx_ssp.tasks.export import export_yaml, is_yaml
from mlx_ssp.tasks.sources import SOURCES
from mlx_ssp.verify import UNAVAILABLE, VERIFIERS, verify


@click.group("tasks")
def cli() -> None:
    """Task files (JSONL, one task record per line) from GSM8K, reasoning-gym, HumanEval, BFCL,
    JSONL with a field mapping, or Hugging Face datasets. See docs/tasks.md."""


def _kv(items: tuple[str, ...]) -> dict:
    out: dict = {}
    for item in items:
        keys, value = parse_override(item)
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return out


@cli.command("export")
@click.argument("source")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Task JSONL to write.")
@click.option("--size", type=click.IntRange(0), default=None, help="Tasks per domain for the split (default: all rows of a file source, 100 for reasoning-gym).")
@click.option("--seed", type=int, default=None, help="Seed for sampling and splitting (default 1234, or tasks.seed of the YAML).")
@click.option("--split", type=click.Choice(["train", "probe", "eval", "all"]), default=None, help="Which split to write (default: train for a shorthand, all for a YAML file; 'all' tags each task with metadata.split).")
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE", help="Source parameter for a shorthand, e.g. --param max_digits=2 (repeatable).")
@click.option("--instruction", default=None, help="Answer-format instruction appended to each prompt (default: the source's; '' for none).")
@click.option("--system", default=None, help="System prompt added to each task.")
@click.option("--verifier", default=None, help="Verifier name (default: the source's own).")
@click.option("--answer-extraction", type=click.Choice(["strict", "lenient"]), default=None, help="Final-answer extraction for math / reasoning_gym.")
@click.option("--domain", default=None, help="Domain name (default: derived from SOURCE).")
@click.option("--gold", is_flag=True, help="Episode sources with ground truth: write each task's gold conversation "
              '({"task": ..., "messages": [...]}: the ground-truth calls and their real results), which mlx_ssp verify scores 1.')
@set_option
def export(source, output, size, seed, split, params, instruction, system, verifier, answer_extraction, domain, gold,
           overrides) -> None:
    """Write a task file from SOURCE: a YAML file (a run file with a `tasks:` section, or the section
    itself) or a shorthand: gsm8k:PATH, reasoning_gym:DATASET, humaneval[:PATH], bfcl:CATEGORY,
    jsonl:PATH, hf:DATASET."""
    if is_yaml(source):
        if params or instruction is not None or system is not None or verifier or answer_extraction or domain:
            raise UserError("with a YAML source, set domain options in the file or with --set tasks.domains.NAME.KEY=VALUE")
        tasks = export_yaml(source, tuple(overrides), seed=seed, size=size, split=split)
    else:
        if overrides:
            raise UserError("--set applies to YAML sources; use --param for a shorthand's source parameters")
        kw = dict(instruction=instruction, system=system, verifier=verifier, answer_extraction=answer_extraction)
        sp = split or "train"
        if sp == "all":
            raise UserError("--split all needs a YAML source with sizes for each split")
        tasks = export_source(source, size=size, seed=seed, split=sp, params=_kv(params), domain=domain, **kw)
    if gold:
        _write_gold(output, tasks)
    else:
        write_tasks(output, tasks)
    counts = Counter((t.domain, t.metadata.get("split", "?")) for t in tasks)
    for (d, s), n in sorted(counts.items()):
        click.echo(f"{d:24s} {s:6s} {n:6d}")
    click.echo(f"wrote {len(tasks)} tasks to {output}")


def _write_gold(output: str, tasks: list) -> None:
    """One gold conversation per episode task (:func:`mlx_ssp.agents.gold.gold_messages`)."""
    if not all(is_episode(t) for t in tasks):
        raise UserError("--gold needs an episode source (episodes:PATH or bfcl_multi_turn:CATEGORY)")
    lines = []
    for t in tasks:
        msgs = gold_messages(t)
        res = verify(msgs, t)  # a gold episode that does not pass is a broken task or environment
        if res.reward < 1.0:
            raise UserError(f"task '{t.id}': its ground truth does not pass ({res.detail})")
        lines.append({"task": t.model_dump(mode="json"), "messages": msgs})
    write_jsonl_atomic(output, lines)


@cli.command("list")
def list_cmd() -> None:
    """List source kinds, reasoning-gym datasets and BFCL categories."""
    click.echo("Sources:")
    for k, s in SOURCES.items():
        click.echo(f"  {k + ':' + s.help:64s} verifier: {s.verifier or '(configure)'}")
    for s in SOURCES.values():
        if s.catalogue is not None:
            click.echo(s.catalogue())

    click.echo("Verifiers: " + ", ".join(sorted(VERIFIERS)) + "".join(f"; {k}: {v}" for k, v in UNAVAILABLE.items()))


@cli.command("show")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("-n", "n_examples", default=1, show_default=True, help="Example tasks to print.")
def show(path: str, n_examples: int) -> None:
    """Check a task file (records, ids, verifiers) and summarise it by domain, split and verifier."""
    import json


    tasks = load_tasks(path)
    counts = Counter((t.domain, t.metadata.get("split", "-"), t.verifier) for t in tasks)
    click.echo(f"{'domain':24s} {'split':6s} {'verifier':14s} {'tasks':>6s}")
    for (d, s, v), n in sorted(counts.items()):
        click.echo(f"{d:24s} {s:6s} {v:14s} {n:6d}")
    for t in tasks[:n_examples]:
        click.echo(f"\n--- {t.id}")
        click.echo(t.prompt if isinstance(t.prompt, str) else json.dumps(t.prompt, indent=1, ensure_ascii=False))
        click.echo(f"--- answer: {json.dumps(t.answer, ensure_ascii=False)[:300]}")
