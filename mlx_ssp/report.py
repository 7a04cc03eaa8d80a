"""``mlx_ssp report RUN_DIR``: a Markdown summary and PNG plots of a run, readable without JSON.

Reads what the stages wrote (``eval/table.json``, ``select/spectrum.json``,
``sft/<domain>/probe_curve.jsonl``, ``rl/metrics.jsonl`` or each ``rl/phases/<name>/metrics.jsonl``,
``metrics.jsonl``) and writes
``RUN_DIR/report/report.md`` with four figures: pass@k by stage and domain, the specialists' probe
curves with the chosen checkpoint marked, the RL curves (reward, pass rate, MGPO weight, clip
fraction per step) and the spectrum (distinct correct solutions per prompt). Missing stages are
reported as missing, not as errors: a report of a half-finished run is still useful.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from mlx_ssp.errors import UserError
from mlx_ssp.io import atomic_path, write_text_atomic
from mlx_ssp.pipeline import STAGES, STATE_FILE, format_eval_table
from mlx_ssp.plots import _pyplot

#: RL metric keys we plot, with the aliases a metrics row may use for them
RL_SERIES = {
    "reward": ("reward_mean", "reward"),
    "pass rate": ("pass_rate",),
    "MGPO weight": ("mgpo_weight_mean", "weight_mean", "mgpo_weight"),
    "clip fraction": ("clip_frac", "clip_fraction"),
    "pass@1": ("pass@1",),
    "correct length": ("correct_len_mean",),  # Long2Short's effect
}


def _read_json(p: Path) -> Optional[Any]:
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _read_jsonl(p: Path) -> list[dict]:
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line of a running job
    return rows


def _plt():
    return _pyplot()


def _save(fig, path: Path) -> None:
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def _num(x) -> float:
    return math.nan if x is None else float(x)


# -- figures ---------------------------------------------------------------------------------------


def plot_passk(table: dict, path: Path) -> bool:
    """Grouped bars: one group per domain (+ overall), one bar per stage model, pass@k; pass@1 as dots."""
    plt = _plt()
    if plt is None or not table.get("rows"):
        return False
    k = table["k"]
    groups = list(table["domains"]) + ["overall"]
    rows = table["rows"]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(rows) / 3)), 4))
    try:
        for i, r in enumerate(rows):
            vals_k, vals_1 = [], []
            for g in groups:
                v = r["overall"] if g == "overall" else r["domains"].get(g, {})
                vals_k.append(_num(v.get(f"pass@{k}")))
                vals_1.append(_num(v.get("pass@1")))
            xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, vals_k, width=width * 0.95, label=r["stage"], color=f"C{i}", alpha=0.85)
            ax.scatter(xs, vals_1, color="black", s=12, zorder=3, label="pass@1" if i == 0 else None)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups)
        ax.set_ylabel(f"pass@{k} (bars), pass@1 (dots)")
        ax.set_ylim(0, 1.05)
        ax.set_title("Held-out pass@k by stage and domain")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small", ncol=2)
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)
    return True


def plot_probe_curves(curves: dict[str, list[dict]], path: Path) -> bool:
    """One panel per specialist: probe pass@1 and pass@k per checkpoint, the chosen one marked."""
    plt = _plt()
    if plt is None or not curves:
        return False
    n = len(curves)
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.5), squeeze=False)
    try:
        for ax, (dom, rows) in zip(axes[0], curves.items()):
            steps = [r["step"] for r in rows]
            k = next((r.get("k") for r in rows if r.get("k")), "k")
            ax.plot(steps, [_num(r.get("pass@k")) for r in rows], marker="o", label=f"pass@{k}")
            ax.plot(steps, [_num(r.get("pass@1")) for r in rows], marker="s", label="pass@1")
            for r in rows:
                if r.get("chosen"):
                    ax.axvline(r["step"], color="black", linestyle=":", label=f"chosen (step {r['step']})")
            ax.set_title(f"specialist: {dom}")
            ax.set_xlabel("SFT step")
            ax.set_ylim(0, 1.05)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
        axes[0][0].set_ylabel("probe pass rate")
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)
    return True


def rl_series(rows: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    out = {}
    for name, keys in RL_SERIES.items():
        vals = []
        for r in rows:
            v = next((r[k] for k in keys if k in r), None)
            vals.append(_num(v))
        if any(not math.isnan(v) for v in vals):
            out[name] = vals
    return steps, out


def rl_rows(run_dir: Path) -> list[dict]:
    """Every RL step of the run in order, numbered from 1 across phases (``rl.phases``: each phase's
    ``rl/phases/<name>/metrics.jsonl`` in the order config.resolved.yaml lists them; each row gains
    ``phase``), else ``rl/metrics.jsonl``, else (``run_dir`` is an RL stage's output) ``metrics.jsonl``."""
    phases_dir = run_dir / "rl" / "phases"
    names: list[str] = []
    if phases_dir.is_dir():
        try:
            import yaml

            conf = yaml.safe_load((run_dir / "config.resolved.yaml").read_text()) or {}
            names = [p["name"] for p in ((conf.get("rl") or {}).get("phases") or [])]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            names = []
        names = [n for n in names if (phases_dir / n).is_dir()] or sorted(p.name for p in phases_dir.iterdir() if p.is_dir())
    if not names:
        # a run directory (its rl/ stage), or an RL stage's own output directory
        own = run_dir / "metrics.jsonl"
        path = own if own.is_file() and not (run_dir / "rl").is_dir() else run_dir / "rl" / "metrics.jsonl"
        return [r for r in _read_jsonl(path) if "step" in r]
    rows = []
    for n in names:
        for r in _read_jsonl(phases_dir / n / "metrics.jsonl"):
            if "step" in r:
                rows.append({**r, "phase": n, "phase_step": r["step"], "step": len(rows) + 1})
    return rows


def plot_rl(rows: list[dict], path: Path) -> bool:
    plt = _plt()
    steps, series = rl_series(rows)
    if plt is None or not series:
        return False
    n = len(series)
    fig, axes = plt.subplots(1, n, figsize=(3.8 * n, 3.2), squeeze=False)
    try:
        for i, (ax, (name, ys)) in enumerate(zip(axes[0], series.items())):
            ax.plot(steps, ys, marker=".", color=f"C{i}")
            for r0, r1 in zip(rows, rows[1:]):  # phase boundaries
                if r0.get("phase") != r1.get("phase"):
                    ax.axvline(r1["step"] - 0.5, color="0.6", ls="--", lw=0.8)
            ax.set_title(name)
            ax.set_xlabel("RL step")
            ax.grid(True, alpha=0.3)
        fig.suptitle("MGPO-GRPO per step")
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)
    return True


