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
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import click

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx.core)
from mlx_ssp.config import apply_overrides
from mlx_ssp.errors import UserError
from mlx_ssp.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from mlx_ssp.metrics import pass_at_k
from mlx_ssp.progress import turned_off

ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------------------
# configuration

_ARITH = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "allow_parentheses": False,
          "allow_negation": False}
_SAMPLING = {"temperature": 0.9, "top_p": 1.0, "max_tokens": 20}

#: demo-scale defaults, sized for a few minutes per experiment on a quiet 2-core CPU
DEFAULTS: dict[str, Any] = {
    "model": "demo",
    "seed": 0,
    "tasks": {
        "seed": 1234,
        "domains": {
            "addition": {"source": "reasoning_gym:basic_arithmetic", "params": {**_ARITH, "operators": ["+"]},
                         "answer_extraction": "lenient", "sizes": {"train": 12, "probe": 4, "eval": 12}},
            "subtraction": {"source": "reasoning_gym:basic_arithmetic", "params": {**_ARITH, "operators": ["-"]},
                            "answer_extraction": "lenient", "sizes": {"train": 12, "probe": 4, "eval": 12}},
        },
    },
    "rollout": {"k": 8, "sampling": _SAMPLING, "batch_size": 128},
    "select": {"per_prompt": 4},
    "sft": {
        "lora": {"rank": 8, "num_layers": 8, "scale": 20.0},
        "learning_rate": 3e-4,
        "iters": 12,
        "batch_size": 4,
        "save_every": 6,
        "report_every": 3,
        "val_batches": 0,
        "max_seq_length": 512,
        "probe": {"k": 4, "max_tasks": 4, "batch_size": 64, "sampling": _SAMPLING, "progress": False},
    },
    "sft_seeds": [0],
    "eval": {"k": 8, "n": 8, "sampling": _SAMPLING, "batch_size": 128},
    "merge": {"method": "linear"},
    "rl": {
        "steps": 4, "batch_size": 4, "group_size": 8, "sampling": {**_SAMPLING, "temperature": 0.9},
        "gen_batch_size": 128, "micro_batch_size": 16, "learning_rate": 1e-4, "mgpo_lambda": 1.0,
        "checkpoint_every": 2, "progress": False, "lora": {"rank": 8, "num_layers": 8},
    },
    "rl_eval_every": 4,  # held-out evaluation every N RL steps (and at the last)
    "domains": None,  # the tasks' domains to use (null: all); e.g. [addition] for one
    # experiment 3: also a GRPO arm at this x the learning rate (a number > 0, or "mgpo": the MGPO
    # arm's mean weight over its steps); null: not run
    "grpo_lr_scale": None,
    # experiment 3: more MGPO arms at these lambdas (numbers > 0), beside rl.mgpo_lambda's, e.g.
    # [0.5, 2, 4] for a lambda grid that shares one GRPO arm
    "extra_lambdas": [],
    # experiment 5: also probe every checkpoint with n samples per probe prompt and rank by pass@k at
    # each k of ks, e.g. {n: 256, ks: [16, 64, 256]}; null: not run
    "large_k": None,
    # experiments 1 and 2: where the SFT data are selected from: "rollouts" (the base model's K
    # samples) or "generator" (the testbed generator's own traces of every correct strategy,
    # mlx_ssp.testbed.spectrum: a spectrum that exists by construction; testbed tasks only)
    "spectrum_source": "rollouts",
    # experiment 1: pass@k at these k (<= spectrum_eval.n) after SFT, from n samples on every held-out
    # task of each domain (the spectrum itself); null: not run
    "spectrum_eval": None,
    # experiment 2: controls for merge vs blend: the blend at half its LoRA scale, a soup of two
    # blend seeds, the specialists' mean task vector scaled by each alpha (1 = the linear merge),
    # and the task vectors' cosines; null: not run
    "merge_controls": None,
}

_TB_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 48}


def _tb_domain(name: str) -> dict[str, Any]:
    # the learning round's splits (mlx_ssp.testbed.learning): the two easiest levels; eval and probe
    # are held out from pretraining
    return {"source": f"testbed:{name}", "params": {"levels": [2, 3]}, "sizes": {"train": 256, "probe": 32, "eval": 128}}


