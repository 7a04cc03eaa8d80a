"""The file-level rollout stage: a task file rolled out into ``rollouts.jsonl``, resumably.

Steps: load the tasks (input errors before the model), lock the output, keep what a resume may
keep (:mod:`.resume`), broadcast the missing (task, sample) pairs to the ranks, generate them in
rounds appended whole by rank 0 (a writer thread fsyncs while generation goes on), and write the
summary of the whole file (:func:`.summary.stage_summary`). The samples come from a local model
(:class:`LocalSource`) or a server (:class:`EndpointSource`, :mod:`.endpoint`); resume, stamping
and summaries are the same for both."""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from pathlib import Path

from mlx_ssp import distributed as dist
from mlx_ssp import trackers
from mlx_ssp.errors import UserError
from mlx_ssp.io import JsonlAppender, exclusive_lock, write_json_atomic
from mlx_ssp.models import ModelConfig, load_model, load_tokenizer, resolve_model
from mlx_ssp.rollout.config import RolloutConfig
from mlx_ssp.rollout.endpoint import (
    effective_sampling,
    endpoint_meta,
    is_endpoint,
    iter_endpoint_rollouts,
    read_api_key,
)
from mlx_ssp.rollout.engine import iter_sharded
from mlx_ssp.rollout.imported import has_imported, iter_imported
from mlx_ssp.rollout.request import RolloutRequest, stage_settings
from mlx_ssp.rollout.resume import (
    NOTHING_DROPPED,
    load_resumable,
    lock_path,
    run_fingerprint,
    run_meta,
    sidecar,
    task_fingerprint,
)
from mlx_ssp.rollout.summary import stage_summary
from mlx_ssp.tasks import load_tasks

log = logging.getLogger("mlx_ssp.rollout")


