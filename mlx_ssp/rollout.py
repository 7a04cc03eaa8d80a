"""Batched K-rollouts with behaviour log-probs and verifier rewards (SSP step 1, "Spectrum").

Algorithm (VibeThinker-1.5B, arXiv:2511.06221, section 3.2 "Spectrum phase": sample many candidate
solutions per problem and keep the verified ones). For every task, render the prompt with the
model's chat template, queue K sequences (one per sample index) into one
``mlx_lm.generate.BatchGenerator`` (continuous batching; the decoding loop is mlx-lm's), each with
its own noise stream whose PRNG key is derived from ``(seed, task id, sample index)``; one shared
:class:`mlx_ssp.sampling.BatchSampler` draws the whole batch's tokens per step in one batched op
and records each token's ``log_softmax(logprobs / T)[token]`` (from mlx-lm's T=1 log-prob vector),
the behaviour log-prob GRPO's ratio needs (see :mod:`mlx_ssp.sampling` for truncation and
greedy). When all K samples of a task are done they are verified with
:func:`mlx_ssp.verify.verify` and handed out together, so the CLI appends each finished task to
``rollouts.jsonl`` at once (:class:`mlx_ssp.io.JsonlAppender` on a writer thread: a crash loses at
most the tasks in flight, never leaves half a line).

Record keys: ``task_id, domain, sample, prompt, prompt_token_ids, completion, token_ids, logprobs,
logprob_temperature, finish_reason ("stop" | "length"), stop (the stop string hit, or null),
num_tokens, reward, reason, detail, latency_s (insert to finish), verify_s``; the file stage adds
``task_fingerprint`` and ``run_fingerprint`` (below).

Resume (:func:`run_rollouts`): the output is locked for the whole run (a second run on it stops at
once, naming the holder). Each record carries ``task_fingerprint``, a hash of what decides its task's
samples and rewards (domain, prompt, answer, verifier, metadata, system prompt), and
``run_fingerprint``, a hash of the run settings kept in ``.meta.json`` (model, seed, sampling,
system, context). On resume, records of a task whose fingerprint changed (the prompt or answer was
edited under the same id) and repeated (task, sample) records are dropped, the file is rewritten
atomically without them, and those samples are generated again: the user edited the task file and
expects the output to follow it, and the untouched tasks keep their samples. Records from other
run settings, or records with no ``.meta.json`` and no ``run_fingerprint`` to vouch for them,
are refused: mixing them would silently blend two runs.

Choices and deviations (the paper gives none of these details):
- ``token_ids``/``logprobs`` hold every sampled token, including the EOS token that ended the
  sequence (RL must learn to emit it) and the tokens that spell a stop string; ``completion`` is
  the decoded text without the EOS and cut before the stop string (as OpenAI-style APIs do).
- Stop strings are matched on the decoded text (a stop string can tokenize differently inside a
  stream); the sequence is then removed from the generator.
- A prompt that does not fit the context (``max_context``, default the model's
  ``max_position_embeddings``) is skipped with one counted warning; ``max_tokens`` is clamped so
  prompt + completion fit.
- The model is put in eval mode during generation (LoRA dropout off) and restored afterwards; it
  is never reloaded, so a LoRA policy samples as itself.
- No prefix sharing across the K samples of a prompt: each sequence prefills its own prompt
  (mlx-lm's BatchGenerator batches the prefill; decoding dominates for reasoning-length outputs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional

import click
from pydantic import Field, field_validator

from mlx_ssp.config import StrictModel
from mlx_ssp.errors import UserError
from mlx_ssp.tasks import Task

log = logging.getLogger(__name__)


class SamplingConfig(StrictModel):
    """How each completion is sampled. ``temperature: 0`` is greedy decoding."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(256, ge=1)
    stop: list[str] = Field(default_factory=list)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class RolloutConfig(StrictModel):
    """The ``rollout:`` section of a run file."""

    k: int = Field(8, ge=1)  # samples per task
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    batch_size: int = Field(64, ge=1)  # sequences decoded together
    seed: Optional[int] = None  # default: the run file's top-level seed, else 0
    tasks: Optional[str] = None  # task JSONL (the --tasks flag beats it)
    output: Optional[str] = None  # rollouts JSONL (the -o flag beats it)
    max_context: Optional[int] = Field(None, ge=2)  # default: the model's max_position_embeddings
    system: Optional[str] = None  # system prompt added to tasks that have none
    verify_workers: int = Field(4, ge=1)  # threads for sandboxed (parallel) verifiers