#: the testbed profile: the `multi` testbed model (three domains) with the learning round's
#: measured settings (SFT: lr 1e-4, 160 iterations of 8; RL: 60 steps of 8 x G=8 at 3e-4, LoRA scale 2)
TESTBED: dict[str, Any] = {
    "model": "testbed:multi:0",
    "seed": 0,
    "tasks": {"seed": 11, "domains": {d: _tb_domain(d) for d in ("sum", "diff", "countdown")}},
    "rollout": {"k": 8, "sampling": _TB_SAMPLING, "batch_size": 256},
    "select": {"per_prompt": 4},
    "sft": {
        "lora": {"rank": 8, "num_layers": -1, "scale": 20.0},
        "learning_rate": 1e-4,
        "iters": 160,
        "batch_size": 8,
        "save_every": 40,
        "report_every": 40,
        "val_batches": 0,
        "max_seq_length": 96,
        "probe": {"k": 8, "max_tasks": 32, "batch_size": 256, "sampling": _TB_SAMPLING, "progress": False},
    },
    "sft_seeds": [0],
    "eval": {"k": 8, "n": 8, "sampling": _TB_SAMPLING, "batch_size": 256},
    "merge": {"method": "linear"},
    "rl": {
        "steps": 60, "batch_size": 8, "group_size": 8, "sampling": _TB_SAMPLING, "gen_batch_size": 64,
        "micro_batch_size": 16, "learning_rate": 3e-4, "mgpo_lambda": 1.0, "beta": 0.0, "checkpoint_every": 60,
        "progress": False, "lora": {"rank": 8, "scale": 2.0},
    },
    "rl_eval_every": 60,
    "domains": None,
    "grpo_lr_scale": None,
    "extra_lambdas": [],
    "large_k": None,
    "spectrum_source": "rollouts",
    "spectrum_eval": None,
    # experiment 2: controls for merge vs blend: the blend at half its LoRA scale, a soup of two
    # blend seeds, the specialists' mean task vector scaled by each alpha (1 = the linear merge),
    # and the task vectors' cosines; null: not run
    "merge_controls": None,
}

_TOOLS_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 48}


def _tools_domain(backend: str) -> dict[str, Any]:
    # eval and probe: in-distribution episodes no train draw can produce (eval_space: seen), at the two
    # levels where testbed:tools is in the pass band (held-out names and levels 3-4: pass@1 under 0.1)
    return {"source": f"testbed_tools:{backend}", "params": {"levels": [1, 2], "eval_space": "seen"},
            "sizes": {"train": 64, "probe": 8, "eval": 24}}


#: the tool-use testbed profile: the `tools` testbed model and its four toy backends, one domain per
#: backend (the agents experiment: specialists per backend, blend, merge)
TOOLS: dict[str, Any] = {
    **TESTBED,
    "model": "testbed:tools:0",
    "tasks": {"seed": 11, "domains": {b: _tools_domain(b) for b in ("kv", "ctr", "files", "bank")}},
    "rollout": {"k": 8, "sampling": _TOOLS_SAMPLING, "batch_size": 64},
    "select": {"per_prompt": 4, "gold": True, "drop_truncated": False},
    "sft": {
        "lora": {"rank": 8, "num_layers": -1, "scale": 20.0},
        "learning_rate": 1e-4,
        "iters": 80,
        "batch_size": 8,
        "save_every": 40,
        "report_every": 40,
        "val_batches": 0,
        "max_seq_length": 448,
        "probe": {"k": 4, "max_tasks": 8, "batch_size": 64, "sampling": _TOOLS_SAMPLING, "progress": False},
    },
    "eval": {"k": 4, "n": 4, "sampling": _TOOLS_SAMPLING, "batch_size": 64},
    "rl": {**TESTBED["rl"], "sampling": _TOOLS_SAMPLING, "gen_batch_size": 32},
    "extra_merges": ["ties"],  # experiment 4: merge methods evaluated beside the merge section's
}

#: where experiments 1 and 2 select SFT data from (``spectrum_source``)
SPECTRUM_SOURCES = ("rollouts", "generator")

