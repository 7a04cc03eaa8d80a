"""Progress output: plain lines (no carriage returns, no colour codes) when the stream is not a
terminal, each stage's bar named after it, and ``--no-progress`` silencing every stage."""

from __future__ import annotations

import io
import json

import pytest
import yaml
from click.testing import CliRunner

from mlx_ssp import progress
from mlx_ssp.cli import main
from mlx_ssp.tasks import Task, write_tasks

CR, ESC = "\r", "\x1b["


def test_a_bar_in_a_log_prints_a_plain_line_per_tenth():
    out = io.StringIO()
    bar = progress.bar(25, desc="work", unit="step", stream=out)
    for i in range(25):
        bar.set_postfix(loss=f"{i / 10:.1f}")
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert CR not in out.getvalue() and ESC not in out.getvalue()
    assert len(lines) == 10 and lines[-1].startswith("work: 25/25 step (100%)") and lines[-1].endswith("loss=2.4")
    # a bar closed early says where it stopped
    out = io.StringIO()
    bar = progress.bar(100, desc="work", stream=out)
    bar.update(3)
    bar.close()
    assert out.getvalue().startswith("work: 3/100 it (3%)")


def test_turned_off_and_disabled_bars_print_nothing():
    out = io.StringIO()
    with progress.turned_off():
        bar = progress.bar(4, desc="work", stream=out)
        bar.update(4)
        bar.close()
    bar = progress.bar(4, desc="work", stream=out, enabled=False)
    bar.update(4)
    bar.close()
    assert out.getvalue() == ""
    assert progress.is_on()  # the switch is back on after the block


@pytest.fixture()
def run_file(tmp_path, tiny_qwen3):
    """A run file with tiny sft, rl and eval sections on the tiny model."""
    tasks = [Task(id=f"t{i}", domain="math", prompt=f"What is {i} + 1?", answer=str(i + 1), verifier="exact")
             for i in range(4)]
    write_tasks(tmp_path / "tasks.jsonl", tasks)
    data = tmp_path / "data"
    data.mkdir()
    chats = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                           {"role": "assistant", "content": str(i + 1)}]} for i in range(6)]
    (data / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    short = {"temperature": 1.0, "max_tokens": 3}
    run = {
        "model": str(tiny_qwen3), "run_dir": str(tmp_path / "run"), "seed": 0,
        "sft": {"domains": {"math": {"data": str(data), "probe_tasks": str(tmp_path / "tasks.jsonl")}},
                "lora": {"rank": 2, "num_layers": -1}, "iters": 2, "batch_size": 2, "save_every": 2,
                "max_seq_length": 64, "probe": {"k": 2, "sampling": short}},
        "rl": {"tasks": str(tmp_path / "tasks.jsonl"), "steps": 2, "batch_size": 2, "group_size": 2, "sampling": short},
        "eval": {"tasks": str(tmp_path / "tasks.jsonl"), "k": 2, "sampling": short,
                 "output": str(tmp_path / "eval.json")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


@pytest.mark.parametrize("command, labels", [
    (["sft"], ["sft math: ", "sft probe: "]),  # mlx-lm's trainer draws our bar, not its coloured display
    (["rl"], ["rl: "]),
    (["eval", "--model", "MODEL"], ["eval: "]),
])
def test_stage_progress_in_a_log_is_plain_and_named_and_no_progress_silences_it(run_file, tiny_qwen3, command, labels):
    command = [str(tiny_qwen3) if a == "MODEL" else a for a in command]
    args = [*command, *(["--config"] if command[0] == "eval" else []), str(run_file)]
    res = CliRunner().invoke(main, args)  # CliRunner's streams are not terminals
    assert res.exit_code == 0, res.output
    assert CR not in res.output and ESC not in res.output
    for label in labels:
        assert any(line.startswith(label) for line in res.output.splitlines()), (label, res.output)
    assert "rollout: " not in res.output  # eval and the sft probe are not called rollouts
    quiet = CliRunner().invoke(main, [*args, "--no-progress", "--set", "run_dir=" + str(run_file.parent / "again")])
    assert quiet.exit_code == 0, quiet.output
    for label in [*labels, "rollout: "]:
        assert not any(line.startswith(label) for line in quiet.output.splitlines()), (label, quiet.output)
