"""`mlx_ssp rollout`: the file, the summary, resuming after a crash, and bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlx_ssp.cli import main
from mlx_ssp.tasks import Task, write_tasks


def tasks_file(path, n=4, verifier="exact"):
    tasks = [Task(id=f"q{i}", domain="a" if i < 2 else "b", prompt=f"What is {i} + 1?", answer=str(i + 1),
                  verifier=verifier) for i in range(n)]
    write_tasks(path, tasks)
    return path


def run(args):
    res = CliRunner().invoke(main, ["rollout", "--no-progress", *args])
    return res


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_rollout_writes_records_and_summary(tmp_path, tiny_qwen3):
    tf = tasks_file(tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    res = run(["--model", str(tiny_qwen3), "--tasks", str(tf), "--k", "3", "--max-tokens", "12",
               "--temperature", "0.9", "--batch-size", "5", "--seed", "1", "-o", str(out)])
    assert res.exit_code == 0, res.output
    recs = lines(out)
    assert len(recs) == 12 and {(r["task_id"], r["sample"]) for r in recs} == {(f"q{i}", s) for i in range(4) for s in range(3)}
    summ = json.loads((tmp_path / "r.summary.json").read_text())
    assert set(summ["domains"]) == {"a", "b"}
    for d in summ["domains"].values():
        assert {"n_tasks", "pass@1", "pass@3", "mean_tokens", "tokens_per_s"} <= set(d)
        assert d["n_tasks"] == 2
    assert summ["this_run"]["gen_tokens"] == sum(r["num_tokens"] for r in recs)
    assert "pass@3" in res.output and "tok/s" in res.output


def test_resume_after_crash_gives_the_same_file(tmp_path, tiny_qwen3):
    tf = tasks_file(tmp_path / "t.jsonl", n=5)
    args = ["--model", str(tiny_qwen3), "--tasks", str(tf), "--k", "3", "--max-tokens", "10", "--seed", "4"]
    full = tmp_path / "full.jsonl"
    assert run([*args, "-o", str(full)]).exit_code == 0
    ref = {(r["task_id"], r["sample"]): r["token_ids"] for r in lines(full)}

    # a crash: the first 7 records survived, the 8th was torn mid-line
    part = tmp_path / "part.jsonl"
    raw = full.read_text().splitlines(keepends=True)
    part.write_text("".join(raw[:7]) + raw[7][:25])
    (tmp_path / "part.meta.json").write_text((tmp_path / "full.meta.json").read_text())
    res = run([*args, "--batch-size", "2", "-o", str(part)])
    assert res.exit_code == 0, res.output
    got = lines(part)  # every line parses
    assert len(got) == 15
    assert {(r["task_id"], r["sample"]): r["token_ids"] for r in got} == ref
    assert "8 new samples" in res.output

    # nothing left to do: no generation
    res = run([*args, "-o", str(part)])
    assert res.exit_code == 0 and "0 new samples" in res.output and len(lines(part)) == 15

    # a larger K extends the same streams
    res = run([*args[:4], "--k", "4", *args[6:], "-o", str(part)])
    assert res.exit_code == 0 and "5 new samples" in res.output
    got = {(r["task_id"], r["sample"]): r["token_ids"] for r in lines(part)}
    assert all(got[key] == v for key, v in ref.items()) and len(got) == 20

    # other sampling settings on the same file are refused
    res = run([*args, "--temperature", "0.5", "-o", str(part)])
    assert res.exit_code == 2 and "different settings" in res.output


def test_config_file_and_flags(tmp_path, tiny_qwen3):
    tf = tasks_file(tmp_path / "t.jsonl", n=2)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {tiny_qwen3}\nseed: 9\nrollout:\n  k: 2\n  tasks: {tf}\n  sampling:\n    max_tokens: 5\n")
    out = tmp_path / "r.jsonl"
    res = run(["--config", str(cfg), "--set", "rollout.sampling.max_tokens=4", "--k", "3", "-o", str(out)])
    assert res.exit_code == 0, res.output
    recs = lines(out)
    assert len(recs) == 6 and max(r["num_tokens"] for r in recs) <= 4
    assert json.loads((tmp_path / "r.meta.json").read_text())["seed"] == 9


@pytest.mark.parametrize(
    "setup,args,message",
    [
        ("empty", [], "empty"),
        ("unknown_verifier", [], "unknown verifier"),
        ("ok", ["--k", "0"], "k"),
        ("ok", ["--temperature", "-1"], "temperature"),
        ("bad_model", [], "could not load"),
        ("ok", ["--set", "rollout.sampling.bogus=1"], "bogus"),
    ],
)
def test_bad_input_is_one_line_before_generation(tmp_path, tiny_qwen3, setup, args, message):
    tf = tmp_path / "t.jsonl"
    model = str(tiny_qwen3)
    if setup == "empty":
        tf.write_text("")
    else:
        tasks_file(tf, n=1, verifier="nope" if setup == "unknown_verifier" else "exact")
    if setup == "bad_model":
        bad = tmp_path / "m"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
        (bad / "model.safetensors").write_bytes(b"not a safetensors file")
        model = str(bad)
    out = tmp_path / "r.jsonl"
    res = run(["--model", model, "--tasks", str(tf), "-o", str(out), *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert not out.exists() or out.read_text() == ""


def test_cli_flags_live_in_the_cli_layer():
    """apply_flags puts non-empty flags under dotted keys of a section (flags beat the file); the
    flag helpers live in the CLI layer (mlx_ssp.commands.options), not in the rollout engine."""
    from mlx_ssp import rollout, stage_config
    from mlx_ssp.commands import options

    data = stage_config.apply_flags({"rollout": {"k": 2}}, "rollout", {"k": None, "sampling.stop": ("a", "b"), "seed": 3, "x": ()})
    assert data == {"rollout": {"k": 2, "sampling": {"stop": ["a", "b"]}, "seed": 3}}
    assert options.sampling_flags({"top_p": 0.5, "stop": ()})["sampling.stop"] is None
    for name in ("apply_flags", "sampling_options", "sampling_flags", "load_stage_config", "cli"):
        assert not hasattr(rollout, name), name