#: --profile NAME -> the defaults it starts from
PROFILES: dict[str, dict[str, Any]] = {"demo": DEFAULTS, "testbed": TESTBED, "tools": TOOLS}

TINY_VERIFIER = "experiments_tiny_even"


def _tiny_defaults() -> dict[str, Any]:
    d = copy.deepcopy(DEFAULTS)
    s = {"temperature": 1.0, "max_tokens": 6}
    for dom in d["tasks"]["domains"].values():
        dom["verifier"] = TINY_VERIFIER
        dom["sizes"] = {"train": 4, "probe": 2, "eval": 3}
    d["rollout"].update(k=4, sampling=s, batch_size=32)
    d["select"].update(drop_truncated=False)  # a random model never stops
    d["sft"].update(iters=2, batch_size=1, save_every=1, report_every=1, lora={"rank": 2, "num_layers": 1},
                    probe={"k": 2, "max_tasks": 2, "batch_size": 16, "sampling": s, "progress": False})
    d["eval"].update(k=2, n=2, sampling=s, batch_size=32)
    d["rl"].update(steps=2, batch_size=2, group_size=2, sampling=s, gen_batch_size=16, micro_batch_size=4,
                   checkpoint_every=1, lora={"rank": 2, "num_layers": 1})
    d["rl_eval_every"] = 1
    return d


def _register_tiny_verifier() -> None:
    from mlx_ssp.verify import VERIFIERS, VerifyResult, register

    if TINY_VERIFIER in VERIFIERS:
        return

    @register(TINY_VERIFIER)
    def _even(completion: str, task) -> VerifyResult:  # a coin flip that is a function of the text
        ok = len(completion) % 2 == 0
        return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer", "")


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
# statistics (pure)


