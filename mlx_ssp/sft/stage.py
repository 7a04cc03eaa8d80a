"""The SFT stage: train each domain's specialist with mlx-lm's trainer, checkpoint and probe every
``save_every`` steps, choose a checkpoint, fuse it (the algorithm is in :mod:`mlx_ssp.sft`)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from math import gcd
from pathlib import Path
from typing import Optional

from mlx_ssp import distributed as dist
from mlx_ssp import trackers
from mlx_ssp.card import Card
from mlx_ssp.errors import UserError
from mlx_ssp.finetune import checkpoints as ckpts
from mlx_ssp.finetune.fuse import fuse_and_save, restore_base
from mlx_ssp.finetune.lora import adapter_config as lora_adapter_config
from mlx_ssp.finetune.lora import attach_lora
from mlx_ssp.finetune.optim import build_optimizer as _build
from mlx_ssp.finetune.seed import step_seed
from mlx_ssp.io import JsonlAppender, write_json_atomic, write_jsonl_atomic
from mlx_ssp.models import load_model
from mlx_ssp.progress import mlx_lm_train_ui
from mlx_ssp.select import safe_dirname
from mlx_ssp.sft import curriculum as C
from mlx_ssp.sft.batches import make_iterate_batches, make_masked_iterate_batches
from mlx_ssp.sft.config import SFTConfig
from mlx_ssp.sft.curriculum import CurriculumConfig
from mlx_ssp.sft.data import DomainPlan, _read_records, load_sft_file, plan_domains, val_batch_size
from mlx_ssp.sft.loss import chunked_is_exact, make_loss
from mlx_ssp.sft.packing import check_packable
from mlx_ssp.sft.probe import ProbeFn, default_probe, probe_seed, read_curve, write_curve  # noqa: F401
from mlx_ssp.stage_config import default_run_dir, section_seed


def build_optimizer(cfg: SFTConfig):
    from mlx_lm.tuner.utils import build_schedule

    lr = build_schedule(cfg.lr_schedule.model_dump()) if cfg.lr_schedule else cfg.learning_rate
    return _build(cfg.optimizer, lr, cfg.optimizer_config, what="sft.optimizer_config")


def adapter_config(cfg: SFTConfig, model_path: Path) -> dict:
    """The adapter_config.json mlx-lm's ``load_adapters`` / ``fuse`` read (plus provenance)."""
    return lora_adapter_config(
        cfg.lora, fine_tune_type=cfg.lora.fine_tune_type, num_layers=cfg.lora.num_layers, model=str(model_path),
        mask_prompt=cfg.mask_prompt, max_seq_length=cfg.max_seq_length, learning_rate=cfg.learning_rate,
        iters=cfg.iters, batch_size=cfg.batch_size,
    )


#: config fields that must not change between a run and its resume
_FINGERPRINT = (
    "lora", "optimizer", "optimizer_config", "learning_rate", "lr_schedule", "iters", "batch_size",
    "max_seq_length", "mask_prompt", "grad_accumulation_steps", "report_every", "save_every", "val_batches", "probe",
)


def fingerprint(cfg: SFTConfig, seed: int, model_path: Path, plan: DomainPlan) -> dict:
    d = cfg.model_dump(mode="json", include=set(_FINGERPRINT))
    d["probe"].pop("progress", None)
    d.update(seed=seed, model=str(model_path), train=str(plan.train_path), valid=str(plan.valid_path))
    return d


def batching(cfg: SFTConfig, plan: DomainPlan, seed: int, skip: int = 0) -> dict:
    """The ``iterate_batches`` and ``loss`` keywords of mlx-lm's ``train`` / ``evaluate`` for a
    domain's data: token records (whole episodes), and every kind when ``cfg.pack``, get our masked
    (or packed) batches and the masked loss; the other kinds get mlx-lm's own batches (seeded,
    resumable) and its default loss's target mask. The cross-entropy is computed the ``cfg.loss`` way,
    at the weighted targets only when ``cfg.gather_targets`` (chunked loss: batches carry their index)."""
    gather = cfg.gather_targets and cfg.loss == "chunked"
    if plan.stats.get("format") == "tokens" or cfg.pack:
        return {"iterate_batches": make_masked_iterate_batches(seed, skip=skip, pack=cfg.pack, gather=gather),
                "loss": make_loss(cfg.loss, token_batches=True, gather=gather)}
    return {"iterate_batches": make_iterate_batches(seed, skip=skip, gather=gather),
            "loss": make_loss(cfg.loss, token_batches=False, gather=gather)}


