"""Many episodes at once through one mlx-lm ``BatchGenerator``.

Every in-flight episode owns one sequence of the generator at a time: one assistant message. When
a sequence ends (an end-of-message token, or ``max_tokens`` for the message), it leaves the batch
with its KV cache (mlx-lm hands the cache of a finished sequence back with its last response); the
episode parses and runs its calls (:class:`mlx_ssp.agents.episode.Episode`) and, unless it is over,
re-enters the generator at once as a new sequence whose prompt is only what is new (the last
sampled token, which the cache has not seen yet, then the rendered tool results or next user turn)
and whose cache is the one it left with. So the history is never prefilled twice, the batch refills
while tools run, and episodes of different lengths interleave freely (continuous batching).
``reuse_cache=False`` re-prefills the whole conversation for each message instead (the baseline
the benchmark compares against; same tokens).

Reproducibility: message j of sample s of task t draws its noise from the stream of
``(seed, t, s, j)`` (:func:`message_stream`), so an episode's tokens depend on its own identity and
logits only, never on which episodes share its batch or the order they run in; batched equals one
at a time (tests). At most ``batch_size`` episodes are in flight (each holds a cache).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator, Optional

from mlx_ssp.agents.episode import Deltas, Episode
from mlx_ssp.models import model_context_length
from mlx_ssp.rollout.decoder import Decoder
from mlx_ssp.rollout.records import TaskGroups
from mlx_ssp.rollout.request import RolloutRequest
from mlx_ssp.errors import UserError
from mlx_ssp.rollout.scoring import timed_verify
from mlx_ssp.sampling import sample_stream_seed
from mlx_ssp.tasks import render_prompt


def message_stream(seed: int, task_id: str, sample: int, message: int) -> int:
    """The noise stream of one assistant message of an episode (message 0: the sample's own stream)."""
    return sample_stream_seed(seed, task_id if message == 0 else f"{task_id}\x1em{message}", sample)


class _Live:
    """One in-flight assistant message: its episode (and task index) and the tokens drawn so far."""

    __slots__ = ("ti", "ep", "tokens", "lps")

    def __init__(self, ti: int, ep: Episode):
        self.ti, self.ep, self.tokens, self.lps = ti, ep, [], []


class EpisodeRun:
    """The generator, the episodes in flight and the bookkeeping of one :func:`run_episodes` call."""

    def __init__(self, model, tokenizer, request: RolloutRequest, work: list[tuple[int, int]], stats: dict,
                 *, reuse_cache: bool, context: Optional[int]):
        if request.sampling.stop:
            raise UserError("stop strings are not supported for episode tasks (a message ends at the end-of-message token)")
        self.tokenizer, self.request, self.stats = tokenizer, request, stats
        self.work, self.next_work = work, 0
        self.reuse_cache, self.context = reuse_cache, context
        self.deltas = Deltas(tokenizer)
        self.eos = set(tokenizer.eos_token_ids)
        self.dec = Decoder(model, tokenizer, request, total=len(work), unit="episode", desc="episodes", episodes=True)
        self.live: dict[int, _Live] = {}
        self.groups = TaskGroups(Counter(ti for ti, _ in work))
        self.ready: list[list[dict]] = []  # task groups completed, not yet handed out
        self.prompts: dict[int, list[int]] = {}

    def _budget(self, ep: Episode) -> int:
        max_tokens = self.request.sampling.max_tokens
        if self.context is None:
            return max_tokens
        return min(max_tokens, self.context - len(ep.prompt_ids) - len(ep.ids))

    def _insert(self, ti: int, ep: Episode, prompt: list[int], cache) -> None:
        budget = self._budget(ep)
        stream = message_stream(self.request.seed, ep.task.id, ep.sample, ep.n_messages)
        (uid,) = self.dec.insert([prompt], [budget], [stream], caches=None if cache is None else [cache])
        self.live[uid] = _Live(ti, ep)
        self.stats["prompt_tokens"] += len(prompt)

    def top_up(self) -> None:
        """Start episodes until ``batch_size`` are in flight; the samples of one task started together
        share the prefill of its first prompt (:meth:`Decoder.insert_shared`)."""
        while self.next_work < len(self.work) and len(self.live) < self.request.batch_size:
            ti = self.work[self.next_work][0]
            room = self.request.batch_size - len(self.live)
            group = []
            while self.next_work < len(self.work) and self.work[self.next_work][0] == ti and len(group) < room:
                group.append(self.work[self.next_work][1])
                self.next_work += 1
            task = self.request.tasks[ti]
            if ti not in self.prompts:
                self.prompts[ti] = render_prompt(self.tokenizer, task, system=self.request.system)
            eps = [Episode(task, s, self.prompts[ti]) for s in group]
            if self._budget(eps[0]) <= 0:  # the first turn alone does not fit the context
                for ep in eps:
                    ep.stop("context")
                    self._finish(ti, ep)
                continue
            streams = [message_stream(self.request.seed, task.id, ep.sample, 0) for ep in eps]
            uids = self.dec.insert_shared(self.prompts[ti], [self._budget(ep) for ep in eps], streams)
            for uid, ep in zip(uids, eps):
                self.live[uid] = _Live(ti, ep)
            self.stats["prompt_tokens"] += len(self.prompts[ti]) * len(eps)

    def take_ready(self) -> list[list[dict]]:
        out, self.ready = self.ready, []
        return out

    def step(self) -> None:
        """One generator step; task groups whose every episode is now scored go to ``ready``."""
        responses = self.dec.gen.next_generated()
        if not responses:
            return
        lps = self.dec.path.step_logprobs(responses)
        self.stats["gen_tokens"] += len(responses)
        for r, lp in zip(responses, lps):
            lv = self.live[r.uid]
            lv.tokens.append(r.token)
            lv.lps.append(lp)
            if r.finish_reason is None:
                continue
            del self.live[r.uid]
            self.dec.path.release(r.uid)
            self._message_done(lv, r.prompt_cache)
        self.top_up()

    def _message_done(self, lv: _Live, cache) -> None:
        ep, toks = lv.ep, lv.tokens
        ended = toks[-1] if toks and toks[-1] in self.eos else None
        text = self.tokenizer.decode(toks[:-1] if ended is not None else toks)
        ended_with = self.tokenizer.decode([ended]) if ended is not None else None
        nxt = ep.on_message(list(toks), list(lv.lps), text, self.deltas, ended_with)
        if nxt is not None and self._budget(ep) <= 0:
            ep.stop("context")
        if ep.done:
            self._finish(lv.ti, ep)
        elif self.reuse_cache and cache is not None:
            # mlx-lm 0.32's BatchGenerator runs the forward on a token before handing it out, so the
            # cache has seen the last sampled token (older versions: all but it); feeding it again
            # conditioned every later message on a duplicated token, off the recorded conversation
            seen = len(ep.prompt_ids) + len(ep.ids) - len(nxt)
            head = [] if getattr(cache[0], "offset", seen - 1) >= seen else [toks[-1]]
            self._insert(lv.ti, ep, head + nxt, cache)
        else:
            self._insert(lv.ti, ep, ep.prompt_ids + ep.ids, None)

    def _finish(self, ti: int, ep: Episode) -> None:
        rec = ep.record(self.dec.lp_temp)
        if self.request.verify:
            res, dt = timed_verify(ep.messages, ep.task)
            self.stats["verify_s"] += dt
            rec.update(reward=float(res.reward), reason=res.reason, detail=res.detail, verify_s=round(dt, 5))
            rec.update(res.extra or {})
        if self.dec.bar is not None:
            self.dec.bar.update(1)
        grp = self.groups.add(ti, rec)
        if grp is not None:
            self.ready.append(grp)

    def close(self) -> None:
        self.dec.close(self.stats)


def run_episodes(model, tokenizer, request: RolloutRequest, *, samples: Optional[dict[str, list[int]]] = None,
                 stats: Optional[dict] = None, reuse_cache: bool = True) -> Iterator[list[dict]]:
    """Yield the records of each episode task of ``request`` once all its samples are scored (the
    contract of :func:`mlx_ssp.rollout.engine.run_request`, which hands episode tasks here)."""
    stats = stats if stats is not None else {}
    for k, v in (("gen_tokens", 0), ("prompt_tokens", 0), ("gen_s", 0.0), ("verify_s", 0.0), ("n_samples", 0)):
        stats.setdefault(k, v)
    work = [(ti, s) for ti, task in enumerate(request.tasks) for s in request.wanted(task.id, samples)]
    if not work:
        return
    context = request.max_context or model_context_length(model)
    run = EpisodeRun(model, tokenizer, request, work, stats, reuse_cache=reuse_cache, context=context)
    try:
        run.top_up()
        while True:
            for grp in run.take_ready():
                stats["n_samples"] += len(grp)
                yield grp
            if not run.live:
                break
            run.step()
    finally:
        run.close()