def task_table(res: dict, k: int) -> dict[str, dict]:
    """task id -> {"domain", "pass@1", "pass@k"} of one eval result."""
    out = {}
    for t in res["tasks"]:
        out[t["task_id"]] = {"domain": t["domain"], "pass@1": t["pass@1"],
                             "pass@k": t[f"pass@{k}"]}
    return out


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) by its continued fraction (Lentz's method),
    evaluated on the side where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-14:
            break
    return front * (f - 1.0)


def t_test(xs: list[float]) -> Optional[dict]:
    """One-sample two-sided t-test of mean 0 over ``xs`` (e.g. one paired difference per seed):
    {"t", "df", "p", "positive", "negative"}; None below two values or with no spread."""
    m, se = mean_se(xs)
    if se is None or se == 0.0:
        return None
    t, df = m / se, len(xs) - 1
    p = _betainc(df / 2.0, 0.5, df / (df + t * t))
    return {"t": t, "df": df, "p": p, "positive": sum(x > 0 for x in xs), "negative": sum(x < 0 for x in xs)}


def two_way_se(diffs: dict[Any, dict[str, float]]) -> Optional[dict]:
    """The SE of a paired difference measured on the same tasks under several seeds
    (``diffs``: seed -> task -> difference), in its two components: across seeds (the sd of the
    seed means / sqrt(seeds): a new training run) and across tasks (the sd of the task means /
    sqrt(tasks): a new draw of tasks), and both together (their root sum of squares, conservative:
    the seed x task interaction is counted in each). Only tasks every seed has are used."""
    seeds = [s for s in diffs if diffs[s]]
    if len(seeds) < 2:
        return None
    tasks = sorted(set.intersection(*(set(diffs[s]) for s in seeds)))
    if len(tasks) < 2:
        return None
    _, se_seeds = mean_se([sum(diffs[s][t] for t in tasks) / len(tasks) for s in seeds])
    mean, se_tasks = mean_se([sum(diffs[s][t] for s in seeds) / len(seeds) for t in tasks])
    return {"mean": mean, "se_seeds": se_seeds, "se_tasks": se_tasks, "se": math.hypot(se_seeds, se_tasks),
            "seeds": len(seeds), "tasks": len(tasks)}


def mean_se(xs: list[float]) -> tuple[Optional[float], Optional[float]]:
    """Mean and standard error of the mean (sample sd / sqrt(n)); SE None below two values."""
    n = len(xs)
    if n == 0:
        return None, None
    m = sum(xs) / n
    if n < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def samples_setting(raw, key: str, what: str = "samples per task") -> Optional[tuple[int, list[int]]]:
    """A ``{n, ks}`` setting (n samples per task, pass@k at each k) as (n, sorted ks), None when
    null; anything else fails before any work, naming ``key``."""
    if raw is None:
        return None
    valid = f"null or {{n: {what}, ks: [k, ...] with 1 <= k <= n, the largest >= 2}}"
    if not isinstance(raw, dict) or set(raw) != {"n", "ks"}:
        raise UserError(f"{key}: {raw!r} is not valid; valid: {valid}")
    n, ks = raw["n"], raw["ks"]

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(n) or n < 1 or not isinstance(ks, list) or not ks or not all(is_int(k) and 1 <= k <= n for k in ks) \
            or max(ks) < 2:  # a rule or a curve named pass@<largest k> needs more than pass@1
        raise UserError(f"{key}: {raw!r} is not valid; valid: {valid}")
    return n, sorted(set(ks))


def pass_at_ks(res: dict, ks: list[int], domain: str) -> dict[int, float]:
    """k -> mean over the domain's tasks of the unbiased pass@k from each task's n samples."""
    rows = [t for t in res["tasks"] if t["domain"] == domain]
    return {k: sum(pass_at_k(t["n"], t["c"], k) for t in rows) / len(rows) for k in ks}


def scores(res: dict, k: int, domain: Optional[str] = None) -> dict:
    """pass@1 and pass@k (mean over tasks) with their standard errors across tasks."""
    rows = [r for r in task_table(res, k).values() if domain is None or r["domain"] == domain]
    p1, se1 = mean_se([r["pass@1"] for r in rows])
    pk, sek = mean_se([r["pass@k"] for r in rows])
    return {"n_tasks": len(rows), "pass@1": p1, "pass@1_se": se1, "pass@k": pk, "pass@k_se": sek}


def task_diffs(a: dict, b: dict, k: int, domain: Optional[str] = None) -> dict[str, list[float]]:
    """metric -> [b - a for every task both results share] (same tasks, same sampling seeds)."""
    ta, tb = task_table(a, k), task_table(b, k)
    ids = sorted(i for i in ta if i in tb and (domain is None or ta[i]["domain"] == domain))
    return {m: [tb[i][m] - ta[i][m] for i in ids] for m in ("pass@1", "pass@k")}


def task_diff_map(a: dict, b: dict, k: int, domain: Optional[str] = None, metric: str = "pass@1") -> dict[str, float]:
    """task id -> b - a of ``metric`` (``pass@1`` or ``pass@k``) for every task both results share."""
    ta, tb = task_table(a, k), task_table(b, k)
    return {i: tb[i][metric] - ta[i][metric] for i in sorted(ta) if i in tb and (domain is None or ta[i]["domain"] == domain)}


def paired(a: dict, b: dict, k: int, domain: Optional[str] = None) -> dict:
    """b - a per shared task: mean difference and its SE (sd of the per-task differences / sqrt(n))."""
    diffs = task_diffs(a, b, k, domain)
    out = {"n_tasks": len(diffs["pass@1"])}
    for m, xs in diffs.items():
        out[f"d_{m}"], out[f"d_{m}_se"] = mean_se(xs)
    return out


def fmt(x: Optional[float], se: Optional[float] = None, signed: bool = False) -> str:
    if x is None:
        return "-"
    s = f"{x:+.3f}" if signed else f"{x:.3f}"
    return s if se is None else f"{s} ± {se:.3f}"


def fdiff(d: dict, metric: str) -> str:
    """A paired difference from :func:`paired` as "+x.xxx ± se"."""
    return fmt(d[f"d_{metric}"], d[f"d_{metric}_se"], signed=True)


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_results(ctx: Ctx, name: str, results: dict, text: str) -> None:
    """results JSON + the Markdown table, both under WORK_DIR/NAME/."""
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results = {**results, "config": ctx.raw, "tiny": ctx.tiny, "date": date, "command": " ".join(["python", *sys.argv])}
    write_json_atomic(ctx.path(name, "results.json"), results)
    ctx.path(name, "results.md").write_text(text + "\n")
    click.echo(text)


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
