"""The one stage loader: its seed rule, its run-directory rule, the note about the old defaults."""

from pathlib import Path

import pytest

from mlx_ssp.errors import UserError
from mlx_ssp.stage_config import default_run_dir, load_stage, note_old_default


def _file(tmp_path, text):
    f = tmp_path / "exp1.yaml"
    f.write_text("model: demo\n" + text)
    return f


def test_seed_rule_section_then_top_level_then_zero(tmp_path):
    assert load_stage(_file(tmp_path, ""), (), "rl").seed == 0
    assert load_stage(_file(tmp_path, "seed: 4\n"), (), "rl").seed == 4
    assert load_stage(_file(tmp_path, "seed: 4\nrl: {seed: 9}\n"), (), "rl").seed == 9
    assert load_stage(_file(tmp_path, "seed: 4\nrl: {seed: 9}\n"), ()).seed == 4  # no section: top level
    st = load_stage(_file(tmp_path, "seed: 4\n"), (), "rollout")
    assert st.cfg.seed is None and st.seeded().seed == 4  # seeded() is a copy
    with pytest.raises(UserError, match="seed: must be an integer"):
        load_stage(_file(tmp_path, "seed: abc\n"), (), "rl")


def test_run_dir_rule(tmp_path):
    assert default_run_dir({"run_dir": "~/x"}, "a/b.yaml") == Path("~/x").expanduser()
    assert default_run_dir({}, "a/exp.yaml") == Path("runs/exp")
    assert default_run_dir({}, None) == Path("runs")
    st = load_stage(_file(tmp_path, ""), (), "sft")
    assert st.run_dir == Path("runs/exp1") and not st.run_dir_set
    assert load_stage(_file(tmp_path, ""), ("run_dir=elsewhere",), "sft").run_dir_set


def test_note_names_the_old_default_only_when_it_holds_a_run(tmp_path, capsys):
    st = load_stage(_file(tmp_path, ""), (), "sft")
    old, new = tmp_path / "run" / "sft", tmp_path / "runs" / "exp1" / "sft"
    note_old_default(st, old, new, "pass --set run_dir=run")
    assert capsys.readouterr().err == ""
    old.mkdir(parents=True)
    note_old_default(st, old, new, "pass --set run_dir=run")
    assert f"note: {old} holds an earlier run" in capsys.readouterr().err
    new.mkdir(parents=True)
    note_old_default(st, old, new, "pass --set run_dir=run")
    assert capsys.readouterr().err == ""


def test_loader_configures_distributed_from_the_file(tmp_path, monkeypatch):
    from mlx_ssp import distributed as dist

    monkeypatch.delenv("MLX_SSP_DIST_TIMEOUT", raising=False)
    try:
        load_stage(_file(tmp_path, "distributed: {timeout_s: 42}\n"), (), "eval")
        assert dist.settings().timeout_s == 42
    finally:
        dist.configure(None)