# -- the engine -------------------------------------------------------------------------------


def model_context_length(model) -> Optional[int]:
    """``max_position_embeddings`` of an mlx-lm model (None when it does not say)."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "n_positions"):
        v = getattr(args, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _check_inputs(tasks: list[Task], k: int, verify: bool) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserError(f"k must be an integer >= 1, got {k!r}")
    if not tasks:
        raise UserError("no tasks to roll out (the task list is empty)")
    if verify:
        from mlx_ssp.tasks import check_tasks

        check_tasks(tasks)


def _timed_verify(text: str, task: Task):
    from mlx_ssp.verify import verify

    t0 = time.perf_counter()
    res = verify(text, task)
    return res, time.perf_counter() - t0


class _Seq:
    """Book-keeping of one in-flight sample."""

    __slots__ = ("uid", "task_idx", "sample", "tokens", "lps", "detok", "text", "t0", "max_tokens")

    def __init__(self, uid, task_idx, sample, t0, max_tokens):
        self.uid = uid
        self.task_idx = task_idx
        self.sample = sample
        self.tokens: list[int] = []
        self.lps: list[float] = []
        self.detok = None
        self.text = ""
        self.t0 = t0
        self.max_tokens = max_tokens


def iter_rollouts(
    model,
    tokenizer,
    tasks: list[Task],
    *,
    k: int,
    sampling: SamplingConfig,
    seed: int = 0,
    batch_size: int = 64,
    verify: bool = True,
    progress: bool = True,
    samples: Optional[dict[str, list[int]]] = None,
    max_context: Optional[int] = None,
    system: Optional[str] = None,
    stats: Optional[dict] = None,
    verify_workers: int = 4,
) -> Iterator[list[dict]]:
    """Yield the records of each task as soon as all its samples are done (completion order).

    ``samples`` maps task id -> the sample indices to generate (default ``range(k)`` for every
    task); resuming passes only the missing ones. ``stats`` (if given) is filled with counters:
    ``skipped`` (ids of tasks whose prompt does not fit), ``gen_tokens``, ``prompt_tokens``,
    ``gen_s`` (wall time of the loop), ``verify_s`` (summed verifier time). Verifiers registered as
    parallel (the code sandbox) run on ``verify_workers`` threads beside generation; the others run
    inline (math-verify's timeouts need the main thread).
    """
    from mlx_lm.generate import BatchGenerator

    from mlx_ssp.sampling import BatchSampler, Float32Logits, SequenceSampler, behaviour_logprobs, sample_stream_seed
    from mlx_ssp.tasks import render_prompt
    from mlx_ssp.verify import PARALLEL

    _check_inputs(tasks, k, verify)
    stats = stats if stats is not None else {}
    stats.update(skipped=[], gen_tokens=0, prompt_tokens=0, gen_s=0.0, verify_s=0.0, n_samples=0)
    context = max_context or model_context_length(model)
    temp = sampling.temperature
    lp_temp = temp if temp > 0 else 1.0

    # Render every prompt first, so that a template error surfaces before any generation.
    work: list[tuple[int, int]] = []  # (task index, sample index) in generation order
    prompts: dict[int, list[int]] = {}
    budget: dict[int, int] = {}
    for ti, task in enumerate(tasks):
        wanted = list(range(k)) if samples is None else sorted(samples.get(task.id, []))
        if not wanted:
            continue
        ids = render_prompt(tokenizer, task, system=system)
        if context is not None and len(ids) >= context:
            stats["skipped"].append(task.id)
            continue
        prompts[ti] = ids
        budget[ti] = sampling.max_tokens if context is None else min(sampling.max_tokens, context - len(ids))
        work.extend((ti, s) for s in wanted)
    if stats["skipped"]:
        n = len(stats["skipped"])
        msg = f"skipped {n} task(s) whose prompt does not fit the context of {context} tokens (first: {stats['skipped'][0]})"
        warnings.warn(msg, stacklevel=2)
        log.warning(msg)
    if not work:
        return

    remaining = defaultdict(int)
    for ti, _ in work:
        remaining[ti] += 1
    done: dict[int, list[dict]] = defaultdict(list)
    stop_strings = list(sampling.stop)
    max_stop = max((len(s) for s in stop_strings), default=0)

    was_training = getattr(model, "training", False)
    model.eval()
    # One sampler object for every sequence: mlx-lm then samples the batch in one call. The escape
    # hatch (one sampler per sequence, same samples) exists in case mlx-lm's internals change.
    shared = None if os.environ.get("MLX_SSP_PER_SEQUENCE_SAMPLER") == "1" else BatchSampler(
        temp, sampling.top_p, sampling.top_k, sampling.min_p
    )
    gen = BatchGenerator(
        Float32Logits(model),  # bf16/fp16 models: normalise and sample in float32 (mlx_ssp.sampling)
        sampler=shared,
        max_tokens=sampling.max_tokens,
        stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
        completion_batch_size=batch_size,
        prefill_batch_size=min(batch_size, 8),
    )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(work), unit="sample", desc="rollout", dynamic_ncols=True)
    live: dict[int, _Seq] = {}
    pending: list = []  # (task index, record, future) of background verifications
    pool = None
    if verify and verify_workers > 1 and any(t.verifier in PARALLEL for t in tasks):
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=verify_workers, thread_name_prefix="verify")
    next_work = 0
    t_start = time.perf_counter()
    last_bar = t_start

    def top_up() -> None:
        nonlocal next_work
        # keep about two batches queued: enough to refill, without one cache object per sample up front
        n = min(2 * batch_size - len(live), len(work) - next_work)
        if n <= 0:
            return
        chunk = work[next_work : next_work + n]
        next_work += n
        now = time.perf_counter()
        streams = [sample_stream_seed(seed, tasks[ti].id, s) for ti, s in chunk]
        samplers = None
        if shared is None:
            samplers = [SequenceSampler(st, temp, sampling.top_p, sampling.top_k, sampling.min_p) for st in streams]
        uids = gen.insert(
            [prompts[ti] for ti, _ in chunk], max_tokens=[budget[ti] for ti, _ in chunk], samplers=samplers
        )
        for uid, (ti, s), stream in zip(uids, chunk, streams):
            if shared is not None:
                shared.add(uid, stream)
            seq = _Seq(uid, ti, s, now, budget[ti])
            if stop_strings:
                seq.detok = tokenizer.detokenizer
            live[uid] = seq
        stats["prompt_tokens"] += sum(len(prompts[ti]) for ti, _ in chunk)

    def finish(seq: _Seq, reason: str, stop_hit: Optional[str]) -> Optional[list[dict]]:
        task = tasks[seq.task_idx]
        toks = seq.tokens
        eos = tokenizer.eos_token_ids
        if stop_hit is not None:
            text = seq.text[: seq.text.index(stop_hit)]
        else:
            text_ids = toks[:-1] if (reason == "stop" and toks and toks[-1] in eos) else toks
            text = tokenizer.decode(text_ids)
        rec: dict[str, Any] = {
            "task_id": task.id,
            "domain": task.domain,
            "sample": seq.sample,
            "prompt": task.prompt,
            "prompt_token_ids": prompts[seq.task_idx],
            "completion": text,
            "token_ids": list(toks),
            "logprobs": seq.lps,
            "logprob_temperature": lp_temp,
            "finish_reason": reason,
            "stop": stop_hit,
            "num_tokens": len(toks),
            "reward": None,
            "reason": None,
            "detail": None,
            "latency_s": round(time.perf_counter() - seq.t0, 4),
            "verify_s": 0.0,
        }
        if shared is not None:
            shared.drop(seq.uid)
        if verify and pool is not None and task.verifier in PARALLEL:
            # sandboxed verifiers wait on subprocesses: run them beside generation
            pending.append((seq.task_idx, rec, pool.submit(_timed_verify, text, task)))
            return None
        if verify:
            res, dt = _timed_verify(text, task)
            _set_reward(rec, res, dt)
        return record_done(seq.task_idx, rec)

    def _set_reward(rec: dict, res, dt: float) -> None:
        stats["verify_s"] += dt
        rec.update(reward=float(res.reward), reason=res.reason, detail=res.detail, verify_s=round(dt, 5))

    def record_done(ti: int, rec: dict) -> Optional[list[dict]]:
        done[ti].append(rec)
        remaining[ti] -= 1
        if remaining[ti] == 0:
            return sorted(done.pop(ti), key=lambda r: r["sample"])
        return None

    def collect(wait: bool) -> list[list[dict]]:
        """Records whose background verification has finished (all of them when ``wait``)."""
        groups = []
        still = []
        for ti, rec, fut in pending:
            if wait or fut.done():
                res, dt = fut.result()
                _set_reward(rec, res, dt)
                grp = record_done(ti, rec)
                if grp is not None:
                    groups.append(grp)
            else:
                still.append((ti, rec, fut))
        pending[:] = still
        return groups

    try:
        top_up()
        while live:
            responses = gen.next_generated()
            if not responses:
                if next_work < len(work):
                    top_up()
                    continue
                raise RuntimeError(f"mlx-lm's BatchGenerator stopped with {len(live)} sequence(s) unfinished")
            # behaviour log-probs of this step's tokens (computed with the draw on the batched path)
            if shared is not None:
                lps = [shared.behaviour_logprob(r.uid) for r in responses]
            else:
                lps = behaviour_logprobs([r.logprobs for r in responses], [r.token for r in responses], temp)
            stats["gen_tokens"] += len(responses)
            finished_groups = []
            to_remove = []
            for r, lp in zip(responses, lps):
                seq = live[r.uid]
                seq.tokens.append(r.token)
                seq.lps.append(lp)
                reason = r.finish_reason
                stop_hit = None
                if seq.detok is not None and reason != "stop":  # an EOS ends the sequence anyway
                    seq.detok.add_token(r.token)
                    seg = seq.detok.last_segment
                    if seg:
                        window_start = max(0, len(seq.text) - max_stop + 1)
                        seq.text += seg
                        window = seq.text[window_start:]
                        hits = [(window.find(s), s) for s in stop_strings if s in window]
                        if hits:
                            stop_hit = min(hits)[1]
                            if reason is None:
                                to_remove.append(r.uid)
                            reason = "stop"
                if reason is not None:
                    del live[r.uid]
                    grp = finish(seq, reason, stop_hit)
                    if bar is not None:
                        bar.update(1)
                    if grp is not None:
                        finished_groups.append(grp)
            if to_remove:
                gen.remove(to_remove)
            if bar is not None and time.perf_counter() - last_bar > 0.5:
                last_bar = time.perf_counter()
                bar.set_postfix_str(f"{stats['gen_tokens'] / (last_bar - t_start):.1f} tok/s", refresh=False)
            if next_work < len(work) and len(live) < 2 * batch_size:
                top_up()
            if pending:
                finished_groups.extend(collect(wait=False))
            stats["gen_s"] = time.perf_counter() - t_start
            stats["n_samples"] += sum(len(g) for g in finished_groups)
            yield from finished_groups
        if pending:
            groups = collect(wait=True)
            stats["n_samples"] += sum(len(g) for g in groups)
            yield from groups
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        gen.close()
        if bar is not None:
            bar.close()
        if was_training:
            model.train()
        stats["gen_s"] = time.perf_counter() - t_start


def generate_rollouts(
    model,
    tokenizer,
    tasks: list[Task],
    *,
    k: int,
    sampling: SamplingConfig,
    seed: int = 0,
    batch_size: int = 64,
    verify: bool = True,
    progress: bool = True,
    max_context: Optional[int] = None,
    system: Optional[str] = None,
    stats: Optional[dict] = None,
    verify_workers: int = 4,
) -> list[dict]:
    """K completions per task, in memory: one dict per completion ordered by (task order, sample
    index), with the keys listed in the module docstring. Tasks whose prompt does not fit the
    context are skipped (warning; ids in ``stats["skipped"]``)."""
    from mlx_ssp import distributed as dist

    order = {t.id: i for i, t in enumerate(tasks)}
    out: list[dict] = []
    if dist.size() > 1:  # data parallel (issue 10): each rank samples its share, records gathered
        _check_inputs(tasks, k, verify)

        def shard(subset: dict, st: dict):
            return iter_rollouts(
                model, tokenizer, tasks, k=k, sampling=sampling, seed=seed, batch_size=batch_size, verify=verify,
                progress=progress and dist.is_main(), samples=subset, max_context=max_context, system=system,
                stats=st, verify_workers=verify_workers,
            )

        groups = dist.iter_sharded_groups(shard, {t.id: list(range(k)) for t in tasks}, stats=stats)
    else:
        groups = iter_rollouts(
            model, tokenizer, tasks, k=k, sampling=sampling, seed=seed, batch_size=batch_size, verify=verify,
            progress=progress, max_context=max_context, system=system, stats=stats, verify_workers=verify_workers,
        )
    for group in groups:
        out.extend(group)
    out.sort(key=lambda r: (order[r["task_id"]], r["sample"]))
    return out


# -- summaries ---------------------------------------------------------------------------------


def group_by_task(records: list[dict], k: Optional[int] = None) -> dict[str, list[dict]]:
    """task id -> its records (only samples < k when k is given), in file order."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if k is None or r["sample"] < k:
            out[r["task_id"]].append(r)
    return out


def _is_correct(r: dict) -> bool:
    return r.get("reward") is not None and r["reward"] >= 0.999


def summarize(records: list[dict], k: int, max_samples: Optional[int] = None) -> dict:
    """Per-domain pass@1 / pass@k (unbiased estimator over each task's n samples; samples with
    index >= ``max_samples`` ignored), mean completion length and the truncated fraction;
    ``overall`` averages over all tasks (task-weighted).

    pass@k needs n >= k (as in :mod:`mlx_ssp.eval`, which refuses n < k): a task with fewer samples
    has ``pass@k: None`` and is left out of the domain's pass@k, whose ``pass@k_tasks`` says how
    many tasks it averages (``None`` when none has k samples), rather than reporting its pass@n
    under the pass@k label."""
    from mlx_ssp.metrics import pass_at_k

    by_task = group_by_task(records, max_samples)
    rows: dict[str, list[dict]] = defaultdict(list)
    for tid, recs in by_task.items():
        n = len(recs)
        c = sum(_is_correct(r) for r in recs)
        rows[recs[0]["domain"]].append(
            {
                "task_id": tid,
                "n": n,
                "c": c,
                "pass@1": pass_at_k(n, c, 1),
                f"pass@{k}": pass_at_k(n, c, k) if n >= k else None,
                "mean_tokens": sum(r["num_tokens"] for r in recs) / n,
                "truncated": sum(r["finish_reason"] == "length" for r in recs),
            }
        )

    def agg(task_rows: list[dict]) -> dict:
        m = len(task_rows)
        if m == 0:
            return {"n_tasks": 0}
        n_samples = sum(t["n"] for t in task_rows)
        with_k = [t[f"pass@{k}"] for t in task_rows if t[f"pass@{k}"] is not None]
        return {
            "n_tasks": m,
            "n_samples": n_samples,
            "pass@1": sum(t["pass@1"] for t in task_rows) / m,
            f"pass@{k}": sum(with_k) / len(with_k) if with_k else None,
            f"pass@{k}_tasks": len(with_k),
            "mean_tokens": sum(t["mean_tokens"] * t["n"] for t in task_rows) / n_samples,
            "truncated_frac": sum(t["truncated"] for t in task_rows) / n_samples,
        }

    domains = {d: agg(v) for d, v in sorted(rows.items())}
    return {
        "k": k,
        "domains": domains,
        "overall": agg([t for v in rows.values() for t in v]),
        "tasks": [t for v in rows.values() for t in v],
    }


def format_table(summary: dict, extra: tuple[str, ...] = ()) -> str:
    """A plain-text table of a summary's domains and overall row."""
    k = summary["k"]
    cols = ["n_tasks", "pass@1", f"pass@{k}", *extra, "mean_tokens"]
    if any(row.get(f"pass@{k}_tasks", row.get("n_tasks")) != row.get("n_tasks") for row in summary["domains"].values()):
        cols.insert(3, f"pass@{k}_tasks")  # some tasks have fewer than k samples: say over how many
    head = ["domain", *cols]
    lines = []
    items = list(summary["domains"].items()) + [("overall", summary["overall"])]
    for name, row in items:
        cells = [name]
        for c in cols:
            v = row.get(c)
            cells.append("-" if v is None else (f"{v:.4f}" if isinstance(v, float) and c.startswith(("pass", "greedy")) else (f"{v:.1f}" if isinstance(v, float) else str(v))))
        lines.append(cells)
    widths = [max(len(head[i]), *(len(r[i]) for r in lines)) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *(fmt(r) for r in lines)])


