"""Data-parallel stages: 2 ranks (mlx.launch, ring backend, CPU) give what one process gives."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_ssp  # noqa: F401
from mlx_ssp.tasks import Task, write_tasks

from test_distributed import ROOT, free_ports
from test_trackers import one_logdir, scalars

pytestmark = pytest.mark.slow


def tasks_file(path: Path, n: int = 5) -> Path:
    tasks = [
        Task(id=f"q{i}", domain="even" if i % 2 == 0 else "odd", prompt="Count: " + " ".join(["one"] * (i + 1)),
             answer=str(i + 1), verifier="exact")
        for i in range(n)
    ]
    write_tasks(path, tasks)
    return path


def mlx_ssp_cmd(args: list[str], ranks: int | None) -> subprocess.CompletedProcess:
    """``mlx_ssp ARGS`` as one process (ranks None) or under ``mlx.launch -n RANKS``."""
    cmd = [sys.executable, "-m", "mlx_ssp.cli", *args]
    if ranks:
        cmd = ["mlx.launch", "-n", str(ranks), "--backend", "ring", "-p", str(free_ports(ranks)), "--", *cmd]
    env = dict(os.environ, TQDM_DISABLE="1")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)


def read_records(path: Path) -> list[dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: (r["task_id"], r["sample"]))


def assert_same_records(a: list[dict], b: list[dict], tol: float = 1e-4) -> None:
    assert [(r["task_id"], r["sample"]) for r in a] == [(r["task_id"], r["sample"]) for r in b]
    for x, y in zip(a, b):
        assert x["token_ids"] == y["token_ids"], (x["task_id"], x["sample"])
        assert x["completion"] == y["completion"]
        assert x["reward"] == y["reward"] and x["finish_reason"] == y["finish_reason"]
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) <= tol


ROLLOUT = ["--k", "4", "--max-tokens", "12", "--temperature", "1.0", "--seed", "7", "--batch-size", "3", "--no-progress"]


def test_rollout_two_ranks_equal_one_process_and_resume(tiny_qwen3, tmp_path):
    tasks = tasks_file(tmp_path / "tasks.jsonl")
    one, two, resumed = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "resumed.jsonl"
    base = ["rollout", "--model", str(tiny_qwen3), "--tasks", str(tasks), *ROLLOUT]
    r1 = mlx_ssp_cmd([*base, "-o", str(one)], None)
    assert r1.returncode == 0, r1.stderr
    r2 = mlx_ssp_cmd([*base, "-o", str(two)], 2)
    assert "Traceback" not in r2.stderr and "WARN" not in r2.stderr, r2.stderr
    a, b = read_records(one), read_records(two)
    assert len(a) == 20
    assert_same_records(a, b)
    # rank 0 alone wrote the file: every record exactly once, one summary table printed
    assert len(two.read_text().splitlines()) == 20
    assert r2.stdout.count("overall") == 1
    s1 = json.loads((tmp_path / "one.summary.json").read_text())
    s2 = json.loads((tmp_path / "two.summary.json").read_text())
    strip = lambda s: {d: {k: v for k, v in row.items() if k != "tokens_per_s"} for d, row in s["domains"].items()}  # noqa: E731
    assert strip(s1) == strip(s2) and s1["overall"] == s2["overall"]
    assert s2["this_run"]["samples"] == 20
    # resume on 2 ranks: k=2 first (one process), then k=4 adds samples 2 and 3 only
    half = [a if a != "4" else "2" for a in base]
    assert mlx_ssp_cmd([*half, "-o", str(resumed)], None).returncode == 0
    first = resumed.read_text().splitlines()
    r3 = mlx_ssp_cmd([*base, "-o", str(resumed)], 2)
    assert "Traceback" not in r3.stderr, r3.stderr
    lines = resumed.read_text().splitlines()
    assert lines[: len(first)] == first  # the existing records are kept as they were
    assert_same_records(read_records(resumed), a)
    assert json.loads((tmp_path / "resumed.summary.json").read_text())["this_run"]["samples"] == 10


def test_eval_two_ranks_equal_one_process(tiny_qwen3, tmp_path):
    tasks = tasks_file(tmp_path / "tasks.jsonl", n=4)
    args = ["eval", "--model", str(tiny_qwen3), "--tasks", str(tasks), "--k", "2", "--n", "3", "--max-tokens", "10",
            "--seed", "3", "--greedy", "--no-progress"]
    r1 = mlx_ssp_cmd([*args, "-o", str(tmp_path / "one.json")], None)
    assert r1.returncode == 0, r1.stderr
    # the trackers on the 2-rank run only (where the trackers extra is installed, as scripts/test.sh does):
    # e1 == e2 below also shows that they change no output
    tb = importlib.util.find_spec("tensorboard") is not None
    report = ["--report-to", "tensorboard"] if tb else []
    r2 = mlx_ssp_cmd([*args, "-o", str(tmp_path / "two" / "two.json"), *report], 2)
    assert r2.returncode == 0 and "Traceback" not in r2.stderr and "WARN" not in r2.stderr, r2.stderr
    e1 = json.loads((tmp_path / "one.json").read_text())
    e2 = json.loads((tmp_path / "two" / "two.json").read_text())
    for key in ("k", "n", "domains", "overall", "tasks", "skipped", "gen_tokens"):
        assert e1[key] == e2[key], key
    assert r2.stdout.count("overall") == 1
    if not tb:
        return
    # one tracker run, written by rank 0 alone: a single event file, holding the eval JSON's numbers
    logdir = one_logdir(tmp_path / "two", "eval-")
    assert len(list(logdir.iterdir())) == 1, list(logdir.iterdir())
    assert scalars(logdir)["eval/overall/pass@1"] == [(0, pytest.approx(e2["overall"]["pass@1"]))]


@pytest.mark.parametrize("aggregation,optimizer", [("token-mean", "sgd"), ("seq-mean-token-mean", "adam")])
def test_rl_two_ranks_equal_one_process(tiny_qwen3, tmp_path, aggregation, optimizer):
    from test_distributed import WORKER, launch

    env = {"MLX_SSP_TEST_MODEL": str(tiny_qwen3), "AGG": aggregation, "OPT": optimizer}
    one = subprocess.run([sys.executable, str(WORKER), "rl_steps", str(tmp_path / "one")], cwd=ROOT,
                         env=dict(os.environ, **env), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = launch("rl_steps", tmp_path / "two", env=env, timeout=300)
    assert "Traceback" not in two.stderr and "WARN" not in two.stderr, two.stderr
    assert json.loads((tmp_path / "two" / "rank0.json").read_text()) == {"steps": 2, "size": 2}
    m1 = [json.loads(x) for x in (tmp_path / "one" / "rl" / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (tmp_path / "two" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(m1) == len(m2) == 2  # rank 0 alone wrote the metrics
    for a, b in zip(m1, m2):
        # the same rollouts and rewards (whole groups), hence the same MGPO weights and advantages
        for key in ("reward_mean", "pass_rate", "frac_groups_mixed", "gen_tokens", "mgpo_weight_mean", "adv_abs_mean"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
        for key in ("loss", "grad_norm", "behaviour_logp_absdiff"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    import mlx.core as mx

    w1 = mx.load(str(tmp_path / "one" / "rl" / "adapters.safetensors"))
    w2 = mx.load(str(tmp_path / "two" / "rl" / "adapters.safetensors"))
    assert set(w1) == set(w2) and len(w1) > 0
    before = mx.load(str(tmp_path / "one" / "rl" / "checkpoints" / "step_0000001" / "adapters.safetensors"))
    moved = 0.0
    for k in w1:
        diff = mx.abs(w1[k] - w2[k])
        if optimizer == "sgd":  # linear in the gradients: the summed gradients must match closely
            assert float(diff.max().item()) < 1e-5, k
        else:
            # Adam divides by sqrt(v): elements whose gradient is ~0 turn rounding noise (a different
            # summation order) into a visible update; all others agree closely
            assert float((diff > 1e-5).mean().item()) < 0.01, k
            assert float(diff.max().item()) < 2 * 5e-3, k
        moved = max(moved, float(mx.abs(w1[k] - before[k]).max().item()))
    assert moved > 1e-4  # the second step really trained
    assert sorted(p.name for p in (tmp_path / "two" / "rl" / "checkpoints").iterdir()) == ["step_0000001", "step_0000002"]


def test_sft_two_ranks(tiny_qwen3, tmp_path):
    """mlx-lm's trainer shards each batch over the ranks and averages the gradients; probing is
    data parallel too (the rollout engine), rank 0 alone writes checkpoints, metrics and the fused
    specialist."""
    import yaml

    data, probe = tmp_path / "data", tmp_path / "probe.jsonl"
    data.mkdir()
    chat = lambda a, b: {"messages": [{"role": "user", "content": f"What is {a} + {b}?"},  # noqa: E731
                                      {"role": "assistant", "content": f"Answer: {a + b}"}]}
    (data / "train.jsonl").write_text("".join(json.dumps(chat(a, b)) + "\n" for a in range(1, 5) for b in range(1, 4)))
    (data / "valid.jsonl").write_text("".join(json.dumps(chat(a, 9)) + "\n" for a in range(4)))
    probe.write_text("".join(json.dumps({"id": f"p{i}", "domain": "math", "prompt": f"What is {i} + 1?",
                                         "answer": str(i + 1), "verifier": "exact"}) + "\n" for i in range(3)))
    runs = {}
    for name, ranks in (("one", None), ("two", 2)):
        run = {
            "model": str(tiny_qwen3), "run_dir": str(tmp_path / name), "seed": 1,
            "sft": {
                "domains": {"math": {"data": str(data), "probe_tasks": str(probe)}},
                "lora": {"rank": 2, "num_layers": -1}, "learning_rate": 1e-3, "iters": 4, "batch_size": 2,
                "save_every": 2, "report_every": 1, "max_seq_length": 64, "val_batches": 2,
                "probe": {"k": 2, "n": 3, "sampling": {"temperature": 1.0, "max_tokens": 3}, "progress": False},
            },
        }
        cfgp = tmp_path / f"{name}.yaml"
        cfgp.write_text(yaml.safe_dump(run))
        res = mlx_ssp_cmd(["sft", str(cfgp)], ranks)
        assert res.returncode == 0 and "Traceback" not in res.stderr and "WARN" not in res.stderr, res.stderr
        assert res.stdout.count("math: step") == 1  # rank 0 alone reports
        runs[name] = tmp_path / name / "sft"
    one, two = runs["one"] / "math", runs["two"] / "math"
    m1 = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m2] == [r["step"] for r in m1] == [1, 2, 3, 4]  # written once
    for a, b in zip(m1, m2):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
    c1 = [json.loads(x) for x in (one / "probe_curve.jsonl").read_text().splitlines()]
    c2 = [json.loads(x) for x in (two / "probe_curve.jsonl").read_text().splitlines()]
    assert [r["step"] for r in c1] == [r["step"] for r in c2] == [2, 4]
    for a, b in zip(c1, c2):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-3)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert (runs["two"] / "specialists" / "math" / "model.safetensors").is_file()
    assert json.loads((runs["two"] / "summary.json").read_text())["domains"]["math"]["chosen_step"] in (2, 4)