def plot_spectrum(spectrum: dict, path: Path) -> bool:
    """Histogram per domain of distinct correct solutions per prompt."""
    plt = _plt()
    doms = {d: v for d, v in (spectrum or {}).get("domains", {}).items() if v.get("prompts")}
    if plt is None or not doms:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    try:
        top = max(max(p.get("n_distinct_correct", 0) for p in v["prompts"]) for v in doms.values())
        bins = list(range(0, top + 2))
        for i, (d, v) in enumerate(doms.items()):
            xs = [p.get("n_distinct_correct", 0) for p in v["prompts"]]
            ax.hist(xs, bins=bins, alpha=0.5, label=d, color=f"C{i}", align="left", rwidth=0.8)
        ax.set_xlabel("distinct correct solutions per prompt")
        ax.set_ylabel("prompts")
        ax.set_title("Spectrum: distinct correct solutions per prompt (train rollouts)")
        ax.legend(fontsize="small")
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)
    return True


# -- the Markdown summary --------------------------------------------------------------------------


def _f(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _stage_states(run_dir: Path) -> dict[str, dict]:
    return {s: _read_json(run_dir / s / STATE_FILE) or {} for s in STAGES}


def stages_md(run_dir: Path, out: Path) -> list[str]:
    """Status and time of every pipeline stage."""
    md = ["## Stages", "", "| stage | status | time |", "|---|---|---|"]
    for s, st in _stage_states(run_dir).items():
        status = "complete" if st.get("complete") else ("interrupted / running" if st else "not run")
        md.append(f"| {s} | {status} | {_f(st.get('seconds'), 1)} s |" if st.get("seconds") else f"| {s} | {status} | - |")
    return md + [""]


def eval_md(run_dir: Path, out: Path) -> list[str]:
    """The held-out table of eval/table.json and its pass@k figure."""
    table = _read_json(run_dir / "eval" / "table.json")
    md = ["## Held-out evaluation", ""]
    if not table:
        return md + ["(no evaluation yet)", ""]
    md += [format_eval_table(table), ""]
    if plot_passk(table, out / "passk.png"):
        md += ["![pass@k by stage and domain](passk.png)", ""]
    return md


def spectrum_md(run_dir: Path, out: Path) -> list[str]:
    """Per-domain selection numbers of select/spectrum.json and the spectrum histogram."""
    spectrum = _read_json(run_dir / "select" / "spectrum.json")
    md = ["## Spectrum (selection)", ""]
    if not spectrum:
        return md + ["(no selection yet)", ""]
    md += ["| domain | prompts | with a correct solution | distinct correct / prompt | kept / prompt | "
           "mean pairwise distance | SFT examples |", "|---|---|---|---|---|---|---|"]
    for d, v in spectrum.get("domains", {}).items():
        md.append(
            f"| {d} | {v.get('n_prompts')} | {v.get('prompts_with_correct')} | "
            f"{_f(v.get('mean_distinct_correct_per_prompt'), 2)} | {_f(v.get('mean_selected_per_prompt'), 2)} | "
            f"{_f(v.get('mean_pairwise_distance'))} | {v.get('n_train')} |"
        )
    md.append(f"\npolicy: `{spectrum.get('policy')}`\n")
    if plot_spectrum(spectrum, out / "spectrum.png"):
        md += ["![spectrum](spectrum.png)", ""]
    return md


def specialists_md(run_dir: Path, out: Path) -> list[str]:
    """The chosen checkpoint of every specialist (sft/<domain>/probe_curve.jsonl) and the curves."""
    curves = {}
    sft_dir = run_dir / "sft"
    if sft_dir.is_dir():
        for d in sorted(p for p in sft_dir.iterdir() if p.is_dir()):
            rows = _read_jsonl(d / "probe_curve.jsonl")
            if rows:
                curves[d.name] = rows
    md = ["## Specialists (SFT probe curves)", ""]
    if not curves:
        return md + ["(no specialists yet)", ""]
    md += ["| domain | chosen step | probe pass@1 | probe pass@k | checkpoints |", "|---|---|---|---|---|"]
    for d, rows in curves.items():
        ch = next((r for r in rows if r.get("chosen")), {})
        md.append(f"| {d} | {ch.get('step', '-')} | {_f(ch.get('pass@1'))} | {_f(ch.get('pass@k'))} | {len(rows)} |")
    md.append("")
    if plot_probe_curves(curves, out / "probe_curves.png"):
        md += ["![probe curves](probe_curves.png)", ""]
    return md


def rl_md(run_dir: Path, out: Path) -> list[str]:
    """First and last value of every RL series (per phase with ``rl.phases``) and the per-step curves."""
    rows = rl_rows(run_dir)
    md = ["## Signal (MGPO-GRPO)", ""]
    if not rows:
        return md + ["(no RL steps yet)", ""]
    phases = list(dict.fromkeys(r["phase"] for r in rows if "phase" in r))
    names = list(rl_series(rows)[1])
    if phases:
        md += ["| phase | steps | " + " | ".join(f"{n} (first -> last)" for n in names) + " |",
               "|---|---|" + "---|" * len(names)]
        for ph in phases:
            mine = [r for r in rows if r.get("phase") == ph]
            _, ser = rl_series(mine)
            cells = [f"{_f(ser[n][0])} -> {_f(ser[n][-1])}" if n in ser else "-" for n in names]
            md.append(f"| {ph} | {len(mine)} | " + " | ".join(cells) + " |")
        md.append("")
    _, series = rl_series(rows)
    first, last = rows[0], rows[-1]
    md += ["| metric | first step | last step |", "|---|---|---|"]
    for name, ys in series.items():
        md.append(f"| {name} | {_f(ys[0])} | {_f(ys[-1])} |")
    md.append(f"\n{len(rows)} steps (step {first.get('step')} to {last.get('step')}).\n")
    if plot_rl(rows, out / "rl.png"):
        md += ["![RL curves](rl.png)", ""]
    return md


#: the report's sections in order: each reads its stage's outputs, writes its figures into
#: RUN_DIR/report and returns its Markdown lines (a "not yet" line when the stage has not run)
REPORT_SECTIONS = (stages_md, eval_md, spectrum_md, specialists_md, rl_md)


def build_report(run_dir: str | Path) -> Path:
    """Write RUN_DIR/report/report.md (+ PNGs); returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory not found: {run_dir}")
    if not any(_stage_states(run_dir).values()) and not (run_dir / "eval" / "table.json").exists():
        raise UserError(f"{run_dir} does not look like an mlx_ssp run directory (no stage outputs)")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    md: list[str] = [f"# mlx_ssp run report: `{run_dir}`", ""]
    for section in REPORT_SECTIONS:
        md += section(run_dir, out)
    path = out / "report.md"
    write_text_atomic(path, "\n".join(md) + "\n")
    return path


# -- several runs: seeds of one setting, settings side by side ---------------------------------------

#: the per-step series a comparison draws, with a band across each setting's seeds
BAND_SERIES = ("reward", "pass@1")


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample SD over sqrt(n)) of the non-NaN values; NaN where there are
    too few (no mean without values, no error from one)."""
    xs = [x for x in xs if not math.isnan(x)]
    n = len(xs)
    m = sum(xs) / n if n else float("nan")
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else float("nan"))


