"""The rl stage on its own (``mlx_ssp rl``): the run file's ``rl:`` section through the one stage
loader, its training tasks, then :func:`mlx_ssp.rl.trainer.load_and_train`.

Reads the ``model:`` section (the policy to train; usually the merged model), the ``rl:`` section
and, when ``rl.tasks`` is not set, the ``tasks:`` section's ``train`` split. Writes to
``rl.output`` (default ``<run_dir>/rl``): metrics.jsonl, checkpoints/step_N/, and the latest
adapters.safetensors + adapter_config.json (fuse with ``mlx_lm fuse --adapter-path``), and with
``fuse`` (``mlx_ssp rl --upload-repo``) the fused model with its card in ``<output>/fused/`` (the
directory uploaded). Not ``<output>/model/``: that is where ``mlx_ssp run`` keeps its RL model, which
a later run file may name as its policy. Rerunning resumes from the last checkpoint; ``restart``
starts afresh.

With ``rl.phases`` the phases run one after another in ``<output>/phases/<name>/``
(:func:`mlx_ssp.rl.phases.run_phases`), each fused into its own ``model/``; a rerun skips the finished ones.
"""

from __future__ import annotations

from pathlib import Path

from mlx_ssp import distributed as dist
from mlx_ssp import trackers
from mlx_ssp.config import load_section
from mlx_ssp.errors import UserError
from mlx_ssp.finetune.fuse import fuse_and_save
from mlx_ssp.rl.phases import rl_card, run_phases, train_one
from mlx_ssp.stage_config import load_stage, note_old_default
from mlx_ssp.tasks import load_tasks
from mlx_ssp.tasks.build import build_split


def load_stage_config(config_path, overrides):
    """(:class:`~mlx_ssp.stage_config.StageConfig` of the rl section, output directory) through the one
    stage loader; the output is ``rl.output``, else ``<run_dir>/rl``."""
    st = load_stage(config_path, overrides, "rl")
    out = Path(st.cfg.output) if st.cfg.output else st.run_dir / "rl"
    if not st.cfg.output:
        note_old_default(st, Path("runs/rl"), out, "pass --set rl.output=runs/rl")
    return st, out


def load_config(config_path, overrides):
    """(raw data, rl section, ModelConfig, seed, output directory): :func:`load_stage_config` unpacked."""
    st, out = load_stage_config(config_path, overrides)
    return st.data, st.cfg, st.model, st.seed, out


def load_train_tasks(data: dict, cfg, source: str):
    if cfg.tasks:
        return load_tasks(cfg.tasks)
    if data.get("tasks"):
        tasks = build_split(load_section(data, "tasks", source=source), "train")
        if not tasks:
            raise UserError(f"{source}: the tasks: section gives no train tasks")
        return tasks
    raise UserError(f"{source}: no training tasks; set rl.tasks (a task JSONL) or a tasks: section")


#: where ``fuse`` writes the fused model, inside the output directory
FUSED = "fused"


def check_fused_dir(fused: Path, policy: str) -> None:
    """Refuse a fused-model directory that is, or holds, the policy's own model: the fuse replaces the
    directory, so it would delete the model being trained from."""
    p = Path(policy).expanduser()
    if not p.exists():  # a Hub id: nothing local to overwrite
        return
    p, f = p.resolve(), fused.resolve()
    if p == f or f in p.parents:
        raise UserError(f"the fused model would go to {fused}, which is the policy model ({policy}) itself; "
                        "set rl.output to another directory")


def run(config_path, overrides=(), *, restart: bool = False, fuse: bool = False,
        report_to: tuple[str, ...] | None = None) -> dict:
    """Load everything named in the run file and train, holding the output directory's lock
    (:func:`mlx_ssp.distributed.output_lock`: a second job on it fails at once); returns the summary.
    ``fuse`` (without phases, whose models are always fused): fuse the final adapters into
    ``<output>/fused`` with its model card (the summary's ``model``). ``report_to``: the trackers
    (None: the run file's ``report_to``; :mod:`mlx_ssp.trackers`)."""
    st, out = load_stage_config(config_path, overrides)
    cfg, mcfg, seed = st.cfg, st.model, st.seed
    if fuse and not cfg.phases:  # before training, not after it
        check_fused_dir(out / FUSED, mcfg.path)
    source = str(config_path or "--set")
    tasks = load_train_tasks(st.data, cfg, source)

    with dist.output_lock(out), trackers.for_stage(st, report_to, command="rl", dir=out, section="rl"):
        if cfg.phases:
            import sys

            return run_phases(mcfg, tasks, cfg, out, seed=seed, resume=not restart,
                              echo=lambda m: print(m, file=sys.stderr, flush=True))
        summary, model, tokenizer, path = train_one(mcfg, tasks, cfg, out, seed=seed, resume=not restart)
        if fuse:
            with dist.main_first("rl: fuse the final model") as do_it:
                if do_it:
                    fuse_and_save(model, tokenizer, Path(path), out / FUSED, dequantize=False, overwrite=True,
                                  card=rl_card(cfg, path, {"tasks": len(tasks), **summary}, seed))
            summary["model"] = str(out / FUSED)
        return summary
