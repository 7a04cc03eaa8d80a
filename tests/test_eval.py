"""pass@1 / pass@k evaluation on a tiny model with a deterministic test verifier."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlx_ssp.cli import main
from mlx_ssp.errors import UserError
from mlx_ssp.eval import evaluate
from mlx_ssp.metrics import pass_at_k
from mlx_ssp.rollout import SamplingConfig, generate_rollouts
from mlx_ssp.tasks import Task, write_tasks
from mlx_ssp.verify import VERIFIERS, VerifyResult, register


@pytest.fixture(scope="module")
def parity_verifier():
    """Correct when the completion has an even number of characters: about half the samples."""

    @register("_test_parity")
    def parity(completion, task):
        ok = len(completion) % 2 == 0
        return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer")

    yield "_test_parity"
    VERIFIERS.pop("_test_parity", None)


@pytest.fixture(scope="module")
def qwen(tiny_qwen3):
    from mlx_lm import load

    return load(str(tiny_qwen3))


def make_tasks(verifier, n=6):
    return [Task(id=f"e{i}", domain="x" if i % 3 else "y", prompt=f"Count to {i}.", answer="1", verifier=verifier)
            for i in range(n)]


def test_pass_at_k_from_the_samples(qwen, parity_verifier):
    model, tok = qwen
    tasks = make_tasks(parity_verifier)
    sc = SamplingConfig(temperature=1.0, max_tokens=9)
    res = evaluate(model, tok, tasks, k=2, n=5, sampling=sc, seed=2, batch_size=7, progress=False, model_name="tiny")
    assert res["model"] == "tiny" and res["k"] == 2 and res["n"] == 5
    recs = generate_rollouts(model, tok, tasks, k=5, sampling=sc, seed=2, batch_size=3, progress=False)
    per_task = {}
    for r in recs:
        n, c = per_task.get(r["task_id"], (0, 0))
        per_task[r["task_id"]] = (n + 1, c + (r["reward"] == 1.0))
    for t in res["tasks"]:
        assert (t["n"], t["c"]) == per_task[t["task_id"]]
        assert t["pass@2"] == pytest.approx(pass_at_k(5, t["c"], 2))
    for dom in ("x", "y"):
        ids = [t.id for t in tasks if t.domain == dom]
        row = res["domains"][dom]
        assert row["n_tasks"] == len(ids)
        assert row["pass@1"] == pytest.approx(sum(per_task[i][1] / 5 for i in ids) / len(ids))
        assert row["pass@2"] == pytest.approx(sum(pass_at_k(5, per_task[i][1], 2) for i in ids) / len(ids))
        assert row["pass@2"] >= row["pass@1"]
    assert res["overall"]["n_tasks"] == 6
    assert 0 < res["overall"]["pass@1"] < 1  # the parity verifier splits the samples


def test_greedy_column(qwen, parity_verifier):
    model, tok = qwen
    tasks = make_tasks(parity_verifier, n=3)
    res = evaluate(model, tok, tasks, k=1, sampling=SamplingConfig(max_tokens=6), greedy=True, progress=False)
    g = generate_rollouts(model, tok, tasks, k=1, sampling=SamplingConfig(temperature=0, max_tokens=6), progress=False)
    want = {r["task_id"]: r["reward"] for r in g}
    assert {t["task_id"]: t["greedy_correct"] for t in res["tasks"]} == want
    assert res["overall"]["greedy_pass@1"] == pytest.approx(sum(want.values()) / 3)


def test_bad_k(qwen, parity_verifier):
    model, tok = qwen
    with pytest.raises(UserError, match="k must be"):
        evaluate(model, tok, make_tasks(parity_verifier), k=0, sampling=SamplingConfig(), progress=False)
    with pytest.raises(UserError, match="n .* must be >= k"):
        evaluate(model, tok, make_tasks(parity_verifier), k=4, n=2, sampling=SamplingConfig(), progress=False)


def test_eval_cli_writes_json_and_table(tmp_path, tiny_qwen3, parity_verifier):
    tf = tmp_path / "t.jsonl"
    write_tasks(tf, make_tasks(parity_verifier, n=4))
    out = tmp_path / "eval.json"
    res = CliRunner().invoke(main, ["eval", "--model", str(tiny_qwen3), "--tasks", str(tf), "--k", "3",
                                    "--temperature", "0.8", "--max-tokens", "6", "--greedy", "--no-progress", "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["k"] == 3 and data["model"] == str(tiny_qwen3)
    assert set(data["domains"]) == {"x", "y"}
    for row in [*data["domains"].values(), data["overall"]]:
        assert {"n_tasks", "pass@1", "pass@3", "greedy_pass@1"} <= set(row)
    assert "pass@3" in res.output and "greedy_pass@1" in res.output and "overall" in res.output
    bad = CliRunner().invoke(main, ["eval", "--model", str(tiny_qwen3), "--tasks", str(tf), "--k", "0", "-o", str(out)])
    assert bad.exit_code == 2 and "k" in bad.output
