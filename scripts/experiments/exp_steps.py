"""The experiments' composite steps on a :class:`Ctx`: RL from a starting model (experiments 1, 3 and
5), an SFT checkpoint fused into the base model, and the selection data and specialists that
experiments 1 and 2 share. Each is cached in the workspace like the steps it is built from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from mlx_ssp.errors import UserError
from mlx_ssp.io import read_jsonl, write_json_atomic, write_jsonl_atomic

from exp_workspace import Ctx, _fingerprint

# ------------------------------------------------------------------------------------------------
# RL from a starting model (experiments 1, 3 and 5)


def rl_arm(ctx: Ctx, arm: str, lam: float, start: str, out: Path, domains: list[str],
           train_domains: Optional[list[str]] = None, update: Optional[dict] = None) -> dict[int, dict]:
    """Train one RL arm from the model at ``start`` with ``ctx.rl_cfg`` (``mgpo_lambda`` = ``lam``,
    and the RL settings in ``update``, e.g. another learning rate) on the train tasks of
    ``train_domains`` (None: every domain), resumable (the RL loop continues from its last
    checkpoint); returns {step: held-out eval on ``domains``} for every evaluated step (every
    ``rl_eval_every`` and the last; step 0 excluded)."""
    from mlx_ssp.models import load_model
    from mlx_ssp.rl.policy import setup_model
    from mlx_ssp.rl.trainer import train

    cfg = ctx.rl_cfg.model_copy(update={**(update or {}), "mgpo_lambda": lam})
    steps = cfg.steps
    every = ctx.rl_eval_every
    want = sorted({s for s in range(every, steps + 1, every)} | {steps})

    def ev(s: int, **kw) -> dict:  # the held-out evaluation of this arm at step s (cached)
        return ctx.evaluate(f"rl-{arm}-step{s}", None, domains, ident=f"rl:{out / arm}:step{s}", **kw)

    done = {s: ctx.eval_path(f"rl-{arm}-step{s}", f"rl:{out / arm}:step{s}", domains) for s in want}
    if all(f.exists() for f in done.values()):
        return {s: json.loads(f.read_text()) for s, f in done.items()}
    ctx.log(f"rl {arm} (lambda={lam}): {steps} steps x {cfg.batch_size} prompts x G={cfg.group_size}")
    model, tok, path = load_model(start)
    setup_model(model, cfg)
    tasks = ctx.load_tasks("train", train_domains)

    def on_step(tr, rec):
        if tr.step_no in done:
            ev(tr.step_no, model=tr.model, tokenizer=tok)

    res = train(model, tok, tasks, cfg, out / arm, seed=ctx.seed, model_path=str(path), on_step=on_step)
    missing = [s for s, f in done.items() if not f.exists()]
    if missing:  # the run was complete on disk before its evaluations (e.g. killed in between)
        from mlx_ssp.rl.trainer import Trainer, latest_checkpoint

        ckpt = latest_checkpoint(out / arm)
        if ckpt is None or missing != [steps]:
            raise UserError(f"{out / arm}: evaluations of steps {missing} are missing; delete the directory to rerun")
        tr = Trainer(model, tok, tasks, cfg, out / arm, seed=ctx.seed, model_path=str(path))
        tr.load_checkpoint(ckpt)
        ev(steps, model=model, tokenizer=tok)
    del res
    return {s: json.loads(f.read_text()) for s, f in done.items()}


def rl_from(ctx: Ctx, name: str, start: str, domain: str) -> dict:
    """The held-out eval of ``domain`` after ``ctx.rl_cfg`` (its steps and lambda) from the model at
    ``start``, trained on that domain's train prompts (cached like every step): the same RL budget
    for every starting point an experiment compares."""
    evals = rl_arm(ctx, name, ctx.rl_cfg.mgpo_lambda, start, rl_from_dir(ctx, name, start).parent, [domain],
                   train_domains=[domain])
    return evals[ctx.rl_cfg.steps]


def rl_from_dir(ctx: Ctx, name: str, start: str) -> Path:
    """The RL output directory of :func:`rl_from` (keyed by the RL settings, the start and the seed)."""
    tag = _fingerprint({"rl": ctx.raw["rl"], "every": ctx.rl_eval_every, "start": start, "seed": ctx.seed})[:8]
    return ctx.path("rl_from", tag, name)


def fuse_checkpoint(ctx: Ctx, domain_dir: Path, step: int, out: Path, overrides: Optional[dict] = None) -> str:
    """The base model with one SFT checkpoint's LoRA adapter (``domain_dir/checkpoints``) fused in,
    saved at ``out`` (once): any checkpoint, not only the one the rule chose, can start RL.
    ``overrides``: the ones the SFT run was given (:meth:`Ctx.sft`), so the LoRA is rebuilt as trained."""
    if (out / "config.json").exists():
        return str(out)
    from mlx_ssp.config import validate
    from mlx_ssp.finetune.checkpoints import find_checkpoint, load_adapter_weights
    from mlx_ssp.finetune.fuse import fuse_and_save
    from mlx_ssp.finetune.lora import attach_lora
    from mlx_ssp.models import load_model
    from mlx_ssp.sft import SFTConfig

    cfg = validate(SFTConfig, {**ctx.raw["sft"], **(overrides or {})}, source="experiment", prefix="sft")
    model, tok, path = load_model(ctx.raw["model"])  # a fresh copy: the fuse changes its weights
    attach_lora(model, cfg.lora, 0)  # the init is replaced by the checkpoint's weights
    load_adapter_weights(model, find_checkpoint(domain_dir / "checkpoints", step))
    fuse_and_save(model, tok, Path(path), out, dequantize=cfg.dequantize, overwrite=True)
    return str(out)


# ------------------------------------------------------------------------------------------------
# the shared steps of experiments 1 and 2


def spectrum_data(ctx: Ctx) -> dict[str, Path]:
    """Selection data of both arms of experiment 1: ``diverse`` (as selected) and ``first``
    repeated to the diverse set's count per prompt (``first_matched``), in mlx-lm chat format."""
    div = ctx.selection("diverse")
    first = ctx.selection("first")
    matched = ctx.select_dir("first_matched")
    if not (matched / "done.json").exists():
        report = json.loads((div / "spectrum.json").read_text())
        counts: dict[str, int] = {}
        for dom, row in report["domains"].items():
            if row.get("dir") is None:
                continue
            for part in ("train", "valid"):
                for rec in read_jsonl(div / row["dir"] / f"{part}.jsonl"):
                    key = prompt_key(rec)
                    counts[key] = counts.get(key, 0) + 1
            for part in ("train", "valid"):
                src = first / row["dir"] / f"{part}.jsonl"
                out = []
                for rec in read_jsonl(src):
                    out += [rec] * counts[prompt_key(rec)]
                write_jsonl_atomic(matched / row["dir"] / f"{part}.jsonl", out)
        rep_first = json.loads((first / "spectrum.json").read_text())
        rep_first["matched_to"] = str(div)  # first-win records repeated to the diverse count per prompt
        write_json_atomic(matched / "spectrum.json", rep_first)
        write_json_atomic(matched / "done.json", {"from": [str(div), str(first)]})
    return {"diverse": div, "first_matched": matched}


def prompt_key(rec: dict) -> str:
    return json.dumps(rec["messages"][:-1], sort_keys=True)


def domains_with_data(sel_dir: Path) -> list[str]:
    report = json.loads((sel_dir / "spectrum.json").read_text())
    return [d for d, row in report["domains"].items() if row.get("dir")]


def specialists(ctx: Ctx, arm: str, seed: int) -> dict[str, str]:
    """The per-domain specialists of one selection arm and seed (experiment 1; diverse seed = exp 2's)."""
    data = spectrum_data(ctx)[arm]
    doms = domains_with_data(data)
    if not doms:
        raise UserError("the base model's rollouts have no correct solution in any domain: nothing to train on")
    probe = str(ctx.tasks("probe"))
    return ctx.sft(f"{arm}-s{seed}", {d: {"data": str(data / d), "probe_tasks": probe} for d in doms}, seed)

