"""Offline self-distillation (VibeThinker-3B, arXiv:2606.16140, section 2.3).

Algorithm:

1. **Collect.** Sample K completions per train task from each kept RL checkpoint (each phase's
   model, or the one RL model), verify them, and keep the verified-correct ones.
2. **Score** each trace y of query q by its *learning potential* under the student, the
   length-normalised negative log-likelihood ``S_LP(q, y) = -(1/|y|) sum_t log pi(y_t | q, y_<t)``
   (at temperature 1, over the tokens the model wrote: an episode's tool results and user turns do
   not count). Computed batched through the RL loop's chunked log-prob op
   (:func:`mlx_ssp.rl.logprobs.model_token_logprobs`), records padded per batch.
3. **Select**, never comparing across buckets: group the traces by (domain, length bucket) with
   bucket edges in tokens of the trace; drop traces shorter than ``min_tokens``; within each group
   rank by score and keep the traces whose rank quantile ``(rank + 1/2) / n`` lies in
   ``keep_quantiles = [lo, hi)`` (the report: "exclude extreme high-score outliers, prefer the
   middle-to-high range": the default keeps [0.5, 0.95)).
4. **Mix** the domains (``mix``: the fraction of each domain's kept traces used, a seeded subsample;
   default all) and **SFT the student** on them with the SFT stage (one domain, ``distill``, probed on
   every domain's probe tasks), then evaluate it like any other model.

Deviations: the report gives no bucket edges, quantiles or mix; they are configuration with the
defaults above. The student is the final RL model unless ``student`` names another. Collection
resumes per source (the rollout stage's own resume); the SFT resumes from its last checkpoint.
"""

from __future__ import annotations

import bisect
import json
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
from pydantic import Field, field_validator, model_validator

from mlx_ssp import trackers
from mlx_ssp.config import StrictModel, validate
from mlx_ssp.errors import UserError
from mlx_ssp.io import iter_jsonl_numbered, write_json_atomic, write_jsonl_atomic
from mlx_ssp.models import load_model
from mlx_ssp.rl.batch import build_batch
from mlx_ssp.rl.logprobs import model_token_logprobs
from mlx_ssp.rollout import RolloutConfig, run_rollouts
from mlx_ssp.rollout.config import SamplingConfig
from mlx_ssp.select import to_chat
from mlx_ssp.sft import SFTConfig, run_sft

DOMAIN = "distill"  # the SFT domain the student is trained as
CORRECT_AT = 0.999  # a verified-correct trace (as mlx_ssp.verify.VerifyResult.correct)


class DistillConfig(StrictModel):
    """The ``distill:`` section (absent: no distillation stage)."""

    sources: Optional[list[str]] = None  # models sampled from; `mlx_ssp run`: every kept RL checkpoint
    student: Optional[str] = None  # the model scored and trained; `mlx_ssp run`: the final RL model
    k: int = Field(4, ge=1)  # samples per train task per source
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=1.0, max_tokens=256))
    batch_size: int = Field(64, ge=1)  # sequences decoded together while collecting
    score_batch_size: int = Field(8, ge=1)  # traces per scoring forward pass
    chunk_size: Optional[int] = Field(None, ge=1)  # tokens per log-prob chunk (None: automatic)
    buckets: list[int] = Field(default_factory=lambda: [256, 1024, 4096])  # length bucket edges, tokens
    min_tokens: int = Field(8, ge=0)  # traces shorter than this are dropped
    keep_quantiles: tuple[float, float] = (0.5, 0.95)  # rank-quantile range kept in each bucket
    mix: Optional[dict[str, float]] = None  # domain -> fraction of its kept traces (default 1 each)
    sft: dict[str, Any] = Field(default_factory=dict)  # overrides of the sft: section for the student
    seed: Optional[int] = None

    @field_validator("buckets")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(v, v[1:])) or any(b < 1 for b in v):
            raise ValueError(f"bucket edges must be positive and increasing, got {v}")
        return v

    @field_validator("sft")
    @classmethod
    def _sft_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        # at load time, not after hours of collection and scoring (values are checked when SFT starts)

        bad = sorted(set(v) - set(SFTConfig.model_fields))
        if bad:
            raise ValueError(f"unknown sft key(s) {', '.join(bad)}; valid: {', '.join(sorted(SFTConfig.model_fields))}")
        return v

    @model_validator(mode="after")
    def _ranges(self) -> "DistillConfig":
        lo, hi = self.keep_quantiles
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"keep_quantiles must satisfy 0 <= lo < hi <= 1, got {list(self.keep_quantiles)}")
        for d, f in (self.mix or {}).items():
            if not 0.0 <= f <= 1.0:
                raise ValueError(f"mix.{d} must be in [0, 1], got {f}")
        return self


