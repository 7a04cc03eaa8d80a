"""Specialist SFT: one LoRA specialist per domain, checkpoint chosen by Pass@K on a probe set, fused.

Algorithm (VibeThinker-1.5B, arXiv:2511.06221, section 3.2 "Spectrum phase"; DESIGN.md step 3).
For each domain d listed in the ``sft:`` section:

1. Fresh LoRA (or DoRA) layers are put on the base model (loaded once for all domains) with
   ``mlx_lm.tuner.utils.linear_to_lora_layers``, and trained on d's SFT data (the output of
   ``mlx_ssp select``, or any mlx-lm chat / completions / text JSONL) through
   ``mlx_lm.tuner.trainer.train``: its compiled step, loss, padding and batching.
2. Every ``save_every`` steps (and at the last step) the adapter is saved as a checkpoint
   (``adapters.safetensors`` + ``adapter_config.json``, so ``mlx_lm fuse`` / ``load_adapters`` work on
   it) and *probed*: K samples per probe prompt through the rollout engine
   (:func:`mlx_ssp.eval.evaluate`), scored by each task's verifier, giving Pass@K with the unbiased
   estimator (Chen et al. 2021) and Pass@1. The validation loss is recorded too when there is
   validation data.
3. The specialist is the checkpoint that maximises the selection rule: ``pass@k`` (the paper's
   "most valid solutions"), ``pass@1`` or ``val_loss`` (lowest), for comparison. Ties (equal to
   1e-9) are broken by the other probe metric (pass@1 for pass@k, pass@k for pass@1), then by the
   lower validation loss, then by the *earlier* step (less drift from the base model, which keeps
   more of its diversity).
4. The chosen adapter is fused with the LoRA layers' own ``fuse()`` (what ``mlx_lm fuse`` does) and
   saved with ``mlx_lm.utils.save`` into ``OUT/specialists/<d>/`` (HF layout, same dtype as the base).
   The base model is then restored in memory (the LoRA wrappers hold the untouched base layers) and
   the next domain starts without reloading anything.

Outputs per domain under ``OUT/<d>/``: ``checkpoints/NNNNNNN/`` (adapter, adapter_config.json,
state.json, probe.json; the latest also holds the optimizer state), ``metrics.jsonl`` (training loss
reports), ``probe_curve.jsonl`` (step, loss, val_loss, pass@1, pass@k, chosen) and ``probe_curve.png``,
``adapters.safetensors`` + ``adapter_config.json`` (the chosen checkpoint, ready for ``mlx_lm fuse``)
and ``result.json``; ``OUT/summary.json`` lists every domain's specialist.

Resume. A killed run continues from its last complete checkpoint and ends with the same adapter as
an uninterrupted run with the same seed: the checkpoint holds the adapter and the optimizer state
(Adam moments, step count, hence the learning-rate schedule position); the data order is
reproduced by replaying mlx-lm's batch iterator from the seed and skipping the batches already
trained on (its shuffling draws from NumPy's global RNG, which we confine to a private
``RandomState`` so that nothing else can shift it); and MLX's global RNG (LoRA dropout) is
re-seeded at every checkpoint from (seed, step), so it is a function of the step, not of history.
A checkpoint saved but not yet probed when the run died is probed on resume. Probing uses its own
per-sample PRNG keys and the same seed at every checkpoint (common random numbers: differences
between checkpoints are the model's, not the sampler's).

Deviations from mlx-lm's ``lora`` command, all deliberate:
- MLX's RNG is re-seeded at every checkpoint (above); mlx-lm seeds once. Without dropout this
  changes nothing.
- Validation loss is computed at checkpoints (not at ``steps_per_eval``), on the same fixed subset
  of ``val_batches`` batches each time, so checkpoints are compared on equal terms.
- ``mask_prompt`` defaults to true (train on the solutions, not on the problems).
- Data is tokenized and checked before training (every record, errors name file:line) instead of
  lazily, so a bad record cannot stop a run hours in.
Deviations from the paper: the paper does not give probe sizes, K, or the checkpoint interval;
they are configuration here (``probe.k``, ``probe.max_tasks``, ``save_every``).
"""

from __future__ import annotations

import json
import math
import shutil
import time
import types
import warnings
from dataclasses import dataclass, field
from math import gcd
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import click
from pydantic import Field, field_validator, model_validator

from mlx_ssp.cli import set_option
from mlx_ssp.config import StrictModel
from mlx_ssp import distributed as dist
from mlx_ssp.errors import UserError
from mlx_ssp.io import JsonlAppender, atomic_dir, read_jsonl, write_json_atomic, write_jsonl_atomic
from mlx_ssp.rollout import SamplingConfig

# ----------------------------------------------------------------------------------------------
# configuration