class _Hook:
    """mlx-lm ``TrainingCallback``: logs loss reports, saves + probes a checkpoint every N steps."""

    def __init__(self, run: "_DomainRun", start: int, extra: list):
        self.run, self.start, self.extra = run, start, extra
        self.hook_time = 0.0

    def on_train_loss_report(self, info: dict) -> None:
        tic = time.perf_counter()
        step = self.start + int(info["iteration"])
        rec = {"step": step, **{k: float(v) for k, v in info.items() if k != "iteration"}}
        dist.heartbeat()
        self.run.metrics.write(rec)
        trackers.log(self.run.plan.name, rec, step)  # sft/<domain>/train_loss, ...
        if step % self.run.cfg.save_every == 0 or step == self.run.cfg.iters:
            self.run.checkpoint(step, rec["train_loss"])
        self.hook_time += time.perf_counter() - tic
        for cb in self.extra:  # user/test callbacks see global steps
            cb.on_train_loss_report({**info, "iteration": step})

    def on_val_loss_report(self, info: dict) -> None:  # we validate at checkpoints instead
        pass


class _DomainRun:
    def __init__(self, cfg, plan, model, tokenizer, model_path, ddir, seed, probe_fn):
        self.cfg, self.plan, self.model, self.tokenizer = cfg, plan, model, tokenizer
        self.model_path, self.ddir, self.seed, self.probe_fn = model_path, ddir, seed, probe_fn
        self.optimizer = None
        self.metrics: Optional[JsonlAppender] = None
        self.probe_time = 0.0
        self.val_time = 0.0

    # -- checkpoint + probe ---------------------------------------------------------------
    def val_loss(self) -> Optional[float]:
        if self.plan.valid_set is None:
            return None
        from mlx_lm.tuner.trainer import evaluate

        tic = time.perf_counter()
        loss = evaluate(
            self.model, self.plan.valid_set, num_batches=self.cfg.val_batches,
            batch_size=val_batch_size(self.cfg.batch_size, len(self.plan.valid_set), dist.size()),
            max_seq_length=self.cfg.max_seq_length, **batching(self.cfg, self.plan, self.seed),
        )
        self.val_time += time.perf_counter() - tic
        return float(loss)

    def checkpoint(self, step: int, train_loss: Optional[float]) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        weights = dict(tree_flatten(self.model.trainable_parameters()))
        opt_state = dict(tree_flatten(self.optimizer.state))
        val = self.val_loss()
        root = self.ddir / "checkpoints"
        path = ckpts.checkpoint_dir(root, step)
        if dist.is_main():  # rank 0 writes; val loss and the probe run on every rank (data parallel)
            state = {"step": step, "train_loss": train_loss, "val_loss": val,
                     "learning_rate": float(self.optimizer.learning_rate.item()), "time": time.time()}
            ckpts.write_checkpoint(path, weights, adapter_config(self.cfg, self.model_path), opt_state, state)
            ckpts.trim_optimizer_states(root, step)
        self.probe(path)
        self.model.train()
        mx.random.seed(step_seed(self.seed, step))

    def probe(self, ckpt: Path) -> None:
        self.model.eval()  # no LoRA dropout while sampling
        tic = time.perf_counter()
        res = self.probe_fn(self.model, self.tokenizer, self.plan.probe_tasks, self.cfg.probe, probe_seed(self.cfg, self.seed))
        dt = time.perf_counter() - tic
        self.probe_time += dt
        rec = {**res, "pass@1": float(res["pass@1"]), "pass@k": float(res["pass@k"]), "k": self.cfg.probe.k,
               "n_tasks": len(self.plan.probe_tasks), "seconds": dt}
        if not dist.is_main():  # every rank sampled its share of the probe; rank 0 writes
            return
        write_json_atomic(ckpt / "probe.json", rec)
        chosen = write_curve(self.ddir, self.plan.name, self.cfg.select)
        step = ckpts.step_of(ckpt.name)
        if trackers.active():  # the probe curve's row (val_loss, probe/pass@1, ...); its read only when sent
            state = json.loads((ckpt / "state.json").read_text())
            trackers.log(self.plan.name, {"val_loss": state.get("val_loss"), "probe": trackers.without(rec, "k")}, step)
        print(
            f"[sft {self.plan.name}] step {step}: pass@1 {rec['pass@1']:.3f}  pass@{rec['k']} {rec['pass@k']:.3f}"
            f"  (best so far: step {chosen['step'] if chosen else '-'}; probe {dt:.1f}s)",
            file=sys.stderr,
        )

    def load_adapter(self, ckpt: Path) -> None:
        ckpts.load_adapter_weights(self.model, ckpt)

    # -- the whole domain -----------------------------------------------------------------
    def train(self, callbacks: list, init_adapter: Optional[Path] = None) -> dict:
        """Train to ``cfg.iters`` (resuming from the last checkpoint; a fresh start from
        ``init_adapter`` when given: curriculum stage 2 starts from stage 1's last checkpoint)."""
        import mlx.core as mx
        from mlx_lm.tuner.trainer import TrainingArgs, train

        cfg = self.cfg
        done = ckpts.list_checkpoints(self.ddir / "checkpoints")
        dist.check_same([p.name for p in done], what=f"the checkpoints in {self.ddir} (it must be on a disk all hosts share)")
        # a checkpoint saved but not probed before a crash is probed now
        for p in done:
            if not (p / "probe.json").is_file():
                self.load_adapter(p)
                self.probe(p)
        start = 0
        if done:
            start = ckpts.step_of(done[-1].name)
            self.load_adapter(done[-1])
        elif init_adapter is not None:
            self.load_adapter(init_adapter)
        self.optimizer = build_optimizer(cfg)
        if start and start < cfg.iters:
            ckpts.load_optimizer_state(self.optimizer, self.model, done[-1], hint="pass --overwrite")
            print(f"[sft {self.plan.name}] resuming from step {start}", file=sys.stderr)
        # drop loss reports newer than the resume point (they are re-done)
        mpath = self.ddir / "metrics.jsonl"
        if dist.is_main():
            ckpts.trim_metrics(mpath, start)
        train_wall = 0.0
        hook = None
        self.metrics = dist.appender(mpath)  # rank 0 writes the metrics
        try:
            if start < cfg.iters:
                mx.random.seed(step_seed(self.seed, start))
                args = TrainingArgs(
                    batch_size=cfg.batch_size,
                    iters=cfg.iters - start,
                    val_batches=cfg.val_batches,
                    steps_per_report=gcd(cfg.report_every, cfg.save_every),
                    steps_per_eval=cfg.iters + 1,  # we validate at checkpoints
                    steps_per_save=cfg.iters + 1,  # we save at checkpoints
                    max_seq_length=cfg.max_seq_length,
                    adapter_file=str(self.ddir / "adapters_last.safetensors"),
                    grad_checkpoint=cfg.grad_checkpoint,
                    grad_accumulation_steps=cfg.grad_accumulation_steps,
                )
                hook = _Hook(self, start, callbacks)
                self.model.train()
                tic = time.perf_counter()
                # mlx-lm's all_sums: stop, not hang, on a lost rank; our bar in place of mlx-lm's display
                with dist.watch(f"sft {self.plan.name} training"), mlx_lm_train_ui(f"sft {self.plan.name}"):
                    train(
                        model=self.model, optimizer=self.optimizer, train_dataset=self.plan.train_set, val_dataset=None,
                        args=args, training_callback=hook, **batching(cfg, self.plan, self.seed, skip=start),
                    )
                train_wall = time.perf_counter() - tic
                # mlx-lm's trainer saves its final weights here; the last checkpoint already has them
                (self.ddir / "adapters_last.safetensors").unlink(missing_ok=True)
        finally:
            self.metrics.close()
        overhead = hook.hook_time if hook else 0.0
        return {"train_seconds": train_wall - overhead, "probe_seconds": self.probe_time, "val_seconds": self.val_time,
                "checkpoint_seconds": max(0.0, overhead - self.probe_time - self.val_time)}


