"""Resuming a rollout file: sidecar paths, the lock, fingerprints, ``.meta.json``, and which
existing records a resume keeps (see :mod:`mlx_ssp.rollout` for the rules)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from mlx_ssp.errors import UserError
from mlx_ssp.io import lock_path as output_lock_path
from mlx_ssp.io import read_jsonl, repair_jsonl_tail, write_jsonl_atomic
from mlx_ssp.rollout.config import RolloutConfig
from mlx_ssp.tasks import Task

log = logging.getLogger("mlx_ssp.rollout")

#: what a fresh (or fully kept) file dropped
NOTHING_DROPPED = {"stale_records": 0, "stale_tasks": [], "repeated_records": 0}


def sidecar(out: Path, name: str) -> Path:
    """``rollouts.jsonl`` -> ``rollouts.<name>.json``."""
    return out.with_name(f"{out.stem}.{name}.json")


def lock_path(out: Path) -> Path:
    """The lock file of an output: ``.rollouts.jsonl.lock`` beside it (the output itself is
    replaced by atomic rewrites, so it cannot carry the lock); :func:`mlx_ssp.io.lock_path`, the
    rule every stage command's output lock follows."""
    return output_lock_path(out)


def _digest(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def task_fingerprint(task: Task, system: Optional[str] = None) -> str:
    """Hash of what decides a task's samples and rewards: domain, prompt, answer, verifier,
    metadata (answer extraction, entry points, tool schemas...) and the system prompt added to it.
    The id is left out: records are keyed by it already."""
    return _digest({"domain": task.domain, "prompt": task.prompt, "answer": task.answer,
                    "verifier": task.verifier, "metadata": task.metadata, "system": system})


def run_fingerprint(meta: dict) -> str:
    """Hash of a run's settings (the ``.meta.json`` contents): records with equal ones can share a file."""
    return _digest(meta)


def read_meta(meta_path: Path) -> Optional[dict]:
    """The settings in a ``.meta.json`` (None when there is none); a corrupt one is a UserError."""
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{meta_path} is not valid JSON; delete it only if you know which run wrote the rollouts") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path} is not a JSON object")
    return meta


def check_provenance(records: list[dict], out: Path, run_fp: str, meta_known: bool) -> None:
    """Refuse to resume ``out`` when its records may come from other run settings: a record stamped
    with another ``run_fingerprint``, or unstamped records (an older file) with no ``.meta.json``."""
    for i, r in enumerate(records, 1):
        if "task_id" not in r or "sample" not in r:
            raise UserError(f"{out}: record {i} lacks task_id or sample (not an mlx_ssp rollouts file?)")
    stamps = {r.get("run_fingerprint") for r in records}
    if stamps - {run_fp, None}:
        n = sum(r.get("run_fingerprint") not in (run_fp, None) for r in records)
        raise UserError(f"{out}: {n} record(s) were written with different settings (model, seed or sampling); "
                        "use another output path or --overwrite")
    if None in stamps and not meta_known:
        raise UserError(f"{out} has records but no {sidecar(out, 'meta').name} to say which model, seed and sampling "
                        "wrote them; use another output path or --overwrite")


def drop_stale(records: list[dict], fingerprints: dict[str, str]) -> tuple[list[dict], dict[str, int], int]:
    """(records to keep, task id -> its dropped stale records, repeated records dropped). A record
    is stale when its task is in ``fingerprints`` with another fingerprint (or the record has none:
    an older file); of repeated (task, sample) records the first is kept. Records of tasks not in
    ``fingerprints`` are kept as they are."""
    keep: list[dict] = []
    stale: dict[str, int] = defaultdict(int)
    seen: set[tuple[str, int]] = set()
    repeated = 0
    for r in records:
        tid = r["task_id"]
        if tid in fingerprints and r.get("task_fingerprint") != fingerprints[tid]:
            stale[tid] += 1
            continue
        key = (tid, r["sample"])
        if key in seen:
            repeated += 1
            continue
        seen.add(key)
        keep.append(r)
    return keep, dict(stale), repeated


def run_meta(model_path: str, cfg: RolloutConfig, seed: int) -> dict:
    """The run settings a resume must match (kept in ``.meta.json``)."""
    return {
        "model": model_path,
        "seed": seed,
        "sampling": cfg.sampling.model_dump(),
        "system": cfg.system,
        "max_context": cfg.max_context,
    }


def load_resumable(out: Path, meta: dict, run_fp: str, fingerprints: dict[str, str],
                   overwrite: bool) -> tuple[list[dict], dict]:
    """The records of ``out`` a resume keeps (rank 0, under the lock), and what was dropped:
    ``{"stale_records", "stale_tasks", "repeated_records"}``. ``run_fp``: :func:`run_fingerprint` of
    ``meta``. Other settings are refused; stale and
    repeated records are removed from the file by one atomic rewrite."""
    dropped = dict(NOTHING_DROPPED, stale_tasks=[])
    meta_path = sidecar(out, "meta")
    if overwrite:
        out.unlink(missing_ok=True)
        meta_path.unlink(missing_ok=True)
    if not out.exists():
        return [], dropped
    old = read_meta(meta_path)
    if old is not None:
        diff = [key for key in meta if old.get(key) != meta[key]]
        if diff:
            raise UserError(
                f"{out} was generated with different settings ({', '.join(diff)}); "
                "use another output path or --overwrite"
            )
    repair_jsonl_tail(out)
    existing = read_jsonl(out, what="rollouts")
    check_provenance(existing, out, run_fp, meta_known=old is not None)
    keep, stale, repeated = drop_stale(existing, fingerprints)
    if stale or repeated:
        write_jsonl_atomic(out, keep)
        dropped.update(stale_records=sum(stale.values()), stale_tasks=sorted(stale), repeated_records=repeated)
        log.warning(
            "%s: dropped %d record(s) of %d task(s) that changed since they were sampled (or predate task "
            "fingerprints) and %d repeated record(s); their samples are generated again",
            out, dropped["stale_records"], len(stale), repeated,
        )
    return keep, dropped