# -- the file-level stage (resumable) --------------------------------------------------------


def sidecar(out: Path, name: str) -> Path:
    """``rollouts.jsonl`` -> ``rollouts.<name>.json``."""
    return out.with_name(f"{out.stem}.{name}.json")


def lock_path(out: Path) -> Path:
    """The lock file of an output: ``.rollouts.jsonl.lock`` beside it (the output itself is
    replaced by atomic rewrites, so it cannot carry the lock)."""
    return out.with_name(f".{out.name}.lock")


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


def _meta(model_path: str, cfg: RolloutConfig, seed: int) -> dict:
    return {
        "model": model_path,
        "seed": seed,
        "sampling": cfg.sampling.model_dump(),
        "system": cfg.system,
        "max_context": cfg.max_context,
    }


def run_rollouts(model_spec, tasks_path: str | Path, cfg: RolloutConfig, out: str | Path, *,
                 overwrite: bool = False, progress: bool = True, model=None, tokenizer=None) -> dict:
    """Roll out a task file into ``out`` (JSONL), resuming what is already there; writes
    ``<out stem>.meta.json`` (the settings a resume must match) and ``<out stem>.summary.json``.
    Returns the summary. All input errors are raised before the model is loaded. The output is
    locked for the whole call (see the module docstring for what a resume keeps)."""
    from mlx_ssp.io import exclusive_lock
    from mlx_ssp.models import ModelConfig, resolve_model
    from mlx_ssp.tasks import load_tasks

    from mlx_ssp import distributed as dist

    out = Path(out)
    main = dist.is_main()  # under mlx.launch rank 0 alone reads/writes the output (issue 10)
    tasks = load_tasks(tasks_path)  # empty file / bad record / unknown verifier: UserError
    seed = cfg.seed if cfg.seed is not None else 0
    mcfg = model_spec if isinstance(model_spec, ModelConfig) else ModelConfig(path=str(model_spec))
    model_path = str(resolve_model(mcfg.path, mcfg.revision)) if model is None else str(mcfg.path)
    meta = _meta(model_path, cfg, seed)
    lock = exclusive_lock(lock_path(out), f"{out}") if main else contextlib.nullcontext()
    with lock:
        return _run_locked(mcfg, tasks, cfg, out, meta, seed, overwrite=overwrite, progress=progress,
                           model=model, tokenizer=tokenizer)


