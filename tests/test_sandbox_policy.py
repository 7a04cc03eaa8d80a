"""A task's metadata.sandbox is bounded by the operator's policy: a task may lower
any limit; raising one above the operator's ceiling, or turning the network on without the
operator's permission, is refused before anything runs, naming the key."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlx_ssp.errors import UserError
from mlx_ssp.tasks import Task
from mlx_ssp.verify import check_task


def _task(sandbox: dict) -> Task:
    return Task(id="t", domain="d", prompt="p", verifier="code", answer="assert f() == 1",
                metadata={"entry_point": "f", "sandbox": sandbox})


@pytest.fixture(autouse=True)
def _default_policy(monkeypatch):
    monkeypatch.delenv("MLX_SSP_SANDBOX", raising=False)
    yield
    from mlx_ssp.sandbox_policy import set_policy

    set_policy(None)


@pytest.mark.parametrize("ask, key", [({"network": True}, "network"), ({"wall_s": 30}, "wall_s"),
                                      ({"memory_mb": 1 << 20}, "memory_mb"), ({"tmpfs_mb": 4096}, "tmpfs_mb"),
                                      ({"cpu_s": 6}, "cpu_s"), ({"nproc": 10_000}, "nproc")])
def test_a_task_cannot_lift_limits_or_turn_the_network_on(ask, key):
    with pytest.raises(UserError, match=f"sandbox.{key}"):
        check_task(_task(ask))


def test_a_task_may_lower_limits_and_the_operator_may_allow_more():
    from mlx_ssp.sandbox_policy import SandboxPolicy, set_policy
    from mlx_ssp.verify.code import limits_for

    t = _task({"wall_s": 3, "cpu_s": 1, "memory_mb": 256})
    check_task(t)
    lim = limits_for(t)
    assert (lim.wall_s, lim.cpu_s, lim.memory_mb, lim.network) == (3, 1, 256, False)
    big = _task({"wall_s": 30, "network": True})
    set_policy(SandboxPolicy(wall_s=60, network=True))
    check_task(big)
    assert (limits_for(big).wall_s, limits_for(big).network) == (30, True)
    set_policy(SandboxPolicy(wall_s=2))  # a ceiling below the default lowers the default too
    assert limits_for(_task({})).wall_s == 2
    with pytest.raises(UserError, match="wall_s"):
        check_task(_task({"wall_s": 3}))


def test_bad_requests_name_the_key_and_the_valid_ones():
    with pytest.raises(UserError, match="unknown metadata.sandbox key.*bogus.*valid: wall_s"):
        check_task(_task({"bogus": 1}))
    for bad in ({"cpu_s": 1.5}, {"cpu_s": True}, {"wall_s": "3"}, {"wall_s": -1}):
        with pytest.raises(UserError, match="sandbox"):
            check_task(_task(bad))


def test_the_operator_policy_from_the_environment_config_and_cli(tmp_path, monkeypatch):
    from mlx_ssp.cli import main
    from mlx_ssp.rollout import RolloutConfig

    monkeypatch.setenv("MLX_SSP_SANDBOX", "wall_s=40,network=true")
    check_task(_task({"wall_s": 30, "network": True}))
    monkeypatch.setenv("MLX_SSP_SANDBOX", "wall_s=nope")
    with pytest.raises(UserError, match="MLX_SSP_SANDBOX"):
        check_task(_task({}))
    monkeypatch.delenv("MLX_SSP_SANDBOX")

    from mlx_ssp.config import load_section

    assert load_section({"sandbox": {"wall_s": 30}}, "sandbox").wall_s == 30
    with pytest.raises(UserError, match="unknown sandbox policy key.*valid"):
        load_section({"sandbox": {"walls": 30}}, "sandbox")
    with pytest.raises(UserError, match="sandbox"):  # a stage section no longer holds it
        load_section({"rollout": {"sandbox": {"wall_s": 30}}}, "rollout", cls=RolloutConfig)

    task = _task({"wall_s": 20}).model_dump()
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"task": task, "completion": "```python\ndef f():\n    return 1\n```"}) + "\n")
    r = CliRunner().invoke(main, ["verify", str(inp), "-o", str(tmp_path / "out.jsonl"), "--no-progress"])
    assert r.exit_code == 2 and "wall_s" in r.output and "ceiling" in r.output, r.output
    r = CliRunner().invoke(main, ["verify", str(inp), "-o", str(tmp_path / "out.jsonl"), "--no-progress",
                                  "--sandbox", "wall_s=30"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out.jsonl").read_text())["reward"] == 1.0
    r = CliRunner().invoke(main, ["verify", str(inp), "-o", str(tmp_path / "o2.jsonl"), "--sandbox", "bogus=1"])
    assert r.exit_code == 2 and "bogus" in r.output


def test_every_stage_loader_installs_the_run_files_sandbox_section(tmp_path):
    """One top-level ``sandbox:`` section bounds every stage that may verify code, also when
    ``mlx_ssp run`` resumes past the rollout stage (the policy must not depend on which stage ran)."""
    from mlx_ssp import sandbox_policy
    from mlx_ssp.pipeline import load_run
    from mlx_ssp.commands.sft import load_config as sft_config
    from mlx_ssp.rl.stage import load_config as rl_config
    from mlx_ssp.stage_config import load_stage
    from mlx_ssp.tasks.export import load_tasks_section

    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: demo\ntasks: {domains: {d: {source: 'jsonl:x.jsonl'}}}\nsandbox: {wall_s: 33}\n")
    loaders = {
        "rollout": lambda: load_stage(str(cfg), (), "rollout", flags={}).seeded(),
        "eval": lambda: load_stage(str(cfg), (), "eval", flags={}).seeded(),
        "tasks export": lambda: load_tasks_section(str(cfg), ()),
        "rl": lambda: rl_config(str(cfg), ()),
        "sft": lambda: sft_config(str(cfg), (), False),
        "run": lambda: load_run(str(cfg)),
    }
    try:
        for name, load in loaders.items():
            sandbox_policy.set_policy(None)
            load()
            assert sandbox_policy.get_policy().wall_s == 33, name
            with pytest.raises(ValueError, match="ceiling 33"):
                sandbox_policy.task_limits({"wall_s": 34})
    finally:
        sandbox_policy.set_policy(None)
