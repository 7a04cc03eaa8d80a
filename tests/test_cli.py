"""The CLI contract: every stage listed with help; user mistakes are one line and exit 2."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from mlx_ssp.cli import COMMANDS, main

STAGES = ["rollout", "select", "sft", "merge", "rl", "eval", "run", "report", "tasks", "verify", "models", "doctor"]


def test_help_lists_every_stage():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for s in STAGES:
        assert s in COMMANDS
        assert f"\n  {s} " in r.output


def test_each_command_has_real_help():
    runner = CliRunner()
    for s in STAGES:
        r = runner.invoke(main, [s, "--help"])
        assert r.exit_code == 0, (s, r.output)
        assert len(r.output.splitlines()) >= 3, (s, r.output)


def test_user_error_is_one_line_exit_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_ssp.cli", "models", "resolve", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "does not exist" in r.stderr


def test_doctor_reports_blas_and_gflops():
    r = CliRunner().invoke(main, ["doctor"])
    assert r.exit_code == 0, r.output
    for key in ("platform", "mlx ", "mlx-lm", "backends", "BLAS", "GFLOP/s"):
        assert key in r.output
    if sys.platform.startswith("linux"):
        from mlx_ssp import _blas

        if _blas.loaded_path:
            assert "OpenBLAS" in r.output
            assert "few-row matmul kernel" in r.output
        else:
            assert "libopenblas0-pthread" in r.output  # says what to do
        assert "merge's native passes" in r.output
