"""What a tool-use testbed model can do: pass@1 per backend and level on held-out episodes, how many
sit in the 30-70% pass band (and at 0 and 1), the turn pass rate, and how its episodes end. K sampled
episodes per task, scored by the episode verifier (BFCL's rules)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

from mlx_ssp.config import validate
from mlx_ssp.rollout import SamplingConfig, generate_rollouts
from mlx_ssp.tasks.build import build_split
from mlx_ssp.tasks.config import TasksConfig
from mlx_ssp.testbed.tools.space import BACKENDS


def eval_tasks(n_per_backend: int, seed: int, backends: Sequence[str] = BACKENDS, levels: tuple[int, int] = (1, 4),
               space: str = "held_out") -> list:
    """The eval split of each backend's ``testbed_tools`` domain."""
    domains = {f"tt_{b}": {"source": f"testbed_tools:{b}", "params": {"levels": list(levels), "eval_space": space},
                           "sizes": {"train": 0, "probe": 0, "eval": n_per_backend}} for b in backends}
    return build_split(validate(TasksConfig, {"seed": seed, "domains": domains}), "eval")


def calibrate_tools(model, tokenizer, *, n_per_backend: int = 24, k: int = 8, seed: int = 0, max_tokens: int = 48,
                    temperature: float = 1.0, batch_size: int = 64, backends: Sequence[str] = BACKENDS,
                    space: str = "held_out") -> dict:
    """Pass@1 by backend and level, the pass band, the turn pass rate and the episodes' endings."""
    tasks = eval_tasks(n_per_backend, seed, backends, space=space)
    recs = generate_rollouts(model, tokenizer, tasks, k=k, sampling=SamplingConfig(temperature=temperature, max_tokens=max_tokens),
                             seed=seed, batch_size=batch_size, progress=False)
    meta = {t.id: t for t in tasks}
    out: dict = {"k": k, "space": space, "backends": {}}
    by_backend: dict[str, dict] = defaultdict(lambda: {"acc": defaultdict(list), "turns": [], "ends": Counter()})
    for r in recs:
        t = meta[r["task_id"]]
        b = by_backend[t.domain.removeprefix("tt_")]
        b["acc"][r["task_id"]].append(r["reward"])
        b["turns"].append(r.get("partial", 0.0))
        b["ends"][r.get("finish_reason") or "?"] += 1
    for name, b in sorted(by_backend.items()):
        per_task = {tid: sum(v) / len(v) for tid, v in b["acc"].items()}
        by_level: dict[int, list[float]] = defaultdict(list)
        for tid, p in per_task.items():
            by_level[meta[tid].metadata.get("level", 0)].append(p)
        vals = list(per_task.values())
        out["backends"][name] = {
            "pass@1": round(sum(vals) / len(vals), 4),
            "turns_passed": round(sum(b["turns"]) / len(b["turns"]), 4),
            "by_level": {lv: round(sum(v) / len(v), 3) for lv, v in sorted(by_level.items())},
            "band_30_70": sum(0.3 <= v <= 0.7 for v in vals), "at_0": sum(v == 0 for v in vals),
            "at_1": sum(v == 1 for v in vals), "n": len(vals), "endings": dict(b["ends"]),
        }
    return out
