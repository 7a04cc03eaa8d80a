"""Imported traces (mlx_ssp.rollout.imported): a jsonl: source with a list of completions per row,
verified by the domain's verifier instead of sampled, then selected like sampled rollouts."""

from __future__ import annotations

import json

import pytest

from mlx_ssp.errors import UserError
from mlx_ssp.rollout import RolloutConfig
from mlx_ssp.rollout.stage import run_rollouts
from mlx_ssp.tasks import load_tasks, write_tasks
from mlx_ssp.tasks.build import build_split
from mlx_ssp.tasks.config import TasksConfig
from mlx_ssp.tasks.file_sources import IMPORTED


def traces_file(path, n=4):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1),
             "gens": [f"Answer: {i + 1}", {"content": "Answer: 0", "reasoning_content": "guess"},
                      {"content": f"Answer: {i + 1}", "reasoning": "count up"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tasks_from(src, params, tmp_path, train=3):
    cfg = TasksConfig.model_validate({"domains": {"add": {
        "source": f"jsonl:{src}", "verifier": "exact", "params": params, "sizes": {"train": train, "probe": 0, "eval": 1}}}})
    out = tmp_path / "train.jsonl"
    write_tasks(out, build_split(cfg, "train"))
    return out


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_imported_completions_verified_selected_and_resumed(tmp_path, tiny_qwen3, monkeypatch):
    from mlx_ssp import models
    from mlx_ssp.rollout import stage as rollout_stage
    from mlx_ssp.select import SelectConfig, run_select

    tf = tasks_from(traces_file(tmp_path / "gens.jsonl"), {"completions_field": "gens"}, tmp_path)
    tasks = load_tasks(tf)
    assert all(len(t.metadata[IMPORTED]) == 3 for t in tasks)
    never = lambda *a, **k: pytest.fail("no model is needed for imported traces")  # noqa: E731
    monkeypatch.setattr(models, "load_model", never)
    monkeypatch.setattr(rollout_stage, "load_model", never)  # the name the stage calls
    out = tmp_path / "r.jsonl"
    summ = run_rollouts(str(tiny_qwen3), tf, RolloutConfig(k=2), out, progress=False)
    recs = lines(out)
    assert sorted((r["task_id"], r["sample"]) for r in recs) == sorted((t.id, s) for t in tasks for s in range(2))
    for r in recs:  # the first two completions of each row; the second is wrong and keeps its reasoning
        assert r["completion"] == (f"Answer: {int(r['prompt'].split()[2]) + 1}" if r["sample"] == 0
                                   else "<think>\nguess\n</think>\n\nAnswer: 0")
        assert r["reward"] == (1.0 if r["sample"] == 0 else 0.0)
        assert r["teacher"] == {"imported": f"jsonl:{tmp_path / 'gens.jsonl'}"}
        assert r["token_ids"] and r["num_tokens"] == len(r["token_ids"])  # the student's tokens
    assert summ["overall"]["pass@1"] == 0.5 and summ["overall"]["pass@2"] == 1.0

    # K above the completions a row has: only what exists, pass@K left undefined, and a rerun adds nothing
    summ3 = run_rollouts(str(tiny_qwen3), tf, RolloutConfig(k=4), tmp_path / "r4.jsonl", progress=False)
    assert len(lines(tmp_path / "r4.jsonl")) == 3 * 3 and summ3["overall"]["pass@4"] is None
    again = run_rollouts(str(tiny_qwen3), tf, RolloutConfig(k=4), tmp_path / "r4.jsonl", progress=False)
    assert again["this_run"]["samples"] == 0 and len(lines(tmp_path / "r4.jsonl")) == 9

    run_select(out, SelectConfig(valid_fraction=0.0), tmp_path / "sel")
    train = lines(tmp_path / "sel" / "add" / "train.jsonl")
    assert len(train) == 3 and all(x["messages"][-1]["content"].startswith("Answer:") for x in train)


def test_imported_beside_an_endpoint_teacher(tmp_path):
    """Tasks with traces take them; the others go to the teacher (here a stub server)."""
    from mlx_ssp.tasks import Task
    from tests.test_endpoint_teacher import Stub, teacher

    imported = load_tasks(tasks_from(traces_file(tmp_path / "gens.jsonl"), {"completions_field": "gens"}, tmp_path))
    plain = [Task(id=f"q{i}", domain="b", prompt=f"What is {i} + 1?", answer=str(i + 1), verifier="exact")
             for i in range(2)]
    tf = tmp_path / "mixed.jsonl"
    write_tasks(tf, imported + plain)
    stub = Stub()
    try:
        run_rollouts(teacher(stub.url), tf, RolloutConfig(k=2), tmp_path / "r.jsonl", progress=False)
    finally:
        stub.close()
    recs = lines(tmp_path / "r.jsonl")
    assert len(recs) == 2 * 5
    asked = sorted(b["messages"][-1]["content"] for b in stub.bodies)
    assert asked == ["What is 0 + 1?", "What is 1 + 1?"]  # only the tasks without traces
    assert {r["teacher"].get("model") for r in recs if r["domain"] == "b"} == {"stub"}
    assert all("imported" in r["teacher"] for r in recs if r["domain"] == "add")


def test_bad_completions_field_is_a_user_error(tmp_path):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2", "gens": "Answer: 2"}) + "\n")
    with pytest.raises(UserError, match="row 1: the completions field must be a non-empty list"):
        tasks_from(src, {"completions_field": "gens"}, tmp_path, train=0)
    src.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2", "gens": [{"text": "2"}]}) + "\n")
    with pytest.raises(UserError, match="completion 0 is neither a string nor a mapping"):
        tasks_from(src, {"completions_field": "gens"}, tmp_path, train=0)
