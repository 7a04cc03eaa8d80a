"""What a testbed model can do: pass@1 per domain and level, how many held-out prompts sit
in the 30-70% pass band (and at 0 and 1), and which strategies its correct samples use (a spectrum
exists when more than one does). Run on fresh problems of every level, K samples each."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Optional

from mlx_ssp.config import validate
from mlx_ssp.rollout import SamplingConfig, generate_rollouts
from mlx_ssp.tasks.build import build_split
from mlx_ssp.tasks.config import TasksConfig
from mlx_ssp.testbed.problems import LEVELS, problem_from_meta, strategies


def strategy_of(domain: str, meta: dict, completion: str) -> str:
    """The name of the strategy whose steps a completion writes (``other`` if none matches)."""
    p = problem_from_meta(domain, meta)
    head = completion.split("answer", 1)[0].strip()
    steps = [s.strip() for s in head.split(";")] if head else []  # no working: ``direct``
    for name, (ref, _) in strategies(p).items():
        if steps == ref:
            return name
    return "other"


def calibrate(model, tokenizer, *, n_per_domain: int = 48, k: int = 8, seed: int = 0, max_tokens: int = 64,
              temperature: float = 1.0, batch_size: int = 256, levels: Optional[dict] = None) -> dict:
    """Pass@1 by domain and level, the pass band and the strategies of the correct samples, on
    held-out problems of every domain in ``levels`` (domain -> (lo, hi); default: all, full range)."""
    out: dict = {"k": k, "domains": {}}
    for d, lv in (levels or LEVELS).items():
        cfg = validate(TasksConfig, {"seed": seed, "domains": {d: {"source": f"testbed:{d}", "params": {"levels": list(lv)},
                                                                  "sizes": {"train": 0, "probe": 0, "eval": n_per_domain}}}})
        tasks = build_split(cfg, "eval")
        recs = generate_rollouts(model, tokenizer, tasks, k=k, sampling=SamplingConfig(temperature=temperature, max_tokens=max_tokens),
                                 seed=seed, batch_size=batch_size, progress=False)
        meta = {t.id: t.metadata for t in tasks}
        acc: dict[str, list[float]] = defaultdict(list)
        used: Counter = Counter()
        for r in recs:
            acc[r["task_id"]].append(r["reward"])
            if r["reward"] >= 1.0:
                used[strategy_of(d, meta[r["task_id"]], r["completion"])] += 1
        per_task = {t: sum(v) / len(v) for t, v in acc.items()}
        by_level: dict[int, list[float]] = defaultdict(list)
        for t, p in per_task.items():
            by_level[meta[t]["level"]].append(p)
        vals = list(per_task.values())
        out["domains"][d] = {
            "pass@1": sum(vals) / len(vals),
            "by_level": {lv: round(sum(v) / len(v), 3) for lv, v in sorted(by_level.items())},
            "band_30_70": sum(0.3 <= v <= 0.7 for v in vals), "at_0": sum(v == 0 for v in vals),
            "at_1": sum(v == 1 for v in vals), "n": len(vals),
            "strategies_of_correct": dict(used.most_common()),
        }
    return out
