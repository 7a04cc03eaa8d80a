"""SFT data: every record read, checked and tokenized before training (errors name file:line), and
each domain's plan (data files, probe tasks, LoRA targets) checked before any domain trains."""

from __future__ import annotations

import itertools
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mlx_ssp import distributed as dist
from mlx_ssp.config import load_section
from mlx_ssp.errors import UserError
from mlx_ssp.finetune.lora import check_lora_targets
from mlx_ssp.io import iter_jsonl_numbered
from mlx_ssp.select import safe_dirname
from mlx_ssp.sft.config import DomainSpec, SFTConfig
from mlx_ssp.sft.episodes import is_token_record, load_token_records
from mlx_ssp.tasks import check_tasks, load_tasks
from mlx_ssp.tasks.build import build_split


@dataclass
class DomainPlan:
    """Everything one domain needs, checked before any training starts."""

    name: str
    train_path: Path
    valid_path: Optional[Path]
    train_set: Any  # mlx_lm CacheDataset, fully tokenized; a TokenDataset for token records
    valid_set: Any
    probe_tasks: list
    probe_source: str
    stats: dict = field(default_factory=dict)


def _read_records(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) for each non-blank line; bad JSON is an error naming file:line."""
    out = list(iter_jsonl_numbered(path, what="SFT data"))
    if not out:
        raise UserError(f"{path}: the SFT data file is empty")
    return out


def _record_kind(rec: dict) -> Optional[str]:
    # token records first (episode records also carry 'messages', for humans); then the same
    # precedence as mlx_lm.tuner.datasets.create_dataset
    if is_token_record(rec):
        return "tokens"
    if "prompt" in rec and "completion" in rec:
        # TRL's conversational prompt-completion (lists of messages) trains as the chat it joins into
        return "chat" if isinstance(rec["prompt"], list) else "completions"
    if "messages" in rec:
        return "chat"
    if "text" in rec:
        return "text"
    return None


def _conversation(rec: dict, where: str) -> list:
    """The messages of a TRL conversational prompt-completion record: the prompt's, then the one
    assistant message of the completion (mlx-lm's chat masking trains on the last message only)."""
    p, c = rec["prompt"], rec["completion"]
    if not p:  # a list: that is what made the record conversational
        raise UserError(f"{where}: a conversational 'prompt' must be a non-empty list of messages")
    if not (isinstance(c, list) and len(c) == 1 and isinstance(c[0], dict) and c[0].get("role") == "assistant"):
        raise UserError(f"{where}: a conversational 'completion' must be a list of one assistant message")
    _check_messages(p, "prompt", where)
    _check_messages(c, "completion", where)
    return list(p) + c


def _check_messages(msgs: list, key: str, where: str) -> None:
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"{where}: '{key}' message {i} needs 'role' and 'content'")


def _as_mlx_lm(rec: dict, where: str) -> dict:
    """A record as mlx-lm's create_dataset reads it (a conversational prompt-completion as a chat)."""
    if "messages" in rec or not isinstance(rec.get("prompt"), list):
        return rec
    out = {"messages": _conversation(rec, where)}
    if rec.get("tools") is not None:
        out["tools"] = rec["tools"]
    return out


