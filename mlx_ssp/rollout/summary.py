"""pass@1 / pass@k summaries of rollout records (unbiased estimator, Chen et al. 2021 eq. 1, via
:func:`mlx_ssp.metrics.pass_at_k`), the rollout stage's summary file, and their plain-text table."""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

from mlx_ssp.metrics import pass_at_k


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
    index >= ``max_samples`` ignored), mean completion length, the truncated fraction and the mean
    reward (partial credit, e.g. an episode's fraction of turns passed, that pass@k does not count);
    ``overall`` averages over all tasks (task-weighted).

    pass@k needs n >= k (as in :mod:`mlx_ssp.eval`, which refuses n < k): a task with fewer samples
    has ``pass@k: None`` and is left out of the domain's pass@k, whose ``pass@k_tasks`` says how
    many tasks it averages (``None`` when none has k samples), rather than reporting its pass@n
    under the pass@k label."""
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
                # partial credit (an episode's fraction of turns passed) that pass@k does not see
                "mean_reward": sum(r.get("reward") or 0.0 for r in recs) / n,
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
            "mean_reward": sum(t["mean_reward"] * t["n"] for t in task_rows) / n_samples,
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


def stage_summary(records: list[dict], k: int, *, model: str, seed: int, sampling: dict, output: str,
                  stats: dict, dropped: dict) -> dict:
    """The ``.summary.json`` of a rollout file: :func:`summarize` of its records (samples < k) and
    what this run did (samples, tokens, time, records dropped on resume)."""
    summary = summarize(records, k, max_samples=k)
    summary.update(
        model=model,
        seed=seed,
        sampling=sampling,
        output=output,
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
    return summary