class LoRAConfig(StrictModel):
    """Which layers get adapters, and their shape (mlx-lm's ``lora_parameters``)."""

    fine_tune_type: Literal["lora", "dora"] = "lora"
    rank: int = Field(8, ge=1)
    scale: float = Field(20.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    #: transformer blocks, counted from the last; -1 = all
    num_layers: int = 16
    #: module names inside a block (e.g. ``self_attn.q_proj``); null = every linear layer of the block
    keys: Optional[list[str]] = None

    @field_validator("num_layers")
    @classmethod
    def _layers(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("must be -1 (all blocks) or a positive number of blocks")
        return v


class ScheduleConfig(StrictModel):
    """An ``mlx.optimizers.schedulers`` schedule (mlx-lm's ``lr_schedule``): ``arguments`` are the
    scheduler's positional arguments, the first being the peak learning rate."""

    name: Literal["cosine_decay", "linear_schedule", "exponential_decay", "step_decay"]
    arguments: list[float] = Field(min_length=1)
    warmup: int = Field(0, ge=0)
    warmup_init: float = 0.0


#: optimizer name -> class name in mlx.optimizers (a registry, not an if/elif chain)
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adafactor": "Adafactor"}
SELECT_RULES = ("pass@k", "pass@1", "val_loss")


class ProbeConfig(StrictModel):
    """How each checkpoint is probed."""

    k: int = Field(8, ge=1)
    #: samples per probe task (>= k; more samples = a less noisy pass@k); null = k
    n: Optional[int] = Field(None, ge=1)
    #: the first N probe tasks of the domain (in file order); null = all
    max_tasks: Optional[int] = Field(32, ge=1)
    batch_size: int = Field(64, ge=1)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    system: Optional[str] = None  # system prompt added to probe tasks that have none
    #: sampling seed, the same at every checkpoint; null = the SFT seed
    seed: Optional[int] = None
    progress: bool = True

    @model_validator(mode="after")
    def _n_ge_k(self) -> "ProbeConfig":
        if self.n is not None and self.n < self.k:
            raise ValueError(f"probe.n ({self.n}) must be >= probe.k ({self.k})")
        if max(self.n or self.k, self.k) > 1 and self.sampling.temperature == 0:
            raise ValueError("more than one sample per task at temperature 0 are all the same; raise the temperature")
        return self


class DomainSpec(StrictModel):
    """Where one domain's data lives. Every field is optional: ``data`` defaults to
    ``{data_dir}/{domain}`` (the ``mlx_ssp select`` layout), probe tasks to the run file's
    ``tasks:`` section (its probe split, this domain's tasks)."""

    #: a JSONL file, or a directory with train.jsonl (and valid.jsonl)
    data: Optional[str] = None
    #: validation JSONL (overrides valid.jsonl in the data directory)
    valid: Optional[str] = None
    #: a task JSONL used as the probe set (only this domain's tasks are used)
    probe_tasks: Optional[str] = None


class SFTConfig(StrictModel):
    """The ``sft:`` section."""

    #: required by the command; the pipeline fills it from the tasks section when empty
    domains: dict[str, DomainSpec] = Field(default_factory=dict)
    data_dir: Optional[str] = None  # default {run_dir}/select
    out_dir: Optional[str] = None  # default {run_dir}/sft
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    optimizer: Literal["adam", "adamw", "sgd", "adafactor"] = "adam"
    optimizer_config: dict[str, Any] = Field(default_factory=dict)
    learning_rate: float = Field(1e-5, gt=0)
    lr_schedule: Optional[ScheduleConfig] = None
    iters: int = Field(200, ge=1)
    batch_size: int = Field(4, ge=1)
    max_seq_length: int = Field(2048, ge=2)
    mask_prompt: bool = True
    grad_accumulation_steps: int = Field(1, ge=1)
    grad_checkpoint: bool = False
    report_every: int = Field(10, ge=1)
    save_every: int = Field(50, ge=1)
    #: validation batches per checkpoint; -1 = the whole validation set, 0 = no validation loss
    val_batches: int = Field(25, ge=-1)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    select: Literal["pass@k", "pass@1", "val_loss"] = "pass@k"
    seed: Optional[int] = None  # default: the run file's top-level seed, else 0
    dequantize: bool = False  # fuse a quantized base into a dequantized specialist
    overwrite: bool = False  # discard earlier checkpoints/specialists instead of resuming

    @field_validator("domains", mode="before")
    @classmethod
    def _domain_list(cls, v: Any) -> Any:
        # "domains: [math, code]" is shorthand for "domains: {math: {}, code: {}}"
        if isinstance(v, (list, tuple)):
            return {str(d): {} for d in v}
        if isinstance(v, dict):
            return {k: ({} if s is None else s) for k, s in v.items()}
        return v

    @model_validator(mode="after")
    def _probe_fits(self) -> "SFTConfig":
        if self.select == "val_loss" and self.val_batches == 0:
            raise ValueError("select=val_loss needs validation loss; set val_batches to -1 or > 0")
        return self


# ----------------------------------------------------------------------------------------------
# pure functions: selection, seeds


def _neg(x: Optional[float]) -> float:
    return -x if x is not None and not math.isnan(x) else math.inf


def _pos(x: Optional[float]) -> float:
    return x if x is not None and not math.isnan(x) else math.inf


def select_checkpoint(rows: list[dict], rule: str) -> int:
    """Index of the chosen checkpoint among ``rows`` (dicts with step, pass@1, pass@k, val_loss).

    Rules: ``pass@k`` (highest), ``pass@1`` (highest), ``val_loss`` (lowest). Ties (within 1e-9)
    go to the other probe metric, then the lower validation loss, then the earlier step. A missing
    metric ranks last."""
    if rule not in SELECT_RULES:
        raise UserError(f"unknown selection rule '{rule}'; valid: {', '.join(SELECT_RULES)}")
    if not rows:
        raise ValueError("no checkpoints to choose from")
    # rank by a tuple of keys compared with a tolerance, in order
    keys: dict[str, list[Callable[[dict], float]]] = {
        "pass@k": [lambda r: _neg(r.get("pass@k")), lambda r: _neg(r.get("pass@1")), lambda r: _pos(r.get("val_loss"))],
        "pass@1": [lambda r: _neg(r.get("pass@1")), lambda r: _neg(r.get("pass@k")), lambda r: _pos(r.get("val_loss"))],
        "val_loss": [lambda r: _pos(r.get("val_loss"))],
    }
    best = 0
    for i in range(1, len(rows)):
        for key in keys[rule]:
            a, b = key(rows[i]), key(rows[best])
            if math.isinf(a) and math.isinf(b) or abs(a - b) <= 1e-9:
                continue
            if a < b:
                best = i
            break
        else:  # a full tie: the earlier step wins
            if rows[i]["step"] < rows[best]["step"]:
                best = i
    return best


def step_seed(seed: int, step: int) -> int:
    """The MLX RNG seed used after checkpoint ``step``: a fixed function of (seed, step)."""
    return (int(seed) * 1_000_003 + int(step) * 7_919 + 17) % (1 << 62)


def probe_seed(cfg: SFTConfig, seed: int) -> int:
    return cfg.probe.seed if cfg.probe.seed is not None else seed


# ----------------------------------------------------------------------------------------------
# data: read, check and tokenize before training


@dataclass
class DomainPlan:
    """Everything one domain needs, checked before any training starts."""

    name: str
    train_path: Path
    valid_path: Optional[Path]
    train_set: Any  # mlx_lm CacheDataset, fully tokenized
    valid_set: Any
    probe_tasks: list
    probe_source: str
    stats: dict = field(default_factory=dict)


def _read_records(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) for each non-blank line; bad JSON is an error naming file:line."""
    from mlx_ssp.io import iter_jsonl_numbered

    out = list(iter_jsonl_numbered(path, what="SFT data"))
    if not out:
        raise UserError(f"{path}: the SFT data file is empty")
    return out


def _record_kind(rec: dict) -> Optional[str]:
    # the same precedence as mlx_lm.tuner.datasets.create_dataset
    if "prompt" in rec and "completion" in rec:
        return "completions"
    if "messages" in rec:
        return "chat"
    if "text" in rec:
        return "text"
    return None


def _check_record(path: Path, lineno: int, rec: dict, kind: str, mask_prompt: bool) -> None:
    where = f"{path}:{lineno}"
    got = _record_kind(rec)
    if got is None:
        raise UserError(
            f"{where}: unknown record format (keys: {', '.join(sorted(rec)) or 'none'}); expected "
            "{'messages': [...]}, {'prompt': ..., 'completion': ...} or {'text': ...}"
        )
    if got != kind:
        raise UserError(f"{where}: a '{got}' record in a '{kind}' file (the first record sets the format)")
    if kind == "chat":
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError(f"{where}: message {i} needs 'role' and 'content'")
        if mask_prompt and msgs[-1].get("role") != "assistant":
            raise UserError(f"{where}: with mask_prompt the last message must be the assistant's (nothing to train on)")
    elif kind == "completions":
        for key in ("prompt", "completion"):
            if not isinstance(rec[key], str):
                raise UserError(f"{where}: '{key}' must be a string")
        if not rec["completion"].strip():
            raise UserError(f"{where}: 'completion' is empty")
    else:
        if mask_prompt:
            raise UserError(f"{where}: text records have no prompt to mask; set sft.mask_prompt=false")
        if not isinstance(rec["text"], str) or not rec["text"].strip():
            raise UserError(f"{where}: 'text' must be a non-empty string")


def load_sft_file(path: Path, tokenizer, *, mask_prompt: bool, max_seq_length: int):
    """Read, check and tokenize an SFT JSONL file into mlx-lm's dataset classes.

    Returns ``(CacheDataset, stats)``. Every record is tokenized now; a record that cannot be
    tokenized or has no answer token is an error naming file and line. A record whose prompt alone
    fills ``max_seq_length`` (nothing left to train on after mlx-lm's truncation) is dropped with a
    warning that counts them."""
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset

    recs = _read_records(path)
    kind = _record_kind(recs[0][1]) or "chat"
    for lineno, rec in recs:
        _check_record(path, lineno, rec, kind, mask_prompt)
    data = [r for _, r in recs]
    conf = types.SimpleNamespace(mask_prompt=mask_prompt)
    ds = CacheDataset(create_dataset(data, tokenizer, conf))
    n_tokens = n_trunc = 0
    keep, dropped = [], []
    for i, (lineno, _) in enumerate(recs):
        try:
            tokens, offset = ds[i]
        except Exception as e:  # tokenizer / chat template failures are the record's fault
            raise UserError(f"{path}:{lineno}: could not tokenize ({type(e).__name__}: {e})") from None
        # the loss covers target positions offset..usable-1 (mlx-lm's default_loss); need one
        if len(tokens) - max(offset, 1) < 1:
            raise UserError(f"{path}:{lineno}: nothing to train on (no answer tokens; {len(tokens)} tokens)")
        if min(len(tokens), max_seq_length) - max(offset, 1) < 1:
            dropped.append(lineno)  # the prompt alone fills max_seq_length
            continue
        keep.append(i)
        n_tokens += len(tokens)
        n_trunc += len(tokens) > max_seq_length
    if not keep:
        raise UserError(f"{path}: every record's prompt fills max_seq_length={max_seq_length}; raise it")
    if dropped:
        warnings.warn(
            f"{path}: {len(dropped)} record(s) dropped, their prompt fills max_seq_length={max_seq_length} "
            f"(first at line {dropped[0]}); raise sft.max_seq_length to keep them",
            stacklevel=2,
        )
        ds = CacheDataset(create_dataset([data[i] for i in keep], tokenizer, conf))
    return ds, {"records": len(keep), "dropped": len(dropped), "tokens": n_tokens, "truncated": n_trunc, "format": kind}


def _resolve_data(domain: str, spec: DomainSpec, data_dir: Path) -> tuple[Path, Optional[Path]]:
    from mlx_ssp.select import safe_dirname  # the directory name `mlx_ssp select` writes

    p = Path(spec.data) if spec.data else data_dir / safe_dirname(domain)
    if p.is_dir():
        train = p / "train.jsonl"
        if not train.is_file():
            raise UserError(f"domain '{domain}': {p} has no train.jsonl")
        valid = p / "valid.jsonl"
        valid_path = valid if valid.is_file() else None
    elif p.is_file():
        train, valid_path = p, None
    else:
        hint = "" if spec.data else f" (set sft.domains.{domain}.data, or sft.data_dir)"
        raise UserError(f"domain '{domain}': SFT data not found at {p}{hint}")
    if spec.valid:
        valid_path = Path(spec.valid)
        if not valid_path.is_file():
            raise UserError(f"domain '{domain}': validation file not found: {valid_path}")
    return train, valid_path


def _probe_tasks(domain: str, spec: DomainSpec, cfg: SFTConfig, run_data: dict, source: str) -> tuple[list, str]:
    from mlx_ssp.tasks import check_tasks, load_tasks

    if spec.probe_tasks:
        tasks = load_tasks(spec.probe_tasks)
        where = spec.probe_tasks
    elif run_data.get("tasks") is not None:
        from mlx_ssp.config import load_section
        from mlx_ssp.tasks import build_split  # type: ignore[attr-defined]

        tcfg = load_section(run_data, "tasks", source=source)
        tasks = build_split(tcfg, "probe")
        check_tasks(tasks, source=f"{source}: tasks (probe split)")
        where = f"{source or 'run file'}: tasks section, probe split"
    else:
        raise UserError(
            f"domain '{domain}': no probe tasks; set sft.domains.{domain}.probe_tasks to a task JSONL "
            "or add a tasks: section to the run file"
        )
    mine = [t for t in tasks if t.domain == domain]
    if not mine:
        found = sorted({t.domain for t in tasks})
        raise UserError(f"{where}: no probe tasks for domain '{domain}' (domains there: {', '.join(found) or 'none'})")
    if cfg.probe.max_tasks is not None:
        mine = mine[: cfg.probe.max_tasks]
    return mine, where


def check_lora_targets(model, lora: LoRAConfig) -> list[str]:
    """The names LoRA will wrap; layers the model does not have are an error listing valid ones."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    n = len(model.layers)
    if lora.num_layers > n:
        raise UserError(f"sft.lora.num_layers={lora.num_layers} but the model has only {n} blocks (use -1 for all)")
    kinds = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear, nn.Embedding, nn.QuantizedEmbedding)
    blocks = model.layers if lora.num_layers == -1 else model.layers[-lora.num_layers :]
    available: set[str] = set()
    for b in blocks:
        for name, m in b.named_modules():
            if name and (hasattr(m, "to_lora") or isinstance(m, kinds)):
                available.add(name)
    if lora.keys is None:
        return sorted(available)
    top = {name for name, m in model.named_modules() if name and isinstance(m, kinds)}
    missing = [k for k in lora.keys if k not in available and k not in top]
    if missing:
        raise UserError(
            f"sft.lora.keys: the model has no layer {', '.join(repr(k) for k in missing)}; "
            f"valid: {', '.join(sorted(available))}"
        )
    return list(lora.keys)


def plan_domains(cfg: SFTConfig, model, tokenizer, run_data: dict, run_dir: Path, source: str = "") -> list[DomainPlan]:
    """Check every domain's data, probe set and LoRA targets before any training."""
    check_lora_targets(model, cfg.lora)
    data_dir = Path(cfg.data_dir) if cfg.data_dir else run_dir / "select"
    plans = []
    for name, spec in cfg.domains.items():
        train_path, valid_path = _resolve_data(name, spec, data_dir)
        kw = dict(mask_prompt=cfg.mask_prompt, max_seq_length=cfg.max_seq_length)
        train_set, stats = load_sft_file(train_path, tokenizer, **kw)
        if len(train_set) < cfg.batch_size:
            raise UserError(f"{train_path}: {len(train_set)} records, fewer than batch_size={cfg.batch_size}")
        valid_set = None
        if valid_path is not None and cfg.val_batches != 0:
            valid_set, vstats = load_sft_file(valid_path, tokenizer, **kw)
            if len(valid_set) < cfg.batch_size:
                raise UserError(f"{valid_path}: {len(valid_set)} records, fewer than batch_size={cfg.batch_size}")
            stats["valid_records"] = vstats["records"]
        if cfg.select == "val_loss" and valid_set is None:
            raise UserError(f"domain '{name}': select=val_loss needs validation data (valid.jsonl or domains.{name}.valid)")
        tasks, where = _probe_tasks(name, spec, cfg, run_data, source)
        plans.append(DomainPlan(name, train_path, valid_path, train_set, valid_set, tasks, where, stats))
    return plans


# ----------------------------------------------------------------------------------------------
# training pieces reused from mlx-lm


def make_iterate_batches(seed: int, skip: int = 0):
    """mlx-lm's ``iterate_batches`` with its NumPy shuffling confined to a private, seeded
    ``RandomState`` (training and validation get separate streams), and the first ``skip``
    training batches dropped (resume: they were already trained on). The training stream starts
    from ``seed`` exactly as ``mlx_lm lora`` seeds NumPy, so the batch order is the same as its."""
    import numpy as np
    from mlx_lm.tuner.trainer import iterate_batches

    def wrapped(dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None):
        own = np.random.RandomState(seed_for(loop)).get_state()
        inner = iterate_batches(dataset, batch_size, max_seq_length, loop=loop, comm_group=comm_group)
        n = 0
        while True:
            outer = np.random.get_state()
            np.random.set_state(own)
            try:
                batch = next(inner)
            except StopIteration:
                return
            finally:
                own = np.random.get_state()
                np.random.set_state(outer)
            n += 1
            if loop and n <= skip:
                continue
            yield batch

    def seed_for(loop: bool) -> int:
        # training: the seed itself, so the batch order equals `mlx_lm lora --seed SEED`'s
        return (seed + (0 if loop else 1)) % (1 << 32)

    return wrapped


def build_optimizer(cfg: SFTConfig):
    import mlx.optimizers as optim
    from mlx_lm.tuner.utils import build_schedule

    lr = build_schedule(cfg.lr_schedule.model_dump()) if cfg.lr_schedule else cfg.learning_rate
    cls = getattr(optim, OPTIMIZERS[cfg.optimizer])
    try:
        return cls(learning_rate=lr, **cfg.optimizer_config)
    except TypeError as e:
        raise UserError(f"sft.optimizer_config: {e}") from None


def adapter_config(cfg: SFTConfig, model_path: Path) -> dict:
    """The adapter_config.json mlx-lm's ``load_adapters`` / ``fuse`` read (plus provenance)."""
    return {
        "fine_tune_type": cfg.lora.fine_tune_type,
        "num_layers": cfg.lora.num_layers,
        "lora_parameters": {
            "rank": cfg.lora.rank,
            "scale": cfg.lora.scale,
            "dropout": cfg.lora.dropout,
            **({"keys": cfg.lora.keys} if cfg.lora.keys is not None else {}),
        },
        "model": str(model_path),
        "mask_prompt": cfg.mask_prompt,
        "max_seq_length": cfg.max_seq_length,
        "learning_rate": cfg.learning_rate,
        "iters": cfg.iters,
        "batch_size": cfg.batch_size,
    }


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


def _ckpt_dirs(ddir: Path) -> list[Path]:
    root = ddir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.isdigit() and (p / "state.json").is_file())


def read_curve(ddir: Path) -> list[dict]:
    """One row per complete checkpoint: step, loss, val_loss, learning_rate, pass@1, pass@k (None if
    not probed yet)."""
    rows = []
    for p in _ckpt_dirs(ddir):
        st = json.loads((p / "state.json").read_text())
        pr = json.loads((p / "probe.json").read_text()) if (p / "probe.json").is_file() else {}
        rows.append(
            {
                "step": st["step"],
                "loss": st.get("train_loss"),
                "val_loss": st.get("val_loss"),
                "learning_rate": st.get("learning_rate"),
                "pass@1": pr.get("pass@1"),
                "pass@k": pr.get("pass@k"),
                "k": pr.get("k"),
                "n_tasks": pr.get("n_tasks"),
            }
        )
    return rows


def write_curve(ddir: Path, domain: str, rule: str) -> Optional[dict]:
    """Write probe_curve.jsonl (+ PNG) from the checkpoints; ``chosen`` marks the current choice."""
    from mlx_ssp.plots import line_chart

    rows = read_curve(ddir)
    if not rows:
        return None
    probed = [r for r in rows if r["pass@k"] is not None]
    chosen = None
    if probed:
        chosen = probed[select_checkpoint(probed, rule)]
    for r in rows:
        r["chosen"] = chosen is not None and r["step"] == chosen["step"]
    write_jsonl_atomic(ddir / "probe_curve.jsonl", rows)
    k = next((r["k"] for r in rows if r["k"]), "k")
    line_chart(
        ddir / "probe_curve.png",
        [r["step"] for r in rows],
        {"pass@1": [r["pass@1"] for r in rows], f"pass@{k}": [r["pass@k"] for r in rows]},
        secondary={"train loss": [r["loss"] for r in rows], "val loss": [r["val_loss"] for r in rows]},
        secondary_label="loss",
        title=f"SFT specialist '{domain}': probe curve (rule {rule})",
        xlabel="step",
        ylabel="probe pass rate",
        ylim=(-0.02, 1.02),
        vline=chosen["step"] if chosen else None,
        vline_label=f"chosen (step {chosen['step']})" if chosen else "",
    )
    return chosen


# ----------------------------------------------------------------------------------------------
# probing

ProbeFn = Callable[..., dict]


def default_probe(model, tokenizer, tasks: list, probe: ProbeConfig, seed: int) -> dict:
    """K samples per probe task through the rollout engine; Pass@K (unbiased) and Pass@1."""
    from mlx_ssp.eval import evaluate

    res = evaluate(
        model, tokenizer, tasks, k=probe.k, n=probe.n, sampling=probe.sampling, seed=seed,
        batch_size=probe.batch_size, progress=probe.progress, system=probe.system,
    )
    overall = res["overall"]
    if not overall.get("n_tasks"):
        raise UserError(f"no probe task could be sampled (all {len(tasks)} skipped: prompts longer than the context)")
    return {
        "pass@1": float(overall["pass@1"]),
        "pass@k": float(overall[f"pass@{probe.k}"]),
        "n_probed": overall["n_tasks"],
        "mean_tokens": overall.get("mean_tokens"),
        "truncated_frac": overall.get("truncated_frac"),
    }


# ----------------------------------------------------------------------------------------------
# one domain


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
            self.model, self.plan.valid_set, batch_size=self.cfg.batch_size, num_batches=self.cfg.val_batches,
            max_seq_length=self.cfg.max_seq_length, iterate_batches=make_iterate_batches(self.seed),
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
        if dist.is_main():  # rank 0 writes; val loss and the probe run on every rank (data parallel)
            with atomic_dir(root / f"{step:07d}", overwrite=True) as tmp:
                mx.save_safetensors(str(tmp / "adapters.safetensors"), weights)
                write_json_atomic(tmp / "adapter_config.json", adapter_config(self.cfg, self.model_path))
                mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt_state)
                state = {"step": step, "train_loss": train_loss, "val_loss": val,
                         "learning_rate": float(self.optimizer.learning_rate.item()), "time": time.time()}
                write_json_atomic(tmp / "state.json", state)
        # only the newest checkpoint is a resume point: drop older optimizer states (they are the
        # bulk of a checkpoint with Adam)
        for p in _ckpt_dirs(self.ddir) if dist.is_main() else ():
            if p.name != f"{step:07d}":
                (p / "optimizer.safetensors").unlink(missing_ok=True)
        self.probe(root / f"{step:07d}")
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
        step = int(ckpt.name)
        click.echo(
            f"[sft {self.plan.name}] step {step}: pass@1 {rec['pass@1']:.3f}  pass@{rec['k']} {rec['pass@k']:.3f}"
            f"  (best so far: step {chosen['step'] if chosen else '-'}; probe {dt:.1f}s)",
            err=True,
        )

    def load_adapter(self, ckpt: Path) -> None:
        import mlx.core as mx

        self.model.load_weights(list(mx.load(str(ckpt / "adapters.safetensors")).items()), strict=False)

    # -- the whole domain -----------------------------------------------------------------
    def train(self, callbacks: list) -> dict:
        import mlx.core as mx
        from mlx.utils import tree_flatten, tree_map_with_path
        from mlx_lm.tuner.trainer import TrainingArgs, train

        cfg = self.cfg
        ckpts = _ckpt_dirs(self.ddir)
        dist.check_same([p.name for p in ckpts], what=f"the checkpoints in {self.ddir} (it must be on a disk all hosts share)")
        # a checkpoint saved but not probed before a crash is probed now
        for p in ckpts:
            if not (p / "probe.json").is_file():
                self.load_adapter(p)
                self.probe(p)
        start = 0
        if ckpts:
            last = ckpts[-1]
            start = int(last.name)
            self.load_adapter(last)
        self.optimizer = build_optimizer(cfg)
        if start and start < cfg.iters:
            opt_file = ckpts[-1] / "optimizer.safetensors"
            if not opt_file.is_file():
                raise UserError(f"{ckpts[-1]}: the optimizer state is missing, cannot resume (pass --overwrite)")
            saved = mx.load(str(opt_file))
            self.optimizer.init(self.model.trainable_parameters())
            names = dict(tree_flatten(self.optimizer.state))
            if set(names) != set(saved):
                raise UserError(f"{opt_file}: the optimizer state does not match this model/config (pass --overwrite)")
            self.optimizer.state = tree_map_with_path(lambda path, _: saved[path], self.optimizer.state)
            click.echo(f"[sft {self.plan.name}] resuming from step {start}", err=True)
        # drop loss reports newer than the resume point (they are re-done)
        mpath = self.ddir / "metrics.jsonl"
        if mpath.exists() and dist.is_main():
            write_jsonl_atomic(mpath, [r for r in read_jsonl(mpath) if r.get("step", 0) <= start])
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
                with dist.watch(f"sft {self.plan.name} training"):  # mlx-lm's all_sums: stop, not hang, on a lost rank
                    train(
                        model=self.model, optimizer=self.optimizer, train_dataset=self.plan.train_set, val_dataset=None,
                        args=args, iterate_batches=make_iterate_batches(self.seed, skip=start), training_callback=hook,
                    )
                train_wall = time.perf_counter() - tic
                # mlx-lm's trainer saves its final weights here; the last checkpoint already has them
                (self.ddir / "adapters_last.safetensors").unlink(missing_ok=True)
        finally:
            self.metrics.close()
        overhead = hook.hook_time if hook else 0.0
        return {"train_seconds": train_wall - overhead, "probe_seconds": self.probe_time, "val_seconds": self.val_time,
                "checkpoint_seconds": max(0.0, overhead - self.probe_time - self.val_time)}