def seed_band(curves: list[list[float]]) -> tuple[list[float], list[float], list[int]]:
    """Per step: :func:`mean_se` over the runs that reached it (NaNs skipped), and their number.
    Runs may differ in length."""
    mean, se, count = [], [], []
    for t in range(max((len(c) for c in curves), default=0)):
        xs = [c[t] for c in curves if t < len(c) and not math.isnan(c[t])]
        m, e = mean_se(xs)
        mean.append(m)
        se.append(e)
        count.append(len(xs))
    return mean, se, count


def parse_groups(specs: list[str]) -> dict[str, list[Path]]:
    """``LABEL=DIR`` (runs sharing a label are seeds of one setting) or a bare ``DIR`` (its own label;
    an existing directory is always a bare one, ``=`` in its name or not). Labels hold no ``=``."""
    groups: dict[str, list[Path]] = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or Path(spec).is_dir():
            label, path = spec, spec
        p = Path(path)
        if not p.is_dir():
            raise UserError(f"run directory not found: {p}")
        groups.setdefault(label, []).append(p)
    return groups


def plot_bands(curves: dict[str, dict[str, list[list[float]]]], path: Path) -> bool:
    """One panel per series: each setting's mean per step, shaded +- 1 standard error across its seeds."""
    plt = _plt()
    names = [n for n in BAND_SERIES if any(curves[g].get(n) for g in curves)]
    if plt is None or not names:
        return False
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names), 3.4), squeeze=False)
    try:
        for ax, name in zip(axes[0], names):
            for i, (label, by_name) in enumerate(curves.items()):
                if not by_name.get(name):
                    continue
                mean, se, count = seed_band(by_name[name])
                steps = list(range(1, len(mean) + 1))
                ax.plot(steps, mean, color=f"C{i}", label=f"{label} (n={max(count)})")
                ax.fill_between(steps, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)],
                                color=f"C{i}", alpha=0.25, lw=0)  # no band where one run reached the step
            ax.set_title(f"{name} per step (mean +- 1 SE across seeds)", fontsize="small")
            ax.set_xlabel("RL step")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="x-small")
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)
    return True