def _load_resumable(out: Path, meta: dict, fingerprints: dict[str, str], overwrite: bool) -> tuple[list[dict], dict]:
    """The records of ``out`` a resume keeps (rank 0, under the lock), and what was dropped:
    ``{"stale_records", "stale_tasks", "repeated_records"}``. Other settings are refused; stale and
    repeated records are removed from the file by one atomic rewrite."""
    from mlx_ssp.io import read_jsonl, repair_jsonl_tail, write_jsonl_atomic

    dropped = {"stale_records": 0, "stale_tasks": [], "repeated_records": 0}
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
    check_provenance(existing, out, run_fingerprint(meta), meta_known=old is not None)
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


def _run_locked(mcfg, tasks: list[Task], cfg: RolloutConfig, out: Path, meta: dict, seed: int, *,
                overwrite: bool, progress: bool, model, tokenizer) -> dict:
    from mlx_ssp.io import JsonlAppender, write_json_atomic
    from mlx_ssp.models import load_model

    from mlx_ssp import distributed as dist

    main = dist.is_main()
    model_path = meta["model"]
    meta_path = sidecar(out, "meta")
    fingerprints = {t.id: task_fingerprint(t, cfg.system) for t in tasks}
    run_fp = run_fingerprint(meta)
    existing: list[dict] = []
    dropped = {"stale_records": 0, "stale_tasks": [], "repeated_records": 0}
    if main:
        existing, dropped = _load_resumable(out, meta, fingerprints, overwrite)
    have: dict[str, set[int]] = defaultdict(set)
    for r in existing:
        have[r["task_id"]].add(r["sample"])
    missing = {t.id: [s for s in range(cfg.k) if s not in have[t.id]] for t in tasks}
    missing = dist.broadcast_object(missing, what="rollout: samples to do")
    todo = sum(len(v) for v in missing.values())
    stats: dict = {}
    if not todo and main and out.exists() and not meta_path.exists():
        write_json_atomic(meta_path, meta)  # the records' run fingerprints vouched for these settings
    if todo:
        if model is None:
            model, tokenizer, _ = load_model(mcfg)
        if main:
            write_json_atomic(meta_path, meta)
        if existing:
            log.info("resuming %s: %d samples done, %d to go", out, len(existing), todo)

        def shard(subset: dict, st: dict):
            return iter_rollouts(
                model, tokenizer, tasks, k=cfg.k, sampling=cfg.sampling, seed=seed, batch_size=cfg.batch_size,
                progress=progress and main, samples=subset, max_context=cfg.max_context, system=cfg.system, stats=st,
                verify_workers=cfg.verify_workers,
            )

        # several ranks: rounds of 8 batches per rank, each round appended whole by rank 0
        # the writer thread fsyncs while generation goes on
        with (JsonlAppender(out, background=True) if main else contextlib.nullcontext()) as app:
            for group in dist.iter_sharded_groups(shard, missing, stats=stats, round_size=8 * cfg.batch_size * dist.size()):
                for r in group:  # what a later resume checks the record against
                    r["task_fingerprint"] = fingerprints[r["task_id"]]
                    r["run_fingerprint"] = run_fp
                if app is not None:
                    app.write_many(group)
                existing.extend(group)
    ids = {t.id for t in tasks}
    summary = summarize([r for r in existing if r["task_id"] in ids], cfg.k, max_samples=cfg.k)
    summary.update(
        model=model_path,
        seed=seed,
        sampling=cfg.sampling.model_dump(),
        output=str(out),
        skipped=stats.get("skipped", []),
        this_run={
            "samples": stats.get("n_samples", 0),
            "gen_tokens": stats.get("gen_tokens", 0),
            "gen_s": round(stats.get("gen_s", 0.0), 3),
            "tokens_per_s": round(stats["gen_tokens"] / stats["gen_s"], 2) if stats.get("gen_s") else None,
            "verify_s": round(stats.get("verify_s", 0.0), 3),
            **dropped,
        },
    )
    # per-domain tokens/s of this run (all domains share one batch, so it is the run's rate)
    for d in summary["domains"].values():
        d["tokens_per_s"] = summary["this_run"]["tokens_per_s"]
    if main:
        write_json_atomic(sidecar(out, "summary"), summary)
    return dist.broadcast_object(summary, what="rollout: summary")  # rank 0 read the whole file


