"""The batched generation loop: a :class:`RolloutRequest` in, each task's scored records out.

Steps: render every prompt and plan the (task, sample) work (:func:`plan_work`; prompts that do not
fit the context are skipped); queue about two batches of sequences into one mlx-lm
``BatchGenerator`` (its continuous-batching loop is the decoding loop; each sequence carries the
noise stream of ``(seed, task id, sample index)``); per step, append each returned token and its
behaviour log-prob (the :class:`mlx_ssp.sampling.SamplingPath` in use), match stop strings, and
turn each finished sequence into a record (:mod:`.records`) that :mod:`.scoring` verifies; a task's
records are handed out together once all its samples are scored.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional

from mlx_ssp import distributed as dist
from mlx_ssp.agents.episode import is_episode
from mlx_ssp.models import model_context_length
from mlx_ssp.rollout.decoder import Decoder
from mlx_ssp.rollout.records import LiveSequence, TaskGroups, build_record, completion_text
from mlx_ssp.rollout.request import RolloutRequest
from mlx_ssp.rollout.scoring import Scorer
from mlx_ssp.rollout.stops import StopMatcher
from mlx_ssp.sampling import sample_stream_seed
from mlx_ssp.tasks import render_prompt

log = logging.getLogger("mlx_ssp.rollout")


@dataclass
class WorkPlan:
    """(task index, sample index) pairs in generation order, with each task's prompt ids and token
    budget (``max_tokens`` clamped so prompt + completion fit the context)."""

    work: list[tuple[int, int]] = field(default_factory=list)
    prompts: dict[int, list[int]] = field(default_factory=dict)
    budget: dict[int, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def plan_work(tokenizer, request: RolloutRequest, samples: Optional[dict[str, list[int]]],
              context: Optional[int]) -> WorkPlan:
    """Render every prompt first, so that a template error surfaces before any generation."""
    plan = WorkPlan()
    max_tokens = request.sampling.max_tokens
    for ti, task in enumerate(request.tasks):
        wanted = request.wanted(task.id, samples)
        if not wanted:
            continue
        ids = render_prompt(tokenizer, task, system=request.system)
        if context is not None and len(ids) >= context:
            plan.skipped.append(task.id)
            continue
        plan.prompts[ti] = ids
        plan.budget[ti] = max_tokens if context is None else min(max_tokens, context - len(ids))
        plan.work.extend((ti, s) for s in wanted)
    return plan


def _runs(chunk: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """Consecutive work items of the same task: ``[(task index, [sample, ...]), ...]`` in order."""
    out: list[tuple[int, list[int]]] = []
    for ti, s in chunk:
        if out and out[-1][0] == ti:
            out[-1][1].append(s)
        else:
            out.append((ti, [s]))
    return out


def _warn_skipped(skipped: list[str], context: Optional[int]) -> None:
    msg = f"skipped {len(skipped)} task(s) whose prompt does not fit the context of {context} tokens (first: {skipped[0]})"
    warnings.warn(msg, stacklevel=3)  # the code iterating the rollouts
    log.warning(msg)


class _Generation:
    """One pass of the loop over a plan: the generator, the live sequences and the progress bar."""

    def __init__(self, model, tokenizer, request: RolloutRequest, plan: WorkPlan, stats: dict):
        self.model, self.tokenizer, self.request, self.plan, self.stats = model, tokenizer, request, plan, stats
        self.stops = StopMatcher(request.sampling.stop)
        self.dec = Decoder(model, tokenizer, request, total=len(plan.work), unit="sample", desc=request.progress_label)
        self.gen, self.bar, self.lp_temp = self.dec.gen, self.dec.bar, self.dec.lp_temp
        self.live: dict[int, LiveSequence] = {}
        groups = TaskGroups(Counter(ti for ti, _ in plan.work))
        try:
            self.scorer = Scorer(request.tasks, groups, stats, verify=request.verify, workers=request.verify_workers,
                                 unlabelled=frozenset(request.unlabelled_ids()))
        except BaseException:
            self.dec.close({})  # the decoder's thread count and model mode back before the error goes on
            raise
        self.next_work = 0
        self.t_start = self.last_bar = self.dec.t_start

    @property
    def more_work(self) -> bool:
        return self.next_work < len(self.plan.work)

    def top_up(self) -> None:
        """Keep about two batches queued: enough to refill, without one cache object per sample up front."""
        plan, req = self.plan, self.request
        n = min(2 * req.batch_size - len(self.live), len(plan.work) - self.next_work)
        if n <= 0:
            return
        chunk = plan.work[self.next_work : self.next_work + n]
        self.next_work += n
        now = time.perf_counter()
        uids = []
        for ti, group in _runs(chunk):  # the samples of one prompt together: they share its prefill
            streams = [sample_stream_seed(req.seed, req.tasks[ti].id, s) for s in group]
            uids += self.dec.insert_shared(plan.prompts[ti], [plan.budget[ti]] * len(group), streams)
        for uid, (ti, s) in zip(uids, chunk):
            seq = LiveSequence(uid, ti, s, now, plan.budget[ti])
            if self.stops:
                seq.detok = self.tokenizer.detokenizer
            self.live[uid] = seq
        self.stats["prompt_tokens"] += sum(len(plan.prompts[ti]) for ti, _ in chunk)

    def step(self) -> Optional[list[list[dict]]]:
        """One generator step: the task groups it completed (None: nothing came back, more queued)."""
        responses = self.gen.next_generated()
        if not responses:
            if self.more_work:
                self.top_up()
                return None
            raise RuntimeError(f"mlx-lm's BatchGenerator stopped with {len(self.live)} sequence(s) unfinished")
        lps = self.dec.path.step_logprobs(responses)
        self.stats["gen_tokens"] += len(responses)
        finished, to_remove = [], []
        for i, r in enumerate(responses):
            seq = self.live[r.uid]
            seq.tokens.append(r.token)
            if lps is not None:  # None: the request asked for no log-probs (records keep an empty list)
                seq.lps.append(lps[i])
            reason, stop_hit = r.finish_reason, None
            if seq.detok is not None and reason != "stop":  # an EOS ends the sequence anyway
                stop_hit = self.stops.scan(seq, r.token)
                if stop_hit is not None:
                    if reason is None:
                        to_remove.append(r.uid)
                    reason = "stop"
            if reason is not None:
                del self.live[r.uid]
                grp = self.finish(seq, reason, stop_hit)
                if self.bar is not None:
                    self.bar.update(1)
                if grp is not None:
                    finished.append(grp)
        if to_remove:
            self.gen.remove(to_remove)
        self._show_rate()
        if self.more_work and len(self.live) < 2 * self.request.batch_size:
            self.top_up()
        if self.scorer.pending:
            finished.extend(self.scorer.collect(wait=False))
        return finished

    def finish(self, seq: LiveSequence, reason: str, stop_hit: Optional[str]) -> Optional[list[dict]]:
        task = self.request.tasks[seq.task_idx]
        text = completion_text(self.tokenizer, seq, reason, stop_hit)
        rec = build_record(task, seq, self.plan.prompts[seq.task_idx], text, reason, stop_hit, self.lp_temp)
        self.dec.path.release(seq.uid)
        return self.scorer.score(seq.task_idx, task, rec, text)

    def _show_rate(self) -> None:
        if self.bar is not None and time.perf_counter() - self.last_bar > 0.5:
            self.last_bar = time.perf_counter()
            self.bar.set_postfix_str(f"{self.stats['gen_tokens'] / (self.last_bar - self.t_start):.1f} tok/s", refresh=False)

    def close(self) -> None:
        try:
            self.scorer.close()
        finally:  # the decoder's scopes (thread count, rotary swap) are undone even if the scorer fails
            self.dec.close(self.stats)


def run_request(model, tokenizer, request: RolloutRequest, *, samples: Optional[dict[str, list[int]]] = None,
                stats: Optional[dict] = None) -> Iterator[list[dict]]:
    """Yield the records of each task of ``request`` as soon as all its samples are scored
    (completion order). ``samples``: task id -> the sample indices to generate (default
    ``range(k)``; a resume passes the missing ones). ``stats`` (if given) is filled with
    ``skipped`` (ids of tasks whose prompt does not fit), ``gen_tokens``, ``prompt_tokens``,
    ``gen_s`` (wall time of the loop), ``verify_s`` (summed verifier time), ``n_samples``."""
    request.check()
    stats = stats if stats is not None else {}
    stats.update(skipped=[], gen_tokens=0, prompt_tokens=0, gen_s=0.0, verify_s=0.0, n_samples=0)

    episodes = [t for t in request.tasks if is_episode(t)]
    if episodes:  # multi-turn tasks run as episodes (mlx_ssp.agents.engine); the rest below
        from mlx_ssp.agents.engine import run_episodes  # lazy: agents.engine imports this module

        yield from run_episodes(model, tokenizer, request.replace(tasks=episodes), samples=samples, stats=stats)
        if len(episodes) == len(request.tasks):
            return
        request = request.replace(tasks=[t for t in request.tasks if not is_episode(t)])
    context = request.max_context or model_context_length(model)
    plan = plan_work(tokenizer, request, samples, context)
    stats["skipped"].extend(plan.skipped)
    if plan.skipped:
        _warn_skipped(plan.skipped, context)
    if not plan.work:
        return
    run = _Generation(model, tokenizer, request, plan, stats)
    run.dec.gen_s_before = stats["gen_s"]  # the episode pass's, when the request had both kinds
    try:
        run.top_up()
        while run.live:
            groups = run.step()
            if groups is None:
                continue
            stats["gen_s"] = run.dec.gen_s_before + time.perf_counter() - run.t_start
            stats["n_samples"] += sum(len(g) for g in groups)
            yield from groups
        if run.scorer.pending:
            groups = run.scorer.collect(wait=True)
            stats["n_samples"] += sum(len(g) for g in groups)
            yield from groups
    finally:
        run.close()


def iter_sharded(model, tokenizer, request: RolloutRequest, samples: dict[str, list[int]], *, stats: Optional[dict],
                 round_size: Optional[int] = None) -> Iterator[list[dict]]:
    """:func:`run_request` over the ranks (one process: exactly that); rank 0 alone shows progress."""
    req = request if dist.is_main() else request.replace(progress=False)
    return dist.iter_sharded_groups(lambda subset, st: run_request(model, tokenizer, req, samples=subset, stats=st),
                                    samples, stats=stats, round_size=round_size)


def generate(model, tokenizer, request: RolloutRequest, *, stats: Optional[dict] = None) -> list[dict]:
    """All records of ``request`` in memory, ordered by (task order, sample index)."""
    if dist.size() > 1:  # data parallel: each rank samples its share, records gathered
        request.check()
        groups = iter_sharded(model, tokenizer, request, {t.id: list(range(request.k)) for t in request.tasks}, stats=stats)
    else:
        groups = run_request(model, tokenizer, request, stats=stats)
    order = {t.id: i for i, t in enumerate(request.tasks)}
    out = [r for group in groups for r in group]
    out.sort(key=lambda r: (order[r["task_id"]], r["sample"]))
    return out


def iter_rollouts(model, tokenizer, tasks, *, samples=None, stats=None, **settings) -> Iterator[list[dict]]:
    """:func:`run_request` with the request spelled as keywords (the fields of :class:`RolloutRequest`)."""
    return run_request(model, tokenizer, RolloutRequest(tasks=tasks, **settings), samples=samples, stats=stats)


def generate_rollouts(model, tokenizer, tasks, *, stats=None, **settings) -> list[dict]:
    """:func:`generate` with the request spelled as keywords (the fields of :class:`RolloutRequest`):
    K completions per task, one dict per completion, keys as in :mod:`mlx_ssp.rollout`. Tasks whose
    prompt does not fit the context are skipped (warning; ids in ``stats["skipped"]``)."""
    return generate(model, tokenizer, RolloutRequest(tasks=tasks, **settings), stats=stats)