class LocalSource:
    """Samples from an MLX model, loaded only when there is something to sample."""

    def __init__(self, mcfg, model=None, tokenizer=None):
        self.mcfg, self.model, self.tokenizer = mcfg, model, tokenizer

    def groups(self, request: RolloutRequest, missing: dict[str, list[int]], stats: dict, round_size: int):
        if self.model is None:
            self.model, self.tokenizer, _ = load_model(self.mcfg)
        return iter_sharded(self.model, self.tokenizer, request, missing, stats=stats, round_size=round_size)

    def student_tokenizer(self):
        """The tokenizer imported traces are tokenized with: the model's (weights not loaded for it)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(str(self.mcfg.path))
        return self.tokenizer


class EndpointSource:
    """Samples asked of an OpenAI-compatible server (:mod:`.endpoint`); ``tokenizer``: the student's,
    for token ids (loaded from ``teacher.tokenizer`` when not given)."""

    def __init__(self, cfg, tokenizer=None):
        self.cfg, self.tokenizer = cfg, tokenizer

    def groups(self, request: RolloutRequest, missing: dict[str, list[int]], stats: dict, round_size: int):
        return iter_endpoint_rollouts(self.cfg, request, samples=missing, stats=stats,
                                      tokenizer=self.student_tokenizer())

    def student_tokenizer(self):
        if self.tokenizer is None and self.cfg.tokenizer is not None:
            self.tokenizer = load_tokenizer(self.cfg.tokenizer)
        return self.tokenizer


def iter_sources(source, request: RolloutRequest, missing: dict[str, list[int]], stats: dict, round_size: int):
    """The missing samples' task groups: tasks with imported completions (:mod:`.imported`) from
    those, the rest from ``source`` (which is not started when nothing is left for it)."""
    imported = [t for t in request.tasks if has_imported(t) and missing.get(t.id)]
    rest = [t for t in request.tasks if not has_imported(t) and missing.get(t.id)]
    if rest:
        yield from source.groups(request.replace(tasks=rest), {t.id: missing[t.id] for t in rest}, stats, round_size)
    if imported:  # after the source: its stats start from zero, the imported pass adds to them
        yield from iter_imported(request.replace(tasks=imported), samples={t.id: missing[t.id] for t in imported},
                                 stats=stats, tokenizer=source.student_tokenizer())


def run_rollouts(model_spec, tasks_path: str | Path, cfg: RolloutConfig, out: str | Path, *,
                 overwrite: bool = False, progress: bool = True, model=None, tokenizer=None) -> dict:
    """Roll out a task file into ``out`` (JSONL), resuming what is already there; writes
    ``<out stem>.meta.json`` (the settings a resume must match) and ``<out stem>.summary.json``.
    Returns the summary. All input errors are raised before the model is loaded. The output is
    locked for the whole call (see :mod:`mlx_ssp.rollout` for what a resume keeps).
    ``model_spec``: a model (path or ModelConfig) or an endpoint teacher
    (:class:`~mlx_ssp.rollout.endpoint.EndpointTeacherConfig`; ``tokenizer`` is then the student's)."""
    out = Path(out)
    main = dist.is_main()  # under mlx.launch rank 0 alone reads/writes the output
    # empty file / bad record / unknown verifier: UserError (unlabelled tasks: checked by the request)
    tasks = load_tasks(tasks_path, check_verifiers=not getattr(cfg, "unlabelled", False))
    settings = stage_settings(cfg)
    if is_endpoint(model_spec):
        if dist.size() > 1:
            raise UserError("an endpoint teacher runs in one process (the server does the parallel work); "
                            "run the rollout without mlx.launch")
        read_api_key(model_spec)  # a missing key fails before the lock and the first request
        settings["sampling"] = effective_sampling(model_spec, cfg)
        request = RolloutRequest(tasks=tasks, k=cfg.k, progress=progress, **settings)
        meta = endpoint_meta(model_spec, cfg, request.sampling, request.seed)
        source = EndpointSource(model_spec, tokenizer)
    else:
        request = RolloutRequest(tasks=tasks, k=cfg.k, progress=progress, **settings)
        mcfg = model_spec if isinstance(model_spec, ModelConfig) else ModelConfig(path=str(model_spec))
        model_path = str(resolve_model(mcfg.path, mcfg.revision)) if model is None else str(mcfg.path)
        meta = run_meta(model_path, cfg, request.seed)
        source = LocalSource(mcfg, model, tokenizer)
    lock = exclusive_lock(lock_path(out), f"{out}") if main else contextlib.nullcontext()
    with lock:
        return _run_locked(source, request, out, meta, overwrite=overwrite)


def _missing(records: list[dict], request: RolloutRequest) -> dict[str, list[int]]:
    """task id -> the sample indices < k not in ``records``."""
    have: dict[str, set[int]] = defaultdict(set)
    for r in records:
        have[r["task_id"]].add(r["sample"])
    return {t.id: [s for s in range(request.k) if s not in have[t.id]] for t in request.tasks}


def _run_locked(source, request: RolloutRequest, out: Path, meta: dict, *, overwrite: bool) -> dict:
    main = dist.is_main()
    meta_path = sidecar(out, "meta")
    fingerprints = {t.id: task_fingerprint(t, request.system) for t in request.tasks}
    run_fp = run_fingerprint(meta)
    existing: list[dict] = []
    dropped = dict(NOTHING_DROPPED, stale_tasks=[])
    if main:
        existing, dropped = load_resumable(out, meta, run_fp, fingerprints, overwrite)
    missing = dist.broadcast_object(_missing(existing, request), what="rollout: samples to do")
    todo = sum(len(v) for v in missing.values())
    stats: dict = {}
    if not todo and main and out.exists() and not meta_path.exists():
        write_json_atomic(meta_path, meta)  # the records' run fingerprints vouched for these settings
    if todo:
        if main:
            write_json_atomic(meta_path, meta)
        if existing:
            log.info("resuming %s: %d samples done, %d to go", out, len(existing), todo)
        existing.extend(_append_missing(source, request, missing, out, stats, fingerprints, run_fp))
    ids = {t.id for t in request.tasks}
    summary = stage_summary([r for r in existing if r["task_id"] in ids], request.k, model=meta["model"],
                            seed=request.seed, sampling=request.sampling.model_dump(), output=str(out),
                            stats=stats, dropped=dropped)
    if main:
        write_json_atomic(sidecar(out, "summary"), summary)
        trackers.log("", trackers.without(summary, "sampling", "seed"), step=0)  # rollout/overall/pass@1, ...
    return dist.broadcast_object(summary, what="rollout: summary")  # rank 0 read the whole file


def _append_missing(source, request: RolloutRequest, missing: dict[str, list[int]], out: Path,
                    stats: dict, fingerprints: dict[str, str], run_fp: str) -> list[dict]:
    """Generate the missing samples, stamp each record with what a later resume checks it against,
    and append each round to ``out`` (rank 0); returns the new records."""
    new: list[dict] = []
    # several ranks: rounds of 8 batches per rank, each round appended whole by rank 0
    round_size = 8 * request.batch_size * dist.size()
    with (JsonlAppender(out, background=True) if dist.is_main() else contextlib.nullcontext()) as app:
        for group in iter_sources(source, request, missing, stats, round_size):
            for r in group:
                r["task_fingerprint"] = fingerprints[r["task_id"]]
                r["run_fingerprint"] = run_fp
            if app is not None:
                app.write_many(group)
            new.extend(group)
    return new
