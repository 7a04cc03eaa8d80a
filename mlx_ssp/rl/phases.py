"""Sequential RL phases (VibeThinker-3B report, arXiv:2606.16140, section 2.2.2: Math -> Code -> STEM,
each with its own verifier, then Long2Short as a second math stage).

``rl.phases`` is a list; each phase is a name, which tasks (``tasks`` JSONL, ``domains``), an optional
``verifier`` for all of them, and overrides of any other ``rl:`` key (deep-merged:
:meth:`mlx_ssp.rl.config.RLConfig.resolved_phases`). Phase i trains from phase i-1's fused model (the
first from the stage's model) in ``<output>/phases/<name>/`` (its metrics, checkpoints,
``prompt_filter.json``, ``rl_config.json``, its fused ``model/`` and ``phase.json``, written when the
phase is finished). A rerun skips every finished phase whose settings (and every earlier phase's) are
unchanged and resumes the interrupted one from its last checkpoint; a finished phase whose settings
changed is an error (``--restart``; inside ``mlx_ssp run`` the stage fingerprint already moved the old
outputs aside).

Before each phase (and before a single-phase run) with ``prompt_filter`` set, the prompts its starting
policy always or never solves are removed (:mod:`mlx_ssp.rl.prompt_filter`).

Without ``phases`` the stage is one run in ``<output>`` exactly as before (same files, same
fingerprint); ``prompt_filter`` and ``long2short`` work there too.

Deviations: each phase adds fresh LoRA adapters on the previous phase's *fused* model (the report
trains full weights; with ``fine_tune_type: full`` that is what happens here too); the phases share
the section's seed unless a phase sets ``seed``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Optional

from mlx_ssp import distributed as dist
from mlx_ssp import trackers
from mlx_ssp.card import Card
from mlx_ssp.errors import UserError
from mlx_ssp.finetune.fuse import fuse_and_save
from mlx_ssp.io import write_json_atomic
from mlx_ssp.rl.policy import load_policy
from mlx_ssp.rl.prompt_filter import filter_prompts
from mlx_ssp.rl.trainer import config_record, fingerprint, train
from mlx_ssp.stage_config import section_seed
from mlx_ssp.tasks import load_tasks

PHASE_FILE = "phase.json"


def phase_dir(out: Path, name: str) -> Path:
    return Path(out) / "phases" / name


def phase_tasks(tasks: list, phase, cfg) -> list:
    """The phase's tasks: ``tasks`` (its own JSONL) or the stage's, kept to ``domains``, each scored
    by ``verifier`` when the phase names one."""
    if phase.overrides().get("tasks"):
        tasks = load_tasks(cfg.tasks)
    if phase.domains is not None:
        want = set(phase.domains)
        have = sorted({t.domain for t in tasks})
        tasks = [t for t in tasks if t.domain in want]
        if not tasks:
            raise UserError(f"rl.phases '{phase.name}': no task of domain(s) {', '.join(phase.domains)}; "
                            f"the tasks have {', '.join(have) or 'none'}")
    if phase.verifier is not None:
        tasks = [t.model_copy(update={"verifier": phase.verifier}) for t in tasks]
    return tasks


def phase_fingerprint(previous: str, phase, cfg, seed: int) -> str:
    """Hash of what a finished phase's model depends on: the earlier phases' fingerprints, the phase's
    tasks selection and its resolved settings (those a resume may change left out, steps kept)."""
    payload = {"previous": previous, "name": phase.name, "domains": phase.domains, "verifier": phase.verifier,
               "rl": fingerprint(config_record(cfg, seed, "")), "steps": cfg.steps}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def rl_card(cfg, model_path, summary: dict, seed: int, phase: Optional[str] = None) -> Card:
    """The fused RL model's card: the GRPO settings (steps, G, MGPO lambda, lr, ...) and the last step's reward."""
    lora = cfg.lora
    adapter = (f"LoRA rank {lora.rank}, scale {lora.scale:g}, layers {'all' if lora.num_layers < 0 else lora.num_layers}"
               if cfg.fine_tune_type == "lora" else "full fine-tuning")
    last = summary.get("last") or {}
    settings = {"phase": phase, "steps": summary.get("steps"), "prompts per step": cfg.batch_size,
                "group size G": cfg.group_size, "MGPO lambda": cfg.mgpo_lambda, "loss": cfg.loss,
                "learning rate": cfg.learning_rate, "KL beta": cfg.beta, "training": adapter,
                "temperature": cfg.sampling.temperature, "max tokens": cfg.sampling.max_tokens, "seed": seed,
                "train prompts": summary.get("tasks"), "last reward mean": last.get("reward_mean")}
    how = "LoRA adapters fused into the weights" if cfg.fine_tune_type == "lora" else "every weight trained"
    return Card("grpo", (str(model_path),), settings, data_files=(cfg.tasks,) if cfg.tasks else (),
                title=f"RL phase {phase}" if phase else "RL model", how=how)


def train_one(model_cfg, tasks: list, cfg, out: Path, *, seed: int, resume: bool, where: str = "rl"):
    """One RL run in ``out``: load the policy, the 0/1 filter (when ``prompt_filter`` is set), train.
    Returns ``(summary, model, tokenizer, model_path)``; the summary has ``prompt_filter`` (its counts)
    when the filter ran."""
    model, tokenizer, path, ref = load_policy(model_cfg, cfg, seed)
    report = None
    if cfg.prompt_filter is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        tasks, report = filter_prompts(model, tokenizer, tasks, cfg, Path(out), seed=seed, resume=resume, where=where)
    summary = train(model, tokenizer, tasks, cfg, out, seed=seed, resume=resume, ref_model=ref, model_path=str(path))
    if report is not None:
        summary["prompt_filter"] = report["counts"]
        summary["tasks"] = len(tasks)  # the prompts trained on, after the filter
    return summary, model, tokenizer, path


def run_phases(model_cfg, tasks: list, cfg, out: Path, *, seed: int, resume: bool = True,
               echo=None) -> dict:
    """Every phase of ``cfg.phases`` in order (see the module docstring); each one's fused model is
    ``phases/<name>/model``. Returns the stage summary: the last phase's ``last``/``checkpoint``, the
    total ``steps``/``skipped_total`` and ``phases`` (one entry per phase)."""
    out = Path(out)
    previous, start = "", model_cfg
    done: list[dict] = []
    for phase, pcfg in cfg.resolved_phases():
        d = phase_dir(out, phase.name)
        pseed = section_seed(pcfg, seed)
        fp = phase_fingerprint(previous, phase, pcfg, pseed)
        marker = _read(d / PHASE_FILE) if resume else {}
        if marker.get("complete") and marker.get("fingerprint") == fp and (d / "model").is_dir():
            _say(echo, f"[rl] phase {phase.name}: finished, skipping")
            entry = marker["summary"]
        elif marker.get("complete"):
            raise UserError(f"rl.phases '{phase.name}' finished with other settings (or after other earlier "
                            f"phases) in {d}; pass --restart to rerun every phase, or set rl.output elsewhere")
        else:
            _say(echo, f"[rl] phase {phase.name}: training from {start.path}")
            ptasks = phase_tasks(tasks, phase, pcfg)
            with trackers.scope(phase.name):  # rl/<phase>/reward_mean, ... (mlx_ssp.trackers)
                summary, model, tok, path = train_one(start, ptasks, pcfg, d, seed=pseed, resume=resume,
                                                      where=f"rl.phases '{phase.name}'")
            entry = {"name": phase.name, "start": str(start.path), "model": str(d / "model"),
                     "tasks": summary.get("tasks", len(ptasks)),
                     **{k: summary.get(k) for k in ("steps", "skipped_total", "last", "checkpoint", "out_dir",
                                                     "prompt_filter")}}
            # rank 0 writes the next phase's starting model; the other ranks wait for it
            with dist.main_first(f"rl: fuse phase {phase.name}") as do_it:
                if do_it:
                    fuse_and_save(model, tok, Path(path), d / "model", dequantize=False, overwrite=True,
                                  card=rl_card(pcfg, path, {**summary, "tasks": entry["tasks"]}, pseed, phase.name))
                    write_json_atomic(d / PHASE_FILE, {"fingerprint": fp, "complete": True, "summary": entry})
            del model
        done.append(entry)
        previous, start = fp, model_cfg.model_copy(update={"path": str(d / "model"), "revision": None})
    last = done[-1]
    return {"steps": sum(p.get("steps") or 0 for p in done), "skipped_total": sum(p.get("skipped_total") or 0 for p in done),
            "last": last.get("last"), "checkpoint": last.get("checkpoint"), "out_dir": str(out),
            "model": last["model"], "phases": done}


def phase_models(out: Path, cfg) -> dict[str, str]:
    """``{phase name: its fused model}`` for every phase of ``cfg`` whose model exists, in phase order."""
    return {p.name: str(phase_dir(out, p.name) / "model") for p in (cfg.phases or [])
            if (phase_dir(out, p.name) / "model").is_dir()}


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _say(echo: Optional[Callable[[str], None]], msg: str) -> None:
    if echo is not None:
        echo(msg)