# -- CLI ----------------------------------------------------------------------------------------


def apply_flags(data: dict, section: str, flags: dict[str, Any]) -> dict:
    """Put non-None CLI flags into ``data[section]`` (dotted keys), so that flags beat the file."""
    sec = data.setdefault(section, {}) or {}
    if not isinstance(sec, dict):
        raise UserError(f"config section '{section}' must be a mapping")
    data[section] = sec
    for key, value in flags.items():
        if value is None or value == ():
            continue
        node = sec
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = list(value) if isinstance(value, tuple) else value
    return data


def sampling_options(f):
    """Sampling flags shared by rollout and eval."""
    for opt in reversed(
        [
            click.option("--temperature", type=float, default=None, help="Sampling temperature (0 = greedy). Default 1.0."),
            click.option("--top-p", type=float, default=None, help="Nucleus sampling mass (1 = off)."),
            click.option("--top-k", type=int, default=None, help="Keep the k most likely tokens (0 = off)."),
            click.option("--min-p", type=float, default=None, help="Min-p truncation (0 = off)."),
            click.option("--max-tokens", type=int, default=None, help="Most tokens per completion. Default 256."),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
            click.option("--batch-size", type=int, default=None, help="Sequences decoded together. Default 64."),
            click.option("--seed", type=int, default=None, help="Seed; each sample's key derives from (seed, task id, sample)."),
            click.option("--max-context", type=int, default=None, help="Context length (default: the model's)."),
        ]
    ):
        f = opt(f)
    return f


