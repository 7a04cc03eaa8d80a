"""``mlx_ssp verify`` keeps each verdict as it comes: a killed run resumes with only the rest, and
the output is the one an uninterrupted run writes; one-line errors for hostile input lines."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import mlx_ssp.verify as V
from mlx_ssp.cli import main


def _completions(path, n=6):
    lines = []
    for i in range(n):
        task = {"id": f"q{i}", "domain": "even" if i % 2 else "odd", "prompt": f"{i}+1?", "answer": str(i + 1),
                "verifier": "exact"}
        lines.append(json.dumps({"task": task, "completion": str(i + 1 if i % 3 else i)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _verify(inp, out):
    return CliRunner().invoke(main, ["verify", str(inp), "-o", str(out), "--no-progress", "--workers", "1"])


@pytest.fixture
def counted(monkeypatch):
    """The verifier, counting the completions it scores and killing the run at ``kill_at``."""
    real = V.verify
    state = {"calls": [], "kill_at": None}

    def verify(completion, task, *a, **kw):
        if len(state["calls"]) == state["kill_at"]:
            raise KeyboardInterrupt  # a kill after kill_at verdicts
        state["calls"].append(task.id)
        return real(completion, task, *a, **kw)

    monkeypatch.setattr(V, "verify", verify)
    return state


def test_killed_verify_resumes_only_the_rest_and_writes_the_same_output(tmp_path, counted):
    inp = _completions(tmp_path / "c.jsonl")
    whole = tmp_path / "whole.jsonl"
    assert _verify(inp, whole).exit_code == 0
    assert len(counted["calls"]) == 6

    out = tmp_path / "o.jsonl"
    counted.update(calls=[], kill_at=4)
    res = _verify(inp, out)
    assert res.exit_code != 0 and not out.exists()  # the output appears whole or not at all
    assert counted["calls"] == ["q0", "q1", "q2", "q3"]

    counted.update(calls=[], kill_at=None)
    res = _verify(inp, out)
    assert res.exit_code == 0, res.output
    assert counted["calls"] == ["q4", "q5"]  # only the 2 not scored before the kill
    assert "resumed 4 verdicts" in res.output and "mean reward 0.6667" in res.output
    assert out.read_bytes() == whole.read_bytes()
    assert not (tmp_path / "o.jsonl.partial").exists()
    assert [json.loads(x) for x in inp.read_text().splitlines()][0]["completion"] == "0"  # input untouched


def test_a_changed_record_is_scored_again_on_resume(tmp_path, counted):
    inp = _completions(tmp_path / "c.jsonl")
    out = tmp_path / "o.jsonl"
    counted["kill_at"] = 3
    _verify(inp, out)
    lines = inp.read_text().splitlines()
    rec = json.loads(lines[1])
    rec["completion"] = "wrong"
    lines[1] = json.dumps(rec)
    inp.write_text("\n".join(lines) + "\n")
    counted.update(calls=[], kill_at=None)
    assert _verify(inp, out).exit_code == 0
    assert counted["calls"] == ["q1", "q3", "q4", "q5"]
    assert json.loads(out.read_text().splitlines()[1])["reward"] == 0.0


def test_deeply_nested_line_is_one_line_naming_it(tmp_path):
    inp = _completions(tmp_path / "c.jsonl", n=2)
    deep = '{"completion": "1", "x": ' + "[" * 3000 + "]" * 3000 + "}"
    inp.write_text(inp.read_text() + deep + "\n")
    res = _verify(inp, tmp_path / "o.jsonl")
    assert res.exit_code == 2 and "c.jsonl:3: JSON nested too deeply" in res.output, res.output
    assert len(res.output.splitlines()) == 1


@pytest.mark.parametrize("target", ["/proc/self/mem", "/dev/null", "/sys/kernel/x.jsonl"])
def test_special_output_paths_are_refused(tmp_path, target):
    inp = _completions(tmp_path / "c.jsonl", n=1)
    out = tmp_path / "o.jsonl"
    out.symlink_to(target)  # through a link: a run without the check replaces the link, not the device
    res = CliRunner().invoke(main, ["verify", str(inp), "-o", str(out), "--no-progress"])
    assert res.exit_code == 2 and res.output.startswith("error: -o ") and len(res.output.splitlines()) == 1, res.output


def test_a_second_verify_on_the_same_output_stops_at_once(tmp_path):
    from mlx_ssp.io import exclusive_lock
    from mlx_ssp.rollout.resume import lock_path

    inp = _completions(tmp_path / "c.jsonl", n=2)
    out = tmp_path / "o.jsonl"
    with exclusive_lock(lock_path(out), str(out)):  # another run holds the output
        res = _verify(inp, out)
    assert res.exit_code == 2 and "being written by another run" in res.output, res.output
    assert not out.exists() and not (tmp_path / "o.jsonl.partial").exists()