# -- the selection (pure) ------------------------------------------------------------------------


def bucket_of(length: int, edges: list[int]) -> int:
    """Bucket index of a trace length: 0 below the first edge, len(edges) at or above the last."""
    return bisect.bisect_right(edges, length)


def rank_quantiles(scores: list[float]) -> list[float]:
    """``(rank + 1/2) / n`` of each score in ascending order (ties: the earlier index ranks lower)."""
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    q = [0.0] * len(scores)
    for r, i in enumerate(order):
        q[i] = (r + 0.5) / len(scores)
    return q


def select_by_potential(domains: list[str], lengths: list[int], scores: list[float], *, edges: list[int],
                        min_tokens: int, keep: tuple[float, float]) -> tuple[list[int], dict]:
    """Indices kept (in input order) and a report per ``"domain/bucket"`` group: n, kept, below
    (under ``lo``), outliers (at or above ``hi``), plus the traces dropped as too short."""
    lo, hi = keep
    groups: dict[tuple[str, int], list[int]] = {}
    short = 0
    for i, (d, n) in enumerate(zip(domains, lengths)):
        if n < min_tokens:
            short += 1
            continue
        groups.setdefault((d, bucket_of(n, edges)), []).append(i)
    kept: list[int] = []
    report: dict[str, Any] = {"short": short, "groups": {}}
    for (d, b), idx in sorted(groups.items()):
        q = rank_quantiles([scores[i] for i in idx])
        mine = [i for i, qi in zip(idx, q) if lo <= qi < hi]
        kept += mine
        report["groups"][f"{d}/{b}"] = {"n": len(idx), "kept": len(mine), "below": sum(qi < lo for qi in q),
                                        "outliers": sum(qi >= hi for qi in q)}
    return sorted(kept), report


def mix_domains(indices: list[int], domains: list[str], mix: Optional[dict[str, float]], seed: int) -> list[int]:
    """A seeded subsample of each domain's kept indices: ``round(fraction * n)`` of them."""
    if not mix:
        return list(indices)
    rng = np.random.default_rng(seed)
    out = []
    for d in sorted({domains[i] for i in indices}):
        mine = [i for i in indices if domains[i] == d]
        n = round(mix.get(d, 1.0) * len(mine))
        out += [mine[j] for j in sorted(rng.permutation(len(mine))[:n])]
    return sorted(out)


# -- scoring -------------------------------------------------------------------------------------


def learning_potential(model, records: list[dict], *, batch_size: int = 8, chunk_size: Optional[int] = None) -> list[float]:
    """``S_LP`` of each record (prompt_token_ids + token_ids, model_mask for episodes) under
    ``model``, batched (records sorted by length so a batch pads little; order restored)."""
    import mlx.core as mx


    was_training = getattr(model, "training", False)
    model.eval()
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt_token_ids"]) + len(records[i]["token_ids"]))
    out = [0.0] * len(records)
    try:
        for j in range(0, len(order), batch_size):
            idx = order[j : j + batch_size]
            b = build_batch([records[i] for i in idx], np.zeros(len(idx), np.float32))
            lp = model_token_logprobs(model, b["inputs"], b["targets"], 1.0, chunk_size)
            m = b["mask"]
            nll = -(lp * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1.0)
            for i, v in zip(idx, nll.tolist()):
                out[i] = float(v)
    finally:
        if was_training:
            model.train()
    return out


# -- the stage -----------------------------------------------------------------------------------