def sampling_flags(kw: dict) -> dict:
    return {
        "sampling.temperature": kw.get("temperature"),
        "sampling.top_p": kw.get("top_p"),
        "sampling.top_k": kw.get("top_k"),
        "sampling.min_p": kw.get("min_p"),
        "sampling.max_tokens": kw.get("max_tokens"),
        "sampling.stop": kw.get("stop") or None,
        "batch_size": kw.get("batch_size"),
        "seed": kw.get("seed"),
        "max_context": kw.get("max_context"),
    }


def load_stage_config(config_path, overrides, section: str, flags: dict, model: Optional[str]):
    """(ModelConfig, stage config, raw data) from YAML + --set + flags (flags win)."""
    from mlx_ssp.config import load_file, load_section
    from mlx_ssp.sandbox_policy import install_from_config as install_sandbox_policy

    data = load_file(config_path, overrides)
    if model is not None:
        data["model"] = model
    data = apply_flags(data, section, flags)
    source = str(config_path or "flags")
    from mlx_ssp import distributed as dist

    dist.configure(load_section(data, "distributed", source=source))
    install_sandbox_policy(data, source)
    cfg = load_section(data, section, source=source)
    if getattr(cfg, "seed", 0) is None and "seed" in data:
        cfg.seed = int(data["seed"])
    mcfg = load_section(data, "model", source=source)
    return mcfg, cfg, data


