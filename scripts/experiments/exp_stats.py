"""The experiments' statistics and tables (pure functions): per-task scores of an eval result, paired
differences with their standard errors (every model is evaluated on the same tasks with the same
sampling seed, so differences are paired per task), a one-sample t-test, the two-way (seeds x
tasks) standard error, and the Markdown formatting of the results.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from mlx_ssp.errors import UserError
from mlx_ssp.metrics import pass_at_k


def task_table(res: dict, k: int) -> dict[str, dict]:
    """task id -> {"domain", "pass@1", "pass@k"} of one eval result."""
    out = {}
    for t in res["tasks"]:
        out[t["task_id"]] = {"domain": t["domain"], "pass@1": t["pass@1"],
                             "pass@k": t[f"pass@{k}"]}
    return out


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) by its continued fraction (Lentz's method),
    evaluated on the side where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-14:
            break
    return front * (f - 1.0)


def t_test(xs: list[float]) -> Optional[dict]:
    """One-sample two-sided t-test of mean 0 over ``xs`` (e.g. one paired difference per seed):
    {"t", "df", "p", "positive", "negative"}; None below two values or with no spread."""
    m, se = mean_se(xs)
    if se is None or se == 0.0:
        return None
    t, df = m / se, len(xs) - 1
    p = _betainc(df / 2.0, 0.5, df / (df + t * t))
    return {"t": t, "df": df, "p": p, "positive": sum(x > 0 for x in xs), "negative": sum(x < 0 for x in xs)}


def two_way_se(diffs: dict[Any, dict[str, float]]) -> Optional[dict]:
    """The SE of a paired difference measured on the same tasks under several seeds
    (``diffs``: seed -> task -> difference), in its two components: across seeds (the sd of the
    seed means / sqrt(seeds): a new training run) and across tasks (the sd of the task means /
    sqrt(tasks): a new draw of tasks), and both together (their root sum of squares, conservative:
    the seed x task interaction is counted in each). Only tasks every seed has are used."""
    seeds = [s for s in diffs if diffs[s]]
    if len(seeds) < 2:
        return None
    tasks = sorted(set.intersection(*(set(diffs[s]) for s in seeds)))
    if len(tasks) < 2:
        return None
    _, se_seeds = mean_se([sum(diffs[s][t] for t in tasks) / len(tasks) for s in seeds])
    mean, se_tasks = mean_se([sum(diffs[s][t] for s in seeds) / len(seeds) for t in tasks])
    return {"mean": mean, "se_seeds": se_seeds, "se_tasks": se_tasks, "se": math.hypot(se_seeds, se_tasks),
            "seeds": len(seeds), "tasks": len(tasks)}


def mean_se(xs: list[float]) -> tuple[Optional[float], Optional[float]]:
    """Mean and standard error of the mean (sample sd / sqrt(n)); SE None below two values."""
    n = len(xs)
    if n == 0:
        return None, None
    m = sum(xs) / n
    if n < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def samples_setting(raw, key: str, what: str = "samples per task") -> Optional[tuple[int, list[int]]]:
    """A ``{n, ks}`` setting (n samples per task, pass@k at each k) as (n, sorted ks), None when
    null; anything else fails before any work, naming ``key``."""
    if raw is None:
        return None
    valid = f"null or {{n: {what}, ks: [k, ...] with 1 <= k <= n, the largest >= 2}}"
    if not isinstance(raw, dict) or set(raw) != {"n", "ks"}:
        raise UserError(f"{key}: {raw!r} is not valid; valid: {valid}")
    n, ks = raw["n"], raw["ks"]

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(n) or n < 1 or not isinstance(ks, list) or not ks or not all(is_int(k) and 1 <= k <= n for k in ks) \
            or max(ks) < 2:  # a rule or a curve named pass@<largest k> needs more than pass@1
        raise UserError(f"{key}: {raw!r} is not valid; valid: {valid}")
    return n, sorted(set(ks))


def pass_at_ks(res: dict, ks: list[int], domain: str) -> dict[int, float]:
    """k -> mean over the domain's tasks of the unbiased pass@k from each task's n samples."""
    rows = [t for t in res["tasks"] if t["domain"] == domain]
    return {k: sum(pass_at_k(t["n"], t["c"], k) for t in rows) / len(rows) for k in ks}


def scores(res: dict, k: int, domain: Optional[str] = None) -> dict:
    """pass@1 and pass@k (mean over tasks) with their standard errors across tasks."""
    rows = [r for r in task_table(res, k).values() if domain is None or r["domain"] == domain]
    p1, se1 = mean_se([r["pass@1"] for r in rows])
    pk, sek = mean_se([r["pass@k"] for r in rows])
    return {"n_tasks": len(rows), "pass@1": p1, "pass@1_se": se1, "pass@k": pk, "pass@k_se": sek}


def task_diffs(a: dict, b: dict, k: int, domain: Optional[str] = None) -> dict[str, list[float]]:
    """metric -> [b - a for every task both results share] (same tasks, same sampling seeds)."""
    ta, tb = task_table(a, k), task_table(b, k)
    ids = sorted(i for i in ta if i in tb and (domain is None or ta[i]["domain"] == domain))
    return {m: [tb[i][m] - ta[i][m] for i in ids] for m in ("pass@1", "pass@k")}


def task_diff_map(a: dict, b: dict, k: int, domain: Optional[str] = None, metric: str = "pass@1") -> dict[str, float]:
    """task id -> b - a of ``metric`` (``pass@1`` or ``pass@k``) for every task both results share."""
    ta, tb = task_table(a, k), task_table(b, k)
    return {i: tb[i][metric] - ta[i][metric] for i in sorted(ta) if i in tb and (domain is None or ta[i]["domain"] == domain)}


def paired(a: dict, b: dict, k: int, domain: Optional[str] = None) -> dict:
    """b - a per shared task: mean difference and its SE (sd of the per-task differences / sqrt(n))."""
    diffs = task_diffs(a, b, k, domain)
    out = {"n_tasks": len(diffs["pass@1"])}
    for m, xs in diffs.items():
        out[f"d_{m}"], out[f"d_{m}_se"] = mean_se(xs)
    return out


def fmt(x: Optional[float], se: Optional[float] = None, signed: bool = False) -> str:
    if x is None:
        return "-"
    s = f"{x:+.3f}" if signed else f"{x:.3f}"
    return s if se is None else f"{s} ± {se:.3f}"


def fdiff(d: dict, metric: str) -> str:
    """A paired difference from :func:`paired` as "+x.xxx ± se"."""
    return fmt(d[f"d_{metric}"], d[f"d_{metric}_se"], signed=True)


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)

