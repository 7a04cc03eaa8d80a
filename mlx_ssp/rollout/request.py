"""One rollout request: what to sample (tasks, K, sampling, seed) and how (batch size, context,
system prompt, verification), passed whole from the stages (rollout, eval, RL) to the engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from mlx_ssp.errors import UserError
from mlx_ssp.errors import UserError as _E
from mlx_ssp.rollout.config import SamplingConfig
from mlx_ssp.stage_config import section_seed
from mlx_ssp.tasks import Task, check_tasks
from mlx_ssp.verify import check_task


@dataclass(frozen=True)
class RolloutRequest:
    """K samples of each task. ``seed`` keys every sample's noise stream with (task id, sample
    index); ``max_context`` defaults to the model's; ``system`` is added to tasks that have none;
    parallel (sandboxed) verifiers run on ``verify_workers`` threads."""

    tasks: list[Task]
    k: int
    sampling: SamplingConfig
    seed: int = 0
    batch_size: int = 64
    verify: bool = True
    progress: bool = True
    progress_label: str = "rollout"  # what the progress bar calls the pass
    max_context: Optional[int] = None
    system: Optional[str] = None
    verify_workers: int = 4
    prefill_batch_size: Optional[int] = None  # None: auto (prefill_batch)
    share_prefix: bool = True  # the K samples of a prompt start from one prefilled cache (Decoder.insert_shared)
    #: tasks without the answer their verifier needs: an error (False), or sampled unverified (True;
    #: reward None, reason "unlabelled": what select.pseudo_label votes on)
    unlabelled: bool = False
    #: each token's behaviour log-prob in the records (RL needs them); eval and probes, which only
    #: score completions, turn them off: a tempered softmax over the vocabulary per token saved.
    #: Episodes keep them whatever this says.
    logprobs: bool = True

    def check(self) -> None:
        """Bad K, no tasks or (when verifying) tasks the verifiers cannot score: a UserError."""
        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise UserError(f"k must be an integer >= 1, got {k!r}")
        if not self.tasks:
            raise UserError("no tasks to roll out (the task list is empty)")
        if self.verify:
            check_tasks([t for t in self.tasks if t.id not in self.unlabelled_ids()])

    def unlabelled_ids(self) -> set[str]:
        """Ids of the tasks sampled without verification: with ``unlabelled``, those without an
        answer whose verifier needs one (its task check fails without it)."""
        if not self.unlabelled:
            return set()

        out = set()
        for t in self.tasks:
            if t.answer is None:
                try:
                    check_task(t)
                except _E:
                    out.add(t.id)
        return out

    def wanted(self, task_id: str, samples: Optional[dict[str, list[int]]]) -> list[int]:
        """The sample indices of a task to generate: all K, or (a resume) those ``samples`` names."""
        return list(range(self.k)) if samples is None else sorted(samples.get(task_id, []))

    def prefill_batch(self, episodes: bool = False) -> int:
        """Sequences admitted and prefilled together per generator step. Auto: mlx-lm's default
        (``min(batch_size, 8)``), except for episodes on the CPU: there the returning conversations'
        new tokens (tool results, the next user turn) are tens to hundreds of tokens of uneven length,
        a prefill of that size already keeps the cores busy, and padding them to the longest (history
        and new tokens) only adds work (measured 1.26x faster at 1, BENCHMARKS.md). Single-turn
        samples keep 8: with shared prefixes their prompt is one token, and admitting only one
        sequence per step would keep the batch from filling."""
        if self.prefill_batch_size is not None:
            return min(self.prefill_batch_size, self.batch_size)
        if episodes:
            import mlx.core as mx

            if mx.default_device() == mx.cpu:
                return 1
        return min(self.batch_size, 8)

    def replace(self, **changes: Any) -> RolloutRequest:
        return dataclasses.replace(self, **changes)


def stage_settings(cfg) -> dict[str, Any]:
    """The request fields a stage section (``rollout:``, ``eval:``) sets: sampling, seed (None -> 0),
    batch size, context, system prompt, and verify workers and prefill batch where the section has them."""
    out = {"sampling": cfg.sampling, "seed": section_seed(cfg, 0), "batch_size": cfg.batch_size,
           "max_context": cfg.max_context, "system": cfg.system}
    for name in ("verify_workers", "prefill_batch_size", "unlabelled"):
        if hasattr(cfg, name):
            out[name] = getattr(cfg, name)
    return out