def specialist_card(cfg: SFTConfig, plan: DomainPlan, model_path: Path, chosen: dict, seed: int,
                    kind: str = "lora") -> Card:
    """The fused specialist's model card: the LoRA recipe, its data and the chosen checkpoint."""
    lora = cfg.lora
    settings = {"domain": plan.name, "adapter": f"{lora.fine_tune_type}, rank {lora.rank}, scale {lora.scale:g}, "
                f"dropout {lora.dropout:g}", "layers": "all" if lora.num_layers < 0 else lora.num_layers,
                "optimizer": cfg.optimizer, "learning rate": cfg.learning_rate, "iters": cfg.iters,
                "batch size": cfg.batch_size, "max sequence length": cfg.max_seq_length, "seed": seed,
                "train records": plan.stats.get("records"), "checkpoint rule": cfg.select,
                "chosen step": chosen.get("step"), "probe pass@1": chosen.get("pass@1"),
                f"probe pass@{cfg.probe.k}": chosen.get("pass@k")}
    return Card(kind, (str(model_path),), settings, data_files=(str(plan.train_path),),
                title=f"{plan.name} specialist" if kind == "lora" else "distilled student")


def train_specialist(
    cfg: SFTConfig,
    plan: DomainPlan,
    model,
    tokenizer,
    model_path: Path,
    out_dir: Path,
    *,
    seed: int,
    probe_fn: ProbeFn = default_probe,
    callbacks: list | None = None,
    card_kind: str = "lora",
) -> dict:
    """Train, probe, choose and fuse one domain's specialist on the (shared) base ``model``.
    The model is the base model again when this returns (also on error)."""
    ddir = out_dir / safe_dirname(plan.name)
    spec_dir = out_dir / "specialists" / safe_dirname(plan.name)
    done = _open_domain_dir(cfg, plan, model_path, ddir, spec_dir, seed)
    if done is not None:
        return done
    attach_lora(model, cfg.lora, seed)  # LoRA A init from the seed (replaced by the checkpoint on resume)
    try:
        run = _DomainRun(cfg, plan, model, tokenizer, model_path, ddir, seed, probe_fn)
        times = run.train(callbacks or [])
        chosen = dist.run_on_main(lambda: write_curve(ddir, plan.name, cfg.select), what="sft: choose the checkpoint")
        if chosen is None:  # pragma: no cover - every run ends with a probed checkpoint
            raise UserError(f"{ddir}: no probed checkpoint to choose from")
        ckpt = ckpts.find_checkpoint(ddir / "checkpoints", chosen["step"])  # also an earlier run's name
        curriculum = None
        if cfg.curriculum is not None:
            curriculum, stage2 = _curriculum_stage(cfg, plan, run, tokenizer, model_path, ddir, seed, probe_fn, callbacks)
            if stage2 is not None:  # stage 2 ran: the specialist is its pick
                curriculum["stage1_chosen_step"] = chosen["step"]
                chosen, ckpt = stage2
        # rank 0 fuses and saves while the others wait (an error there stops them all)
        with dist.main_first(f"sft {plan.name}: fuse the specialist") as do_it:
            if do_it:
                run.load_adapter(ckpt)
                # the chosen adapter beside adapter_config.json: `mlx_lm fuse --adapter-path DDIR` works
                shutil.copyfile(ckpt / "adapters.safetensors", ddir / "adapters.safetensors")
                fuse_and_save(model, tokenizer, model_path, spec_dir, dequantize=cfg.dequantize, overwrite=True,
                              card=specialist_card(cfg, plan, model_path, chosen, seed, card_kind))
        result = _result(cfg, plan, chosen, ckpt, spec_dir, times)
        if curriculum is not None:
            result["curriculum"] = curriculum
        if not dist.is_main():
            return result
        write_json_atomic(ddir / "result.json", result)
        trackers.log(plan.name, {"chosen_step": chosen["step"], **times}, cfg.iters)  # train_seconds, probe_seconds...
        print(f"[sft {plan.name}] chose step {chosen['step']} by {cfg.select}; specialist at {spec_dir}", file=sys.stderr)
        return result
    finally:
        restore_base(model)


