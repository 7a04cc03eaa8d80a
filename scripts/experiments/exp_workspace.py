"""One experiment workspace (:class:`Ctx`): the validated config, the work directory, the base model,
and every cached step (tasks, rollouts, selection, SFT, evaluation, merge). Each step's directory is
named by a hash of the config sections it depends on (chained), so a changed setting reruns exactly
the steps it affects and never reuses a stale result.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Optional

import click

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx.core)
from mlx_ssp.errors import UserError
from mlx_ssp.io import write_json_atomic, write_jsonl_atomic

from exp_profiles import SPECTRUM_SOURCES


def _train_records(data: str) -> Optional[int]:
    """Records in an SFT data path (a JSONL file, or a directory holding train.jsonl); None when
    there is no such file (``run_sft`` then says so)."""
    p = Path(data)
    p = p / "train.jsonl" if p.is_dir() else p
    if not p.is_file():
        return None
    with open(p) as f:
        return sum(1 for line in f if line.strip())


def _fingerprint(x: Any) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Ctx:
    """One experiment workspace: the resolved config, the work directory and the loaded base model."""

    def __init__(self, cfg: dict, work: Path, tiny: bool, progress: bool = True):
        from mlx_ssp.config import validate
        from mlx_ssp.eval import EvalConfig
        from mlx_ssp.merge.config import MergeStageConfig
        from mlx_ssp.rl.config import RLConfig
        from mlx_ssp.rollout import RolloutConfig
        from mlx_ssp.select import SelectConfig
        from mlx_ssp.tasks.config import TasksConfig

        self.raw, self.work, self.tiny, self.progress = cfg, work, tiny, progress
        self.seed = int(cfg["seed"])
        self.tasks_cfg = validate(TasksConfig, cfg["tasks"], source="experiment", prefix="tasks")
        self.rollout_cfg = validate(RolloutConfig, {**cfg["rollout"], "seed": self.seed}, source="experiment",
                                    prefix="rollout")
        self.select_raw = dict(cfg["select"])
        validate(SelectConfig, self.select_raw, source="experiment", prefix="select")
        self.eval_cfg = validate(EvalConfig, cfg["eval"], source="experiment", prefix="eval")
        self.merge_cfg = validate(MergeStageConfig, cfg["merge"], source="experiment", prefix="merge")
        self.rl_cfg = validate(RLConfig, cfg["rl"], source="experiment", prefix="rl")
        self.sft_seeds = [int(s) for s in cfg["sft_seeds"]]
        self.rl_eval_every = int(cfg["rl_eval_every"])
        self.domains = list(self.tasks_cfg.domains)
        self._base = None
        # cache keys: each step's directory is named by the config it depends on (chained)
        self.k_tasks = _fingerprint(cfg["tasks"])
        self.k_rollout = _fingerprint([self.k_tasks, cfg["model"], cfg["rollout"], self.seed])
        src = cfg.get("spectrum_source", "rollouts")
        if src not in SPECTRUM_SOURCES:
            raise UserError(f"spectrum_source: {src!r} is not valid; valid: {', '.join(SPECTRUM_SOURCES)}")
        # the generator's data do not depend on the model's rollouts (but on the tasks, the system prompt
        # written into every SFT message, and the model and seed the later steps use); "rollouts" keeps its old key
        self.k_generator = _fingerprint([self.k_tasks, "generator", cfg["rollout"].get("system")])
        self.k_select = _fingerprint([self.k_rollout, cfg["select"]] if src == "rollouts" else
                                     [self.k_generator, cfg["select"], cfg["model"], self.seed])
        self.k_sft = _fingerprint([self.k_select, cfg["sft"], cfg["model"]])
        self.k_merge = _fingerprint([self.k_sft, cfg["merge"]])
        self.k_eval = _fingerprint([self.k_tasks, cfg["eval"], self.seed])

    # -- paths / small helpers ---------------------------------------------------------------
    def path(self, *parts: str) -> Path:
        return self.work.joinpath(*parts)

    def log(self, msg: str) -> None:
        click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)

    @property
    def model_path(self) -> str:
        from mlx_ssp.models import resolve_model

        return str(resolve_model(self.raw["model"]))

    def base(self):
        """(model, tokenizer, path) of the base model, loaded once."""
        if self._base is None:
            from mlx_ssp.models import load_model

            self._base = load_model(self.raw["model"])
        return self._base

    # -- cached steps ------------------------------------------------------------------------
    def tasks(self, split: str) -> Path:
        """The split's task JSONL (built once from the tasks config)."""
        from mlx_ssp.tasks import write_tasks
        from mlx_ssp.tasks.build import build_split

        p = self.path("tasks", self.k_tasks, f"{split}.jsonl")
        if not p.exists():
            write_tasks(p, build_split(self.tasks_cfg, split))
        return p

    def load_tasks(self, split: str, domains: Optional[list[str]] = None):
        from mlx_ssp.tasks import load_tasks

        ts = load_tasks(self.tasks(split))
        return [t for t in ts if domains is None or t.domain in domains]

    def rollouts(self) -> Path:
        """K rollouts per train prompt of the base model (resumable: run_rollouts appends)."""
        from mlx_ssp.rollout import run_rollouts

        out = self.path("rollout", self.k_rollout, "rollouts.jsonl")
        if not out.with_name("rollouts.summary.json").exists():
            self.log("rollouts of the base model on the train split")
            model, tok, _ = self.base()
            run_rollouts(self.raw["model"], self.tasks("train"), self.rollout_cfg, out, progress=self.progress,
                         model=model, tokenizer=tok)
        return out

    def select_dir(self, name: str) -> Path:
        return self.path("select", self.k_select, name)

    def sft_dir(self, name: str) -> Path:
        return self.path("sft", self.k_sft, name)

    def selection(self, policy: str) -> Path:
        """``OUT/<domain>/{train,valid}.jsonl`` + spectrum.json of one selection policy."""
        from mlx_ssp.config import validate
        from mlx_ssp.select import SelectConfig, run_select

        out = self.select_dir(policy)
        if not (out / "spectrum.json").exists():
            cfg = validate(SelectConfig, {**self.select_raw, "policy": policy}, source="experiment", prefix="select")
            gold = None
            if cfg.gold:  # episode tasks: BFCL's ground truth played through the environment, in the model's tokens
                from mlx_ssp.select import gold_records

                gold = gold_records(self.load_tasks("train"), self.base()[1])
            run_select(self.spectrum_rollouts(), cfg, out, overwrite=True, gold=gold)
        return out

    def spectrum_rollouts(self) -> Path:
        """What selection chooses from: the base model's rollouts, or (``spectrum_source:
        generator``) the testbed generator's traces of every correct strategy per train prompt."""
        if self.raw.get("spectrum_source", "rollouts") == "rollouts":
            return self.rollouts()
        from mlx_ssp.rollout.resume import sidecar
        from mlx_ssp.testbed.spectrum import solution_records

        out = self.path("rollout", self.k_generator, "generator.jsonl")
        if not out.exists():
            try:
                recs = solution_records(self.load_tasks("train"))
            except ValueError as e:
                raise UserError(f"spectrum_source: generator: {e}") from None
            write_json_atomic(sidecar(out, "meta"), {"model": "generator", "system": self.rollout_cfg.system})
            write_jsonl_atomic(out, recs)
        return out

    def sft(self, name: str, domains: dict[str, dict], seed: int, iters: Optional[int] = None,
            probe_max_tasks: Optional[int] = None, overrides: Optional[dict] = None) -> dict:
        """Train (or read back) LoRA specialists: ``domains`` maps name -> {data, probe_tasks}.
        ``overrides`` replaces keys of the ``sft`` section (the directory name then carries their
        hash). Returns ``{domain: fused model dir}``."""
        from mlx_ssp.config import validate
        from mlx_ssp.sft import SFTConfig, run_sft

        if overrides:
            name = f"{name}-{_fingerprint(overrides)[:8]}"
        out = self.sft_dir(name)
        raw = copy.deepcopy(self.raw["sft"])
        raw.update(domains=domains, out_dir=str(out), seed=seed, **(overrides or {}))
        if iters is not None:
            raw["iters"] = iters
        if probe_max_tasks is not None:
            raw["probe"] = {**raw.get("probe", {}), "max_tasks": probe_max_tasks}
        cfg = validate(SFTConfig, raw, source="experiment", prefix="sft")
        todo = [d for d in domains if not (out / d / "result.json").exists()]
        # A domain with fewer train records than the batch (a seed whose base model solved only a
        # few prompts) trains with one batch of all its records rather than stopping the
        # experiment; other domains keep the configured batch, so their results do not change.
        # (Lines, not usable records: a domain that loses records to max_seq_length still fails in run_sft.)
        batch = {d: min(cfg.batch_size, _train_records(domains[d]["data"]) or cfg.batch_size) for d in todo}
        for b in sorted(set(batch.values()), reverse=True):
            group = [d for d in todo if batch[d] == b]
            note = "" if b == cfg.batch_size else f"; batch {b}: fewer train records than batch_size={cfg.batch_size}"
            self.log(f"sft {name}: {', '.join(group)} ({cfg.iters} iters, seed {seed}{note})")
            model, tok, path = self.base()
            run_sft(cfg.model_copy(update={"batch_size": b}), self.raw["model"], run_dir=self.work, seed=seed,
                    only=group, model_and_tokenizer=(model, tok, path))
        return {d: str(out / "specialists" / d) for d in domains}

    def eval_path(self, name: str, key: str, domains: Optional[list[str]], split: str = "eval",
                  n: Optional[int] = None) -> Path:
        # the held-out split at the eval section's n keeps the key it always had
        what = [key, domains] if (split, n) == ("eval", None) else [key, domains, split, n]
        return self.path("eval", self.k_eval, f"{name}-{_fingerprint(what)[:8]}.json")

    def evaluate(self, name: str, model_dir: Optional[str], domains: Optional[list[str]] = None,
                 model=None, tokenizer=None, ident: Optional[str] = None, split: str = "eval",
                 n: Optional[int] = None) -> dict:
        """pass@1 / pass@k on the held-out (eval) split of ``domains`` (or another ``split``, with
        ``n`` samples per task instead of the eval section's), cached in
        ``eval/<eval key>/NAME-<model key>.json``. ``model_dir`` None = the base model; an in-memory
        ``model`` needs an ``ident`` that names its weights (e.g. its run directory and step)."""
        from mlx_ssp.eval import evaluate

        if model is not None and ident is None:
            raise ValueError("an in-memory model needs an ident for its cache key")
        key = ident or (f"dir:{Path(model_dir).resolve()}" if model_dir else f"base:{self.raw['model']}")
        f = self.eval_path(name, key, domains, split, n)
        if f.exists():
            return json.loads(f.read_text())
        tasks = self.load_tasks(split, domains)
        self.log(f"eval {name} on {len(tasks)} {'held-out' if split == 'eval' else split} tasks ({', '.join(sorted({t.domain for t in tasks}))})")
        if model is None:
            if model_dir is None:
                model, tokenizer, _ = self.base()
            else:
                from mlx_ssp.models import load_model

                model, tokenizer, _ = load_model(model_dir)
        c = self.eval_cfg
        k = c.k if n is None else min(c.k, n)
        n = c.n if n is None else n
        res = evaluate(model, tokenizer, tasks, k=k, n=n, sampling=c.sampling, seed=self.seed,
                       batch_size=c.batch_size, progress=self.progress, model_name=name)
        res["model_dir"] = model_dir
        dom = {t.id: t.domain for t in tasks}
        for row in res["tasks"]:
            row["domain"] = dom[row["task_id"]]
        write_json_atomic(f, res)
        return res

    def merge(self, name: str, models: list[str], method: Optional[str] = None, update: Optional[dict] = None) -> str:
        """The models merged with the merge section's settings (``method``: another method;
        ``update``: other merge settings, e.g. weights; both named in the cache directory by ``name``)."""
        from mlx_ssp.merge.engine import merge_models

        cfg = self.merge_cfg.model_copy(update={**({"method": method} if method else {}), **(update or {})})
        out = self.path("merge", self.k_merge, name, "model")
        if not (out / "config.json").exists():
            self.log(f"merge {name}: {cfg.method} of {len(models)} models")
            merge_models([Path(m) for m in models], Path(self.model_path), cfg, out, overwrite=True,
                         seed=self.seed, progress=False)
        return str(out)