def _lora_modules(model) -> list[tuple[str, Any]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "fuse")]


def _base_of(m):
    base = getattr(m, "linear", None)
    return base if base is not None else getattr(m, "embedding")


def restore_base(model) -> None:
    """Swap every LoRA/DoRA wrapper back for the base layer it wraps (untouched by training)."""
    from mlx.utils import tree_unflatten

    mods = [(n, _base_of(m)) for n, m in _lora_modules(model)]
    if mods:
        model.update_modules(tree_unflatten(mods))


def fuse_and_save(model, tokenizer, model_path: Path, out: Path, *, dequantize: bool, overwrite: bool) -> None:
    """Fuse the current adapters into the weights (mlx-lm's LoRA ``fuse``) and save an HF-layout
    model at ``out``; the in-memory model gets its LoRA wrappers back afterwards."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import dequantize_model, load_config, save

    wrappers = _lora_modules(model)
    fused = [(n, m.fuse(dequantize=dequantize)) for n, m in wrappers]
    config = load_config(model_path)
    model.update_modules(tree_unflatten(fused))
    try:
        to_save = model
        if dequantize:
            to_save = dequantize_model(model)
            config.pop("quantization", None)
            config.pop("quantization_config", None)
        with atomic_dir(out, overwrite=overwrite) as tmp:
            save(tmp, model_path, to_save, tokenizer, config, donate_model=False)
    finally:
        model.update_modules(tree_unflatten(wrappers))


# ----------------------------------------------------------------------------------------------
# the stage


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
) -> dict:
    """Train, probe, choose and fuse one domain's specialist on the (shared) base ``model``.
    The model is the base model again when this returns (also on error)."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mlx_ssp.select import safe_dirname

    ddir = out_dir / safe_dirname(plan.name)
    spec_dir = out_dir / "specialists" / safe_dirname(plan.name)
    fp = fingerprint(cfg, seed, model_path, plan)
    if cfg.overwrite and dist.is_main():
        shutil.rmtree(ddir, ignore_errors=True)
        shutil.rmtree(spec_dir, ignore_errors=True)
    dist.barrier("sft: clear the domain directory")
    fp_path = ddir / "sft_config.json"
    if fp_path.is_file():
        old = json.loads(fp_path.read_text())
        changed = sorted(k for k in set(old) | set(fp) if old.get(k) != fp.get(k))
        if changed:
            raise UserError(
                f"{ddir} holds a run with different settings ({', '.join(changed)}); "
                "pass --overwrite (or sft.overwrite=true) to start this domain again"
            )
    result_path = ddir / "result.json"
    if result_path.is_file() and spec_dir.is_dir():
        done = json.loads(result_path.read_text())
        if done.get("rule") == cfg.select:
            click.echo(f"[sft {plan.name}] already done (step {done['chosen_step']}), skipping", err=True)
            return done
    if dist.is_main():
        ddir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(fp_path, fp)
        write_json_atomic(ddir / "adapter_config.json", adapter_config(cfg, model_path))

    model.freeze()
    mx.random.seed(seed)  # LoRA A init (replaced by the checkpoint on resume)
    lora = cfg.lora.model_dump(include={"rank", "scale", "dropout", "keys"})
    if lora["keys"] is None:
        lora.pop("keys")
    linear_to_lora_layers(model, cfg.lora.num_layers, lora, use_dora=cfg.lora.fine_tune_type == "dora")
    try:
        run = _DomainRun(cfg, plan, model, tokenizer, model_path, ddir, seed, probe_fn)
        times = run.train(callbacks or [])
        chosen = dist.run_on_main(lambda: write_curve(ddir, plan.name, cfg.select), what="sft: choose the checkpoint")
        if chosen is None:  # pragma: no cover - every run ends with a probed checkpoint
            raise UserError(f"{ddir}: no probed checkpoint to choose from")
        ckpt = ddir / "checkpoints" / f"{chosen['step']:07d}"
        # rank 0 fuses and saves while the others wait (an error there stops them all)
        with dist.main_first(f"sft {plan.name}: fuse the specialist") as do_it:
            if do_it:
                run.load_adapter(ckpt)
                # the chosen adapter beside adapter_config.json: `mlx_lm fuse --adapter-path DDIR` works
                shutil.copyfile(ckpt / "adapters.safetensors", ddir / "adapters.safetensors")
                fuse_and_save(model, tokenizer, model_path, spec_dir, dequantize=cfg.dequantize, overwrite=True)
        total = times["train_seconds"] + times["probe_seconds"]
        result = {
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
            "total_seconds": total,
        }
        if not dist.is_main():
            return result
        write_json_atomic(result_path, result)
        click.echo(f"[sft {plan.name}] chose step {chosen['step']} by {cfg.select}; specialist at {spec_dir}", err=True)
        return result
    finally:
        restore_base(model)