def record_length(rec: dict, tokenizer) -> int:
    """Tokens of one SFT record as trained on (whole conversation; the report's trace length)."""
    if "token_ids" in rec:
        return len(rec["token_ids"])
    if "messages" in rec:
        kw = {"tools": rec["tools"]} if rec.get("tools") else {}
        return len(tokenizer.apply_chat_template(rec["messages"], tokenize=True, **kw))
    return len(tokenizer.encode(str(rec.get("prompt", "")) + str(rec.get("completion", ""))))


def _curriculum_stage(cfg: SFTConfig, plan: DomainPlan, stage1: "_DomainRun", tokenizer, model_path: Path, ddir: Path,
                      seed: int, probe_fn: ProbeFn, callbacks: Optional[list]) -> tuple[dict, Optional[tuple]]:
    """Curriculum stage 2 (:mod:`mlx_ssp.sft.curriculum`) in ``DDIR/stage2``: the hard subset of the
    domain's records, trained from stage 1's last checkpoint, probed and chosen by the same rule.
    Returns what it did and ``(chosen, checkpoint)``, or None in its place when the subset is empty."""
    import dataclasses


    cc = cfg.curriculum
    if cc.reference is None:
        raise UserError("sft.curriculum.reference: name the reference model's rollouts JSONL "
                        "(`mlx_ssp run` uses its rollout stage)")
    ddir2 = ddir / "stage2"
    recs = [r for _, r in _read_records(plan.train_path)]
    rates = C.error_rates(C.read_rollouts(Path(cc.reference)))
    lengths = [record_length(r, tokenizer) for r in recs]
    keep, dropped = C.hard_subset(lengths, [rates.get(C.record_key(r)) for r in recs], min_tokens=cc.min_tokens,
                                  min_error_rate=cc.min_error_rate)
    info = {"records": len(recs), "kept": len(keep), "dropped": dropped, **cc.model_dump(mode="json")}
    if not keep:
        info["skipped"] = "the hard subset is empty (see dropped); stage 1's checkpoint is the specialist"
        print(f"[sft {plan.name}] curriculum stage 2 skipped: no record is at least {cc.min_tokens} tokens long "
              f"with a reference error rate >= {cc.min_error_rate} ({dropped})", file=sys.stderr)
        if dist.is_main():
            write_json_atomic(ddir2 / "curriculum.json", info)
        return info, None
    subset = ddir2 / "train.jsonl"
    if dist.is_main():
        write_jsonl_atomic(subset, [recs[i] for i in keep])
    dist.barrier("sft: curriculum subset written")
    ds, stats = load_sft_file(subset, tokenizer, mask_prompt=cfg.mask_prompt, max_seq_length=cfg.max_seq_length)
    plan2 = dataclasses.replace(plan, name=f"{plan.name}/stage2", train_path=subset, train_set=ds, stats=stats)
    cfg2 = cfg.model_copy(update={"iters": C.stage2_iters(cc, stats["records"], cfg.batch_size)})
    last1 = ckpts.list_checkpoints(ddir / "checkpoints")[-1]
    fp = {**fingerprint(cfg2, seed, model_path, plan2), "curriculum": cc.model_dump(mode="json"), "from": last1.name}
    if (ddir2 / "sft_config.json").is_file():
        ckpts.check_fingerprint(json.loads((ddir2 / "sft_config.json").read_text()), fp, where=ddir2,
                                hint="pass --overwrite (or sft.overwrite=true) to start this domain again")
    elif dist.is_main():
        write_json_atomic(ddir2 / "sft_config.json", fp)
    info.update(iters=cfg2.iters, from_checkpoint=last1.name)
    run2 = _DomainRun(cfg2, plan2, stage1.model, tokenizer, model_path, ddir2, seed, probe_fn)
    info["times"] = run2.train(callbacks or [], init_adapter=last1)
    chosen = dist.run_on_main(lambda: write_curve(ddir2, plan2.name, cfg.select), what="sft: choose the stage 2 checkpoint")
    if dist.is_main():
        write_json_atomic(ddir2 / "curriculum.json", info)
    return info, (chosen, ckpts.find_checkpoint(ddir2 / "checkpoints", chosen["step"]))


