"""pass@1 / pass@k per domain with the unbiased estimator (the measuring stick of every stage).

For each task, draw n >= k samples with the rollout engine (:func:`mlx_ssp.rollout.generate`,
same seeds and batching), count the c verified-correct ones, and report per domain the mean over
tasks of pass@1 = c/n and pass@k = 1 - C(n-c, k)/C(n, k) (Chen et al. 2021, eq. 1;
:func:`mlx_ssp.metrics.pass_at_k`). ``overall`` is the task-weighted mean over all domains. With
``greedy`` a second, greedy pass (T=0, one sample per task) adds ``greedy_pass@1``.

Choices: ``n`` defaults to k (the estimator is then the plain "any of k correct" rate); larger n
lowers its variance. Tasks whose prompt does not fit the context are skipped and counted
(``skipped``), not scored as failures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field, model_validator

from mlx_ssp import distributed as dist
from mlx_ssp import trackers
from mlx_ssp.config import StrictModel
from mlx_ssp.errors import UserError
from mlx_ssp.io import write_json_atomic
from mlx_ssp.models import ModelConfig, load_model
from mlx_ssp.rollout import RolloutRequest, SamplingConfig, generate, stage_settings, summarize
from mlx_ssp.tasks import Task, load_tasks


class EvalConfig(StrictModel):
    """The ``eval:`` section of a run file."""

    k: int = Field(8, ge=1)
    n: Optional[int] = Field(None, ge=1)  # samples per task (default k; must be >= k)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    greedy: bool = False  # also report greedy pass@1
    batch_size: int = Field(64, ge=1)
    seed: Optional[int] = None
    tasks: Optional[str] = None
    output: Optional[str] = None
    max_context: Optional[int] = Field(None, ge=2)
    system: Optional[str] = None
    prefill_batch_size: Optional[int] = Field(None, ge=1)  # sequences prefilled together; None: 1 on CPU, 8 on GPU
    OMIT_AT_DEFAULT = frozenset({"prefill_batch_size"})  # added after runs existed: old fingerprints kept

    @model_validator(mode="after")
    def _n_ge_k(self):
        if self.n is not None and self.n < self.k:
            raise ValueError(f"n ({self.n}) must be >= k ({self.k})")
        return self


def evaluate(model, tokenizer, tasks: list[Task], *, k: int, n: Optional[int] = None, greedy: bool = False,
             model_name: Optional[str] = None, **settings) -> dict:
    """Returns ``{"model", "k", "n", "domains": {D: {"n_tasks", "pass@1", "pass@K", ...}},
    "overall": {...}, "tasks": [{"task_id", "n", "c", "pass@1", "pass@K", ...}], "skipped": [...]}``.
    ``settings``: the other fields of :class:`mlx_ssp.rollout.RolloutRequest` (``sampling`` required;
    seed, batch size, context, system prompt, progress; the progress bar says ``eval``)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserError(f"k must be an integer >= 1, got {k!r}")
    n = k if n is None else n
    if n < k:
        raise UserError(f"n ({n}) must be >= k ({k})")
    settings.setdefault("progress_label", "eval")
    settings.setdefault("logprobs", False)  # only completions are scored
    request = RolloutRequest(tasks=tasks, k=n, verify=True, **settings)
    sampling, seed = request.sampling, request.seed
    stats: dict = {}
    recs = generate(model, tokenizer, request, stats=stats)
    result = summarize(recs, k)
    # summarize() keys pass@k on its k argument but uses all n samples of each task
    result.update(
        model=model_name,
        n=n,
        sampling=sampling.model_dump(),
        seed=seed,
        skipped=stats.get("skipped", []),
        gen_tokens=stats.get("gen_tokens", 0),
        gen_s=round(stats.get("gen_s", 0.0), 3),
        verify_s=round(stats.get("verify_s", 0.0), 3),
    )
    if greedy:
        gsampling = sampling.model_copy(update={"temperature": 0.0})
        grecs = generate(model, tokenizer, request.replace(k=1, sampling=gsampling))
        gsum = summarize(grecs, 1)
        for d, row in result["domains"].items():
            row["greedy_pass@1"] = gsum["domains"].get(d, {}).get("pass@1")
        result["overall"]["greedy_pass@1"] = gsum["overall"].get("pass@1")
        greedy_by_task = {t["task_id"]: t["pass@1"] for t in gsum["tasks"]}
        for t in result["tasks"]:
            t["greedy_correct"] = greedy_by_task.get(t["task_id"])
    # a stable key order: model, k first
    head = {key: result.pop(key) for key in ("model", "k", "n")}
    return {**head, **result}


def run_eval(model_spec, tasks_path, cfg: EvalConfig, out: str | Path, *, progress: bool = True) -> dict:
    """Load tasks (errors first), then the model, evaluate, write ``out`` atomically."""
    tasks = load_tasks(tasks_path)
    mcfg = model_spec if isinstance(model_spec, ModelConfig) else ModelConfig(path=str(model_spec))
    model, tokenizer, path = load_model(mcfg)
    result = evaluate(model, tokenizer, tasks, k=cfg.k, n=cfg.n, greedy=cfg.greedy, model_name=str(path),
                      progress=progress, **stage_settings(cfg))
    result["tasks_file"] = str(tasks_path)

    if dist.is_main():  # the ranks sampled their shares; rank 0 writes
        write_json_atomic(out, result)
        trackers.log("", trackers.without(result, "sampling", "seed"), step=0)  # eval/overall/pass@1, eval/domains/...
    return result