def run_sft(
    cfg: SFTConfig,
    model_cfg,
    *,
    run_dir: str | Path = "run",
    run_data: dict | None = None,
    seed: int = 0,
    source: str = "",
    only: list[str] | None = None,
    probe_fn: ProbeFn = default_probe,
    callbacks: list | None = None,
    model_and_tokenizer: tuple | None = None,
) -> dict:
    """Train every domain's specialist, one after another, on one loaded base model.
    All inputs are checked first. Returns the summary written to ``OUT/summary.json``."""
    from mlx_ssp.models import load_model

    if not cfg.domains:
        raise UserError(f"{source or 'sft'}: sft.domains is empty; list the domains to train (e.g. domains: [math])")
    if cfg.batch_size % dist.size():
        raise UserError(f"sft.batch_size={cfg.batch_size} must be divisible by the number of ranks ({dist.size()})")
    run_dir = Path(run_dir)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else run_dir / "sft"
    seed = cfg.seed if cfg.seed is not None else seed
    if only:
        unknown = [d for d in only if d not in cfg.domains]
        if unknown:
            raise UserError(f"--domain {', '.join(unknown)}: not in sft.domains ({', '.join(cfg.domains)})")
        cfg = cfg.model_copy(update={"domains": {d: cfg.domains[d] for d in only}})
    if model_and_tokenizer is not None:
        model, tokenizer, model_path = model_and_tokenizer
    else:
        model, tokenizer, model_path = load_model(model_cfg)
    plans = plan_domains(cfg, model, tokenizer, run_data or {}, run_dir, source)
    results = {}
    for plan in plans:
        results[plan.name] = train_specialist(
            cfg, plan, model, tokenizer, Path(model_path), out_dir, seed=seed, probe_fn=probe_fn, callbacks=callbacks
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


def _load_config(config_path: str, overrides, overwrite: bool):
    from mlx_ssp.config import load_file, load_section

    data = load_file(config_path, overrides)
    if overwrite:
        if data.get("sft") is None:
            data["sft"] = {}
        if isinstance(data["sft"], dict):
            data["sft"]["overwrite"] = True
    cfg = load_section(data, "sft", source=str(config_path), cls=SFTConfig)
    model_cfg = load_section(data, "model", source=str(config_path))
    dist.configure(load_section(data, "distributed", source=str(config_path)))  # under mlx.launch (issue 10)
    from mlx_ssp.sandbox_policy import install_from_config

    install_from_config(data, str(config_path))  # the probes may verify code tasks
    return data, cfg, model_cfg


@click.command("sft")
@click.argument("config_path", metavar="CONFIG.yaml", type=click.Path(dir_okay=False))
@set_option
@click.option("--domain", "domains", multiple=True, help="Train only this domain (repeatable).")
@click.option("--overwrite", is_flag=True, help="Discard earlier checkpoints and specialists instead of resuming.")
def cli(config_path: str, overrides: tuple[str, ...], domains: tuple[str, ...], overwrite: bool) -> None:
    """Train one LoRA specialist per domain (sft: section), keep the checkpoint with the best
    probe Pass@K, fuse it into OUT/specialists/<domain>/. Re-running resumes."""
    data, cfg, model_cfg = _load_config(config_path, overrides, overwrite)
    summary = run_sft(
        cfg, model_cfg, run_dir=data.get("run_dir", "run"), run_data=data, seed=int(data.get("seed", 0) or 0),
        source=str(config_path), only=list(domains) or None,
    )
    if not dist.is_main():  # rank 0 reports for all ranks
        return
    for name, d in summary["domains"].items():
        click.echo(f"{name}: step {d['chosen_step']} ({d['rule']}: pass@1 {d['pass@1']}, pass@k {d['pass@k']}) -> {d['specialist']}")