def _curriculum_settings(result: dict) -> Optional[dict]:
    """The curriculum settings a finished domain's result was made with (None: one stage)."""
    cur = result.get("curriculum")
    if cur is None:
        return None

    return CurriculumConfig.model_validate({k: cur[k] for k in CurriculumConfig.model_fields if k in cur}).model_dump(mode="json")


def _open_domain_dir(cfg: SFTConfig, plan: DomainPlan, model_path: Path, ddir: Path, spec_dir: Path,
                     seed: int) -> Optional[dict]:
    """Clear (``overwrite``) or check (same settings) the domain directory; the finished result when
    the domain is already done, else None after recording the settings and the adapter config."""
    fp = fingerprint(cfg, seed, model_path, plan)
    if cfg.overwrite and dist.is_main():
        shutil.rmtree(ddir, ignore_errors=True)
        shutil.rmtree(spec_dir, ignore_errors=True)
    dist.barrier("sft: clear the domain directory")
    fp_path = ddir / "sft_config.json"
    if fp_path.is_file():
        ckpts.check_fingerprint(json.loads(fp_path.read_text()), fp, where=ddir,
                                hint="pass --overwrite (or sft.overwrite=true) to start this domain again")
    result_path = ddir / "result.json"
    if result_path.is_file() and spec_dir.is_dir():
        done = json.loads(result_path.read_text())
        # curriculum stage 2 is not in the stage-1 fingerprint: a finished domain is done only for
        # the same curriculum settings (added, changed or removed: the stage 2 part is redone)
        same_cur = _curriculum_settings(done) == (cfg.curriculum.model_dump(mode="json") if cfg.curriculum else None)
        if done.get("rule") == cfg.select and same_cur:
            print(f"[sft {plan.name}] already done (step {done['chosen_step']}), skipping", file=sys.stderr)
            return done
    if dist.is_main():
        ddir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(fp_path, fp)
        write_json_atomic(ddir / "adapter_config.json", adapter_config(cfg, model_path))
    return None


