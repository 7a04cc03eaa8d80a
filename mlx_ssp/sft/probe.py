"""Probing checkpoints: Pass@K on a probe set (:func:`default_probe`), the probe curve of a domain's
checkpoints (:func:`read_curve`, :func:`write_curve`) and the selection rule (:func:`select_checkpoint`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional

from mlx_ssp.errors import UserError
from mlx_ssp.eval import evaluate
from mlx_ssp.finetune.checkpoints import list_checkpoints
from mlx_ssp.io import write_jsonl_atomic
from mlx_ssp.plots import line_chart
from mlx_ssp.sft.config import SELECT_RULES, ProbeConfig, SFTConfig
from mlx_ssp.stage_config import section_seed


def _neg(x: Optional[float]) -> float:
    return -x if x is not None and not math.isnan(x) else math.inf


def _pos(x: Optional[float]) -> float:
    return x if x is not None and not math.isnan(x) else math.inf


def select_checkpoint(rows: list[dict], rule: str) -> int:
    """Index of the chosen checkpoint among ``rows`` (dicts with step, pass@1, pass@k, val_loss).

    Rules: ``pass@k`` (highest), ``pass@1`` (highest), ``val_loss`` (lowest). Ties (within 1e-9)
    go to the other probe metric, then the lower validation loss, then the earlier step. A missing
    metric ranks last."""
    if rule not in SELECT_RULES:
        raise UserError(f"unknown selection rule '{rule}'; valid: {', '.join(SELECT_RULES)}")
    if not rows:
        raise ValueError("no checkpoints to choose from")
    # rank by a tuple of keys compared with a tolerance, in order
    keys: dict[str, list[Callable[[dict], float]]] = {
        "pass@k": [lambda r: _neg(r.get("pass@k")), lambda r: _neg(r.get("pass@1")), lambda r: _pos(r.get("val_loss"))],
        "pass@1": [lambda r: _neg(r.get("pass@1")), lambda r: _neg(r.get("pass@k")), lambda r: _pos(r.get("val_loss"))],
        "val_loss": [lambda r: _pos(r.get("val_loss"))],
    }
    best = 0
    for i in range(1, len(rows)):
        for key in keys[rule]:
            a, b = key(rows[i]), key(rows[best])
            if math.isinf(a) and math.isinf(b) or abs(a - b) <= 1e-9:
                continue
            if a < b:
                best = i
            break
        else:  # a full tie: the earlier step wins
            if rows[i]["step"] < rows[best]["step"]:
                best = i
    return best


def probe_seed(cfg: SFTConfig, seed: int) -> int:
    """The seed rule one level down: ``sft.probe.seed``, else the sft stage's seed."""
    return section_seed(cfg.probe, seed)


def read_curve(ddir: Path) -> list[dict]:
    """One row per complete checkpoint: step, loss, val_loss, learning_rate, pass@1, pass@k (None if
    not probed yet)."""
    rows = []
    for p in list_checkpoints(ddir / "checkpoints"):
        st = json.loads((p / "state.json").read_text())
        pr = json.loads((p / "probe.json").read_text()) if (p / "probe.json").is_file() else {}
        rows.append(
            {
                "step": st["step"],
                "loss": st.get("train_loss"),
                "val_loss": st.get("val_loss"),
                "learning_rate": st.get("learning_rate"),
                "pass@1": pr.get("pass@1"),
                "pass@k": pr.get("pass@k"),
                "k": pr.get("k"),
                "n_tasks": pr.get("n_tasks"),
            }
        )
    return rows


def write_curve(ddir: Path, domain: str, rule: str) -> Optional[dict]:
    """Write probe_curve.jsonl (+ PNG) from the checkpoints; ``chosen`` marks the current choice."""
    rows = read_curve(ddir)
    if not rows:
        return None
    probed = [r for r in rows if r["pass@k"] is not None]
    chosen = None
    if probed:
        chosen = probed[select_checkpoint(probed, rule)]
    for r in rows:
        r["chosen"] = chosen is not None and r["step"] == chosen["step"]
    write_jsonl_atomic(ddir / "probe_curve.jsonl", rows)
    k = next((r["k"] for r in rows if r["k"]), "k")
    line_chart(
        ddir / "probe_curve.png",
        [r["step"] for r in rows],
        {"pass@1": [r["pass@1"] for r in rows], f"pass@{k}": [r["pass@k"] for r in rows]},
        secondary={"train loss": [r["loss"] for r in rows], "val loss": [r["val_loss"] for r in rows]},
        secondary_label="loss",
        title=f"SFT specialist '{domain}': probe curve (rule {rule})",
        xlabel="step",
        ylabel="probe pass rate",
        ylim=(-0.02, 1.02),
        vline=chosen["step"] if chosen else None,
        vline_label=f"chosen (step {chosen['step']})" if chosen else "",
    )
    return chosen


ProbeFn = Callable[..., dict]


def default_probe(model, tokenizer, tasks: list, probe: ProbeConfig, seed: int) -> dict:
    """K samples per probe task through the rollout engine; Pass@K (unbiased) and Pass@1."""
    res = evaluate(
        model, tokenizer, tasks, k=probe.k, n=probe.n, sampling=probe.sampling, seed=seed,
        batch_size=probe.batch_size, progress=probe.progress, progress_label="sft probe", system=probe.system,
    )
    overall = res["overall"]
    if not overall.get("n_tasks"):
        raise UserError(f"no probe task could be sampled (all {len(tasks)} skipped: prompts longer than the context)")
    return {
        "pass@1": float(overall["pass@1"]),
        "pass@k": float(overall[f"pass@{probe.k}"]),
        "n_probed": overall["n_tasks"],
        "mean_tokens": overall.get("mean_tokens"),
        "truncated_frac": overall.get("truncated_frac"),
    }