def collect(sources: dict[str, str], tasks_path: Path, cfg: DistillConfig, out_dir: Path, *, seed: int,
            progress: bool = True) -> list[dict]:
    """Verified-correct rollouts of every source (``name -> model path``), each tagged with its
    ``distill_source``; each source's rollouts are a resumable file under ``out_dir/collect/``."""
    rcfg = RolloutConfig(k=cfg.k, sampling=cfg.sampling, batch_size=cfg.batch_size, seed=seed)
    kept = []
    for name, path in sources.items():
        f = out_dir / "collect" / f"{name.replace(':', '-').replace('/', '-')}.jsonl"
        with trackers.scope(f"rollout/{name}"):  # each source's summary apart (mlx_ssp.trackers)
            run_rollouts(path, tasks_path, rcfg, f, progress=progress)
        for _, rec in iter_jsonl_numbered(f, what="distill rollouts"):
            if float(rec.get("reward") or 0.0) >= CORRECT_AT:
                kept.append({**rec, "distill_source": name})
    return kept


def run_distill(cfg: DistillConfig, *, sources: dict[str, str], student: str, tasks_path: Path, probe_path: Path,
                out_dir: Path, seed: int, sft_base: Optional[dict] = None, progress: bool = True) -> dict:
    """Collect, score, select, mix and train: returns the stage's report (``model``: the distilled
    student, or None when no trace survived)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = collect(sources, tasks_path, cfg, out_dir, seed=seed, progress=progress)
    report: dict[str, Any] = {"sources": sources, "student": student, "correct": len(recs)}
    if not recs:
        report.update(model=None, skipped="no source produced a verified-correct trace")
        write_json_atomic(out_dir / "report.json", report)
        return report
    model, tok, _ = load_model(student)
    scores = learning_potential(model, recs, batch_size=cfg.score_batch_size, chunk_size=cfg.chunk_size)
    del model
    domains = [r.get("domain", "default") for r in recs]
    unknown = sorted(set(cfg.mix or {}) - set(domains))
    if unknown:
        raise UserError(f"distill.mix: {', '.join(unknown)} is not a domain of the collected traces "
                        f"({', '.join(sorted(set(domains)))})")
    lengths = [int(r.get("num_tokens", len(r["token_ids"]))) for r in recs]
    keep, sel = select_by_potential(domains, lengths, scores, edges=cfg.buckets, min_tokens=cfg.min_tokens,
                                    keep=cfg.keep_quantiles)
    keep = mix_domains(keep, domains, cfg.mix, seed)
    report.update(selection=sel, selected=len(keep), per_domain={d: sum(domains[i] == d for i in keep) for d in sorted(set(domains))},
                  score={"mean_all": float(np.mean(scores)), "mean_selected": float(np.mean([scores[i] for i in keep])) if keep else None})
    write_jsonl_atomic(out_dir / "scored.jsonl", [
        {"task_id": r["task_id"], "sample": r["sample"], "source": r["distill_source"], "domain": d, "tokens": n,
         "score": s, "selected": i in set(keep)} for i, (r, d, n, s) in enumerate(zip(recs, domains, lengths, scores))])
    if not keep:
        report.update(model=None, skipped="no trace survived the selection")
        write_json_atomic(out_dir / "report.json", report)
        return report
    write_jsonl_atomic(out_dir / "data" / "train.jsonl", [to_chat(recs[i]) for i in keep])
    raw = {**(sft_base or {}), "val_batches": 0, **cfg.sft}
    raw.pop("curriculum", None)  # one stage: the data are already the chosen traces
    raw.pop("blend", None)
    raw["domains"] = {DOMAIN: {"data": str(out_dir / "data"), "probe_tasks": str(probe_path),
                               "probe_domains": sorted(set(domains))}}
    raw["out_dir"] = str(out_dir / "sft")
    sft_cfg = validate(SFTConfig, raw, source="distill", prefix="distill.sft")
    with trackers.scope("sft"):  # the student's curves apart from the sft stage's (mlx_ssp.trackers)
        summary = run_sft(sft_cfg, student, seed=seed, run_dir=out_dir, card_kind="distill")
    report["model"] = summary["domains"][DOMAIN]["specialist"]
    report["sft"] = summary["domains"][DOMAIN]
    write_json_atomic(out_dir / "report.json", report)
    print(f"[distill] {len(keep)} of {len(recs)} correct traces selected; student trained: {report['model']}",
          file=sys.stderr)
    return report


def read_report(out_dir: Path) -> Optional[dict]:
    f = out_dir / "report.json"
    return json.loads(f.read_text()) if f.is_file() else None