def _result(cfg: SFTConfig, plan: DomainPlan, chosen: dict, ckpt: Path, spec_dir: Path, times: dict) -> dict:
    """``result.json`` of a domain: the chosen checkpoint, the specialist, the data and the timings."""
    return {
        "domain": plan.name,
        "rule": cfg.select,
        "chosen_step": chosen["step"],
        "chosen": chosen,
        "specialist": str(spec_dir),
        "adapter": str(ckpt),
        "probe_source": plan.probe_source,
        "data": {"train": str(plan.train_path), "valid": str(plan.valid_path) if plan.valid_path else None,
                 **plan.stats},
        **times,
        "probe_overhead": times["probe_seconds"] / times["train_seconds"] if times["train_seconds"] > 0 else None,
        "total_seconds": times["train_seconds"] + times["probe_seconds"],
    }


def sft_out_dir(cfg: SFTConfig, run_dir: str | Path) -> Path:
    """Where the SFT stage writes: ``sft.out_dir``, else ``<run_dir>/sft``."""
    return Path(cfg.out_dir) if cfg.out_dir else Path(run_dir) / "sft"


def run_sft(
    cfg: SFTConfig,
    model_cfg,
    *,
    run_dir: str | Path | None = None,
    run_data: dict | None = None,
    seed: int = 0,
    source: str = "",
    only: list[str] | None = None,
    probe_fn: ProbeFn = default_probe,
    callbacks: list | None = None,
    model_and_tokenizer: tuple | None = None,
    card_kind: str = "lora",
) -> dict:
    """Train every domain's specialist, one after another, on one loaded base model.
    All inputs are checked first. Returns the summary written to ``OUT/summary.json``.
    ``card_kind`` is the recipe its model cards name (:data:`mlx_ssp.card.KINDS`)."""
    if not cfg.domains:
        raise UserError(f"{source or 'sft'}: sft.domains is empty; list the domains to train (e.g. domains: [math])")
    if cfg.batch_size % dist.size():
        raise UserError(f"sft.batch_size={cfg.batch_size} must be divisible by the number of ranks ({dist.size()})")
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir({}, None)  # the one rule
    out_dir = sft_out_dir(cfg, run_dir)
    seed = section_seed(cfg, seed)
    if only:
        unknown = [d for d in only if d not in cfg.domains]
        if unknown:
            raise UserError(f"--domain {', '.join(unknown)}: not in sft.domains ({', '.join(cfg.domains)})")
        cfg = cfg.model_copy(update={"domains": {d: cfg.domains[d] for d in only}})
    if model_and_tokenizer is not None:
        model, tokenizer, model_path = model_and_tokenizer
    else:
        model, tokenizer, model_path = load_model(model_cfg)
    if cfg.pack:
        try:
            check_packable(model)
        except ValueError as e:
            raise UserError(f"{source or 'sft'}: {e}") from None
    if cfg.loss == "chunked" and not chunked_is_exact(model):
        print(f"[sft] {type(model).__module__}: the logits are not the LM head of the last hidden states "
              "(scaled or capped after the head); sft.loss chunked would train another loss, using logits",
              file=sys.stderr)
        cfg = cfg.model_copy(update={"loss": "logits"})
    plans = plan_domains(cfg, model, tokenizer, run_data or {}, run_dir, source)
    results = {}
    for plan in plans:
        results[plan.name] = train_specialist(
            cfg, plan, model, tokenizer, Path(model_path), out_dir, seed=seed, probe_fn=probe_fn, callbacks=callbacks,
            card_kind=card_kind,
        )
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {"domains": {}}
    for name, r in results.items():
        summary["domains"][name] = {k: r[k] for k in ("specialist", "chosen_step", "rule", "adapter")} | {
            "pass@1": r["chosen"].get("pass@1"), "pass@k": r["chosen"].get("pass@k"),
            "probe_overhead": r.get("probe_overhead"),
        }
    summary["base_model"] = str(model_path)
    if dist.is_main():
        write_json_atomic(summary_path, summary)
    return summary