def _check_record(path: Path, lineno: int, rec: dict, kind: str, mask_prompt: bool) -> None:
    where = f"{path}:{lineno}"
    got = _record_kind(rec)
    if got is None:
        raise UserError(
            f"{where}: unknown record format (keys: {', '.join(sorted(rec)) or 'none'}); expected "
            "{'messages': [...]}, {'prompt': ..., 'completion': ...}, {'text': ...} or {'token_ids': [...], 'mask': [...]}"
        )
    if got != kind:
        raise UserError(f"{where}: a '{got}' record in a '{kind}' file (the first record sets the format)")
    if kind == "tokens":
        return  # checked with the tokenizer's vocabulary in load_token_records
    if kind == "chat":
        if "messages" in rec:
            msgs = rec["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise UserError(f"{where}: 'messages' must be a non-empty list")
            _check_messages(msgs, "messages", where)
        else:  # a conversational prompt-completion: its errors name its own keys
            msgs = _conversation(rec, where)
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

    Returns ``(CacheDataset, stats)``; for token records (``token_ids`` + ``mask``, whole episodes)
    a :class:`~mlx_ssp.sft.episodes.TokenDataset` instead (:func:`load_token_records`). Every record is tokenized now; a record that cannot be
    tokenized or has no answer token is an error naming file and line. A record whose prompt alone
    fills ``max_seq_length`` (nothing left to train on after mlx-lm's truncation) is dropped with a
    warning that counts them."""
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset

    recs = _read_records(path)
    kind = _record_kind(recs[0][1]) or "chat"
    for lineno, rec in recs:
        _check_record(path, lineno, rec, kind, mask_prompt)
    if kind == "tokens":  # their own mask says what is trained on; mask_prompt does not apply
        return load_token_records(path, recs, tokenizer, max_seq_length=max_seq_length)
    data = [_as_mlx_lm(r, f"{path}:{lineno}") for lineno, r in recs]
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
    if spec.probe_tasks:
        tasks = load_tasks(spec.probe_tasks)
        where = spec.probe_tasks
    elif run_data.get("tasks") is not None:
        tcfg = load_section(run_data, "tasks", source=source)
        tasks = build_split(tcfg, "probe")
        check_tasks(tasks, source=f"{source}: tasks (probe split)")
        where = f"{source or 'run file'}: tasks section, probe split"
    else:
        raise UserError(
            f"domain '{domain}': no probe tasks; set sft.domains.{domain}.probe_tasks to a task JSONL "
            "or add a tasks: section to the run file"
        )
    wanted = set(spec.probe_domains or [domain])
    mine = [t for t in tasks if t.domain in wanted]
    if not mine:
        found = sorted({t.domain for t in tasks})
        raise UserError(f"{where}: no probe tasks for domain '{domain}' (domains there: {', '.join(found) or 'none'})")
    if len(wanted) > 1:  # a blend: round-robin over its domains, so max_tasks keeps all of them
        by_dom = [[t for t in mine if t.domain == d] for d in sorted(wanted)]
        mine = [t for group in itertools.zip_longest(*by_dom) for t in group if t is not None]
    if cfg.probe.max_tasks is not None:
        mine = mine[: cfg.probe.max_tasks]
    return mine, where


def val_batch_size(batch_size: int, n_valid: int, world: int = 1) -> int:
    """The batch size of validation: the training batch size, or for a smaller validation set the
    largest multiple of the number of ranks that fits it (0 if none does). The validation loss is a
    token-weighted mean over batches, so the batch size decides only which remainder is left out;
    a small split (a selection's few held-out records) still gives a loss."""
    b = min(batch_size, n_valid)
    return b - b % world


def plan_domains(cfg: SFTConfig, model, tokenizer, run_data: dict, run_dir: Path, source: str = "") -> list[DomainPlan]:
    """Check every domain's data, probe set and LoRA targets before any training."""
    check_lora_targets(model, cfg.lora, "sft.lora")
    data_dir = Path(cfg.data_dir) if cfg.data_dir else run_dir / "select"
    plans = []
    for name, spec in cfg.domains.items():
        train_path, valid_path = _resolve_data(name, spec, data_dir)
        kw = dict(mask_prompt=cfg.mask_prompt, max_seq_length=cfg.max_seq_length)
        train_set, stats = load_sft_file(train_path, tokenizer, **kw)
        if len(train_set) < cfg.batch_size:
            raise UserError(f"{train_path}: {len(train_set)} records, fewer than batch_size={cfg.batch_size}; "
                            f"set sft.batch_size to at most {len(train_set)}, or give domain '{name}' more data")
        valid_set = None
        if valid_path is not None and cfg.val_batches != 0:
            valid_set, vstats = load_sft_file(valid_path, tokenizer, **kw)
            if val_batch_size(cfg.batch_size, len(valid_set), dist.size()) == 0:
                raise UserError(f"{valid_path}: {len(valid_set)} records, fewer than the {dist.size()} ranks "
                                "that each validate one")
            if vstats["format"] != stats["format"]:
                raise UserError(f"{valid_path}: '{vstats['format']}' records, but {train_path} holds "
                                f"'{stats['format']}' records; validation must be the same kind")
            stats["valid_records"] = vstats["records"]
        if cfg.select == "val_loss" and valid_set is None:
            raise UserError(f"domain '{name}': select=val_loss needs validation data (valid.jsonl or domains.{name}.valid)")
        tasks, where = _probe_tasks(name, spec, cfg, run_data, source)
        plans.append(DomainPlan(name, train_path, valid_path, train_set, valid_set, tasks, where, stats))
    return plans