def _fmt_mean_se(xs: list[float]) -> str:
    m, se = mean_se(xs)
    return "-" if math.isnan(m) else (f"{m:.3f} (1 run)" if math.isnan(se) else f"{m:.3f} +- {se:.3f}")


def build_comparison(specs: list[str], out: str | Path, window: int = 10) -> Path:
    """Write OUT/compare.md and OUT/rl_bands.png for several runs: per setting (label) the number of
    seeds, each series' mean over the first and last ``window`` steps (mean +- standard error across
    seeds), the held-out gain where a run holds a ``learning.json`` (``scripts/testbed.py spread
    --keep``), and the per-step bands."""
    groups = parse_groups(specs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, dict[str, list[list[float]]]] = {}
    any_gain = False
    md = ["# mlx_ssp comparison", "", "Settings and their runs (seeds): " +
          "; ".join(f"`{g}`: {len(ps)}" for g, ps in groups.items()), "",
          "| setting | runs | " + " | ".join(f"{n}, first {window} steps | {n}, last {window} steps" for n in BAND_SERIES)
          + " | held-out pass@1 gain |", "|---|---|" + "---|---|" * len(BAND_SERIES) + "---|"]
    for label, paths in groups.items():
        curves[label] = {}
        cells = []
        series = [rl_series(rl_rows(p))[1] for p in paths]  # each run's metrics read once
        for name in BAND_SERIES:
            per_run = [ser.get(name, []) for ser in series]
            per_run = [c for c in per_run if c]  # rl_series keeps a series only where it has a value
            curves[label][name] = per_run
            first = [mean_se(c[:window])[0] for c in per_run]  # a NaN step does not drop a run
            last = [mean_se(c[-window:])[0] for c in per_run]
            cells += [_fmt_mean_se(first), _fmt_mean_se(last)]
        gains = [(_read_json(p / "learning.json") or {}).get("gain") for p in paths]
        gains = [float(g) for g in gains if isinstance(g, (int, float))]
        any_gain = any_gain or bool(gains)
        md.append(f"| {label} | {len(paths)} | " + " | ".join(cells) + f" | {_fmt_mean_se(gains)} |")
    if not any_gain and not any(curves[g][n] for g in curves for n in BAND_SERIES):
        raise UserError("none of the runs has RL metrics (rl/metrics.jsonl) or a learning.json to compare")
    md.append("")
    if plot_bands(curves, out / "rl_bands.png"):
        md += ["![per-step curves with a band across seeds](rl_bands.png)", ""]
    path = out / "compare.md"
    write_text_atomic(path, "\n".join(md) + "\n")
    return path
