"""``mlx_ssp report`` over several runs: per-step means with a band across seeds."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

import mlx_ssp  # noqa: F401


def test_seed_band_is_mean_and_standard_error_per_step():
    from mlx_ssp.report import seed_band

    mean, se, n = seed_band([[0.0, 1.0, 2.0], [2.0, 3.0], [1.0, float("nan"), 5.0]])
    assert mean == [1.0, 2.0, 3.5] and n == [3, 2, 2]
    assert se[0] == pytest.approx(1.0 / math.sqrt(3)) and se[1] == pytest.approx(math.sqrt(2.0) / math.sqrt(2))
    mean, se, n = seed_band([[0.3, 0.4]])
    assert mean == [0.3, 0.4] and n == [1, 1] and all(math.isnan(e) for e in se)  # one seed: no error claimed


def _run(root, name, rewards, gain=None):
    d = root / name
    (d / "rl").mkdir(parents=True)
    (d / "rl" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "reward_mean": r, "pass@1": r}) + "\n" for i, r in enumerate(rewards)))
    if gain is not None:
        (d / "learning.json").write_text(json.dumps({"gain": gain}))
    return d


def test_comparison_groups_seeds_by_label_and_draws_bands(tmp_path):
    from mlx_ssp.cli import main
    from mlx_ssp.report import build_comparison

    a0 = _run(tmp_path, "a0", [0.2, 0.4, 0.6], gain=0.3)
    a1 = _run(tmp_path, "a1", [0.4, 0.6, 0.8], gain=0.1)
    b0 = _run(tmp_path, "b0", [0.5, 0.5, 0.5])
    md = build_comparison([f"grpo={a0}", f"grpo={a1}", f"mgpo={b0}"], tmp_path / "w2", window=2).read_text()
    rows = {line.split("|")[1].strip(): line.strip() for line in md.splitlines() if line.startswith(("| grpo", "| mgpo"))}
    # over the two grpo seeds: first 2 steps 0.3 / 0.5, last 2 steps 0.5 / 0.7; gains 0.3 / 0.1
    assert rows["grpo"] == ("| grpo | 2 | 0.400 +- 0.100 | 0.600 +- 0.100 | 0.400 +- 0.100 | 0.600 +- 0.100 "
                            "| 0.200 +- 0.100 |")
    assert rows["mgpo"] == "| mgpo | 1 | " + "0.500 (1 run) | " * 4 + "- |"
    out = tmp_path / "cmp"
    r = CliRunner().invoke(main, ["report", f"grpo={a0}", f"grpo={a1}", f"mgpo={b0}", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "compare.md").is_file() and (out / "rl_bands.png").stat().st_size > 1000


def test_comparison_refuses_what_it_cannot_compare(tmp_path):
    from mlx_ssp.cli import main
    from mlx_ssp.errors import UserError
    from mlx_ssp.report import build_comparison

    a = _run(tmp_path, "a", [0.1])
    r = CliRunner().invoke(main, ["report", str(a), str(a)])
    assert r.exit_code != 0 and "--out" in r.output
    with pytest.raises(UserError, match="not found"):
        build_comparison([f"x={tmp_path / 'missing'}"], tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="none of the runs"):
        build_comparison([f"x={tmp_path / 'empty'}"], tmp_path / "o")
    # SFT rounds kept by `spread --keep`: no RL curves, but their held-out gains compare
    for i, g in enumerate((0.1, 0.3)):
        (tmp_path / f"sft{i}").mkdir()
        (tmp_path / f"sft{i}" / "learning.json").write_text(json.dumps({"gain": g}))
    md = build_comparison([f"sft={tmp_path / 'sft0'}", f"sft={tmp_path / 'sft1'}"], tmp_path / "o").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| sft |"))
    assert row.startswith("| sft | 2 | - |") and row.endswith("| 0.200 +- 0.100 |")
    # a directory whose name holds "=" is a bare run, not LABEL=DIR
    odd = _run(tmp_path, "lr=3e-4", [0.2])
    assert build_comparison([str(odd)], tmp_path / "o2").read_text().count(f"| {odd} | 1 |") == 1


def test_an_rl_stage_output_directory_is_a_run(tmp_path):
    """The experiments' RL runs are RL output directories (metrics.jsonl at their top): the same
    steps as a run directory holding them under rl/."""
    from mlx_ssp.report import rl_rows

    run = _run(tmp_path, "run", [0.1, 0.3])
    assert [r["reward_mean"] for r in rl_rows(run / "rl")] == [0.1, 0.3] == [r["reward_mean"] for r in rl_rows(run)]
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.9}) + "\n")
    assert [r["reward_mean"] for r in rl_rows(run)] == [0.1, 0.3]  # a run's own rl/ comes first