from mlx_ssp.cli import config_option, set_option  # noqa: E402


@click.command("rollout")
@click.option("--model", "model", default=None, help="Model: a directory, a Hugging Face id, or 'demo'.")
@click.option("--tasks", "tasks_path", default=None, help="Task JSONL file.")
@click.option("--k", "k", type=int, default=None, help="Samples per task. Default 8.")
@sampling_options
@click.option("--system", default=None, help="System prompt for tasks that have none.")
@click.option("-o", "--output", default=None, help="rollouts.jsonl to write (resumed if it exists).")
@click.option("--overwrite", is_flag=True, help="Start the output afresh instead of resuming it.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@config_option
@set_option
def cli(model, tasks_path, k, system, output, overwrite, no_progress, config_path, overrides, **kw):
    """Sample K completions per task with behaviour log-probs and verifier rewards.

    Writes ROLLOUTS.jsonl (one record per completion; rerunning resumes it) and
    ROLLOUTS.summary.json (pass@1 / pass@K per domain)."""
    flags = {"k": k, "tasks": tasks_path, "output": output, "system": system, **sampling_flags(kw)}
    mcfg, cfg, _ = load_stage_config(config_path, overrides, "rollout", flags, model)
    if not cfg.tasks:
        raise UserError("no task file: pass --tasks FILE (or set rollout.tasks)")
    if not cfg.output:
        raise UserError("no output: pass -o ROLLOUTS.jsonl (or set rollout.output)")
    summary = run_rollouts(mcfg, cfg.tasks, cfg, cfg.output, overwrite=overwrite, progress=not no_progress)
    from mlx_ssp import distributed as dist

    if not dist.is_main():  # rank 0 reports for all ranks
        return
    click.echo(format_table(summary))
    run = summary["this_run"]
    if run["stale_records"] or run["repeated_records"]:
        click.echo(
            f"note: dropped {run['stale_records']} stale record(s) of {len(run['stale_tasks'])} changed task(s) "
            f"(first: {(run['stale_tasks'] or ['-'])[0]}) and {run['repeated_records']} repeated record(s) from "
            f"{cfg.output}; those samples were generated again", err=True,
        )
    if summary["skipped"]:
        click.echo(f"warning: skipped {len(summary['skipped'])} task(s) whose prompt does not fit the context", err=True)
    click.echo(
        f"{run['samples']} new samples, {run['gen_tokens']} tokens in {run['gen_s']}s "
        f"({run['tokens_per_s']} tok/s), verification {run['verify_s']}s -> {cfg.output}"
    )
