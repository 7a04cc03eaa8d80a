"""Integrity of outputs (and the rollout pass@k label):
resume against changed tasks, concurrent runs and mixed provenance; one-line errors for a full
disk, bad UTF-8 and YAML bombs; stale temporary siblings; output permissions."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_ssp.cli import main
from mlx_ssp.errors import UserError
from mlx_ssp.tasks import Task, write_tasks


def make_tasks(path, prompts=None, answers=None, n=3):
    prompts = prompts or {}
    answers = answers or {}
    tasks = [Task(id=f"q{i}", domain="a", prompt=prompts.get(i, f"What is {i} + 1?"), answer=answers.get(i, str(i + 1)),
                  verifier="exact") for i in range(n)]
    write_tasks(path, tasks)
    return path


def rollout(*args):
    return CliRunner().invoke(main, ["rollout", "--no-progress", *args])


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def by_key(recs):
    return {(r["task_id"], r["sample"]): r for r in recs}


@pytest.fixture
def base_args(tiny_qwen3):
    return ["--model", str(tiny_qwen3), "--k", "2", "--max-tokens", "6", "--seed", "3"]


# -- item 8: resume keyed by a task fingerprint, a locked output, one provenance per file -----------


def test_changed_task_is_regenerated_and_its_stale_records_dropped(tmp_path, base_args):
    tf = make_tasks(tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    assert rollout(*base_args, "--tasks", str(tf), "-o", str(out)).exit_code == 0
    before = out.read_text().splitlines()
    # same ids: q1's prompt and q2's answer are edited
    make_tasks(tf, prompts={1: "What is 7 * 6?"}, answers={2: "nope"})
    res = rollout(*base_args, "--tasks", str(tf), "-o", str(out))
    assert res.exit_code == 0, res.output
    assert "4 new samples" in res.output and "4 stale record(s) of 2 changed task(s)" in res.output
    recs = lines(out)
    assert len(recs) == 6 and len(by_key(recs)) == 6  # the stale ones are gone, not kept beside
    got = by_key(recs)
    assert all(got[("q1", s)]["prompt"] == "What is 7 * 6?" for s in range(2))
    assert all(got[("q2", s)]["reward"] == 0.0 for s in range(2))  # scored against "nope"
    fps = {r["task_id"]: r["task_fingerprint"] for r in recs}
    assert len(set(fps.values())) == 3
    # the unchanged task's lines are byte-identical
    assert [x for x in out.read_text().splitlines() if '"task_id": "q0"' in x] == [x for x in before if '"task_id": "q0"' in x]
    summ = json.loads((tmp_path / "r.summary.json").read_text())
    assert summ["this_run"]["stale_records"] == 4 and summ["this_run"]["stale_tasks"] == ["q1", "q2"]
    # a rerun has nothing left to do
    res = rollout(*base_args, "--tasks", str(tf), "-o", str(out))
    assert res.exit_code == 0 and "0 new samples" in res.output and "stale" not in res.output


def test_a_changed_answer_is_scored_against_the_new_answer(tmp_path, base_args):
    tf = make_tasks(tmp_path / "t.jsonl", n=1)
    out = tmp_path / "r.jsonl"
    assert rollout(*base_args, "--tasks", str(tf), "-o", str(out)).exit_code == 0
    old = lines(out)
    said = [r["detail"] for r in old]  # what the exact verifier read as each sample's answer
    assert said[0].strip() and said[0] != said[1] and [r["reward"] for r in old] == [0.0, 0.0]
    make_tasks(tf, n=1, answers={0: said[0]})  # the answer is now what sample 0 said
    res = rollout(*base_args, "--tasks", str(tf), "-o", str(out))
    assert res.exit_code == 0, res.output
    recs = lines(out)
    assert [r["completion"] for r in recs] == [r["completion"] for r in old]  # same streams, same text
    assert [r["reward"] for r in recs] == [1.0, 0.0]  # scored against the new answer, not kept from the old one


def test_second_run_on_the_same_output_fails_at_once_naming_the_holder(tmp_path, base_args):
    tf = make_tasks(tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys, time
            f = open({str(tmp_path / '.r.jsonl.lock')!r}, "w")
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(f"{{os.getpid()}}@elsewhere\\n"); f.flush()
            print("held", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        res = rollout(*base_args, "--tasks", str(tf), "-o", str(out))
        assert res.exit_code == 2, res.output
        assert f"pid {holder.pid}" in res.output and "another run" in res.output
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: the lock is free again, and released after the run
    res = rollout(*base_args, "--tasks", str(tf), "-o", str(out))
    assert res.exit_code == 0, res.output
    assert len(lines(out)) == 6 and len(by_key(lines(out))) == 6


def test_stage_commands_refuse_an_output_another_process_writes(tmp_path):
    """select, eval, sft and rl hold their output's lock (.NAME.lock beside it) as rollout does: while
    it is held the command fails at once, one line naming the output and the holder's pid, before
    any model is loaded; nothing is written."""
    from mlx_ssp.io import exclusive_lock

    tasks = make_tasks(tmp_path / "t.jsonl")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\nmodel: demo\nsft: {{domains: {{a: {{data: {tmp_path / 'data'}}}}}}}\n"
                   f"rl: {{tasks: {tasks}}}\n")
    cases = {
        "select": (["select", str(tmp_path / "r.jsonl"), "-o", str(tmp_path / "sel")], tmp_path / "sel"),
        "eval": (["eval", "--model", "demo", "--tasks", str(tasks), "-o", str(tmp_path / "e.json")], tmp_path / "e.json"),
        "sft": (["sft", str(cfg)], tmp_path / "run" / "sft"),
        "rl": (["rl", str(cfg)], tmp_path / "run" / "rl"),
    }
    for name, (args, out) in cases.items():
        lock = out.with_name(f".{out.name}.lock")
        with exclusive_lock(lock, "held"):  # the lock file records this pid, as another process's would
            res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, (name, res.output, res.exception)
        err = res.stderr.strip()
        assert len(err.splitlines()) == 1 and f"{out} is being written by another run (pid {os.getpid()}" in err, (name, err)
        assert not out.exists() and not lock.exists(), name


def test_exclusive_lock_excludes_and_is_removed_on_release(tmp_path):
    from mlx_ssp.io import exclusive_lock

    lock = tmp_path / ".x.lock"
    with exclusive_lock(lock, "X"):
        assert lock.read_text().startswith(f"{os.getpid()}@")
        with pytest.raises(UserError, match=rf"X is being written by another run \(pid {os.getpid()}"):
            with exclusive_lock(lock, "X"):
                pass
    assert not lock.exists()
    with exclusive_lock(lock, "X"):  # free again
        pass


def test_missing_meta_does_not_let_another_seed_mix_in(tmp_path, base_args):
    tf = make_tasks(tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    assert rollout(*base_args, "--tasks", str(tf), "-o", str(out)).exit_code == 0
    (tmp_path / "r.meta.json").unlink()
    other = [a if a != "3" else "4" for a in base_args]
    res = rollout(*other, "--k", "3", "--tasks", str(tf), "-o", str(out))
    assert res.exit_code == 2 and "different settings" in res.output, res.output
    assert len(lines(out)) == 6
    # the same settings are vouched for by the records themselves: resumed, meta written again
    res = rollout(*base_args, "--k", "3", "--tasks", str(tf), "-o", str(out))
    assert res.exit_code == 0 and "3 new samples" in res.output, res.output
    assert json.loads((tmp_path / "r.meta.json").read_text())["seed"] == 3


def test_unstamped_records_without_meta_are_refused(tmp_path, base_args):
    tf = make_tasks(tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    assert rollout(*base_args, "--tasks", str(tf), "-o", str(out)).exit_code == 0
    recs = lines(out)
    for r in recs:  # as an older version wrote them
        r.pop("run_fingerprint", None)
        r.pop("task_fingerprint", None)
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "r.meta.json").unlink()
    res = rollout(*base_args, "--seed", "5", "--tasks", str(tf), "-o", str(out))
    assert res.exit_code == 2 and "no r.meta.json" in res.output, res.output


def test_resume_drops_repeated_records(tmp_path, base_args):
    tf = make_tasks(tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    assert rollout(*base_args, "--tasks", str(tf), "-o", str(out)).exit_code == 0
    text = out.read_text()
    out.write_text(text + text)  # what two concurrent runs used to leave
    res = rollout(*base_args, "--tasks", str(tf), "-o", str(out))
    assert res.exit_code == 0, res.output
    assert out.read_text() == text and "6 repeated record(s)" in res.output


def _select_records(tmp_path, recs):
    from mlx_ssp.select import SelectConfig, run_select

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run_select(src, SelectConfig(), tmp_path / "sel", overwrite=True)


def _recs():
    return [{"task_id": f"t{t}", "domain": "d", "sample": s, "prompt": f"p{t}", "completion": f"solution {t} {s} " * 3,
             "reward": 1.0, "finish_reason": "stop", "run_fingerprint": "r1"} for t in range(2) for s in range(3)]


def test_select_counts_a_repeated_record_once_and_refuses_conflicts(tmp_path):
    ref = _select_records(tmp_path, _recs())
    dup = _select_records(tmp_path, _recs() + _recs()[:4])
    assert dup["domains"] == ref["domains"] and dup["repeated_records_dropped"] == 4
    assert ref["domains"]["d"]["prompts"][0]["n_samples"] == 3
    conflict = _recs() + [{**_recs()[0], "completion": "another run's text"}]
    with pytest.raises(UserError, match="task 't0' sample 0 but differ"):
        _select_records(tmp_path, conflict)
    mixed = _recs() + [{**r, "sample": r["sample"] + 3, "run_fingerprint": "r2"} for r in _recs()]
    with pytest.raises(UserError, match="2 different runs"):
        _select_records(tmp_path, mixed)


# -- item 10: one line, never a traceback ------------------------------------------------------------


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _one_line_disk_full(res):
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert isinstance(res.exception, SystemExit)
    err = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "no space left on device" in err[0] and "Traceback" not in res.output


def test_disk_full_in_rollout_is_one_line(tmp_path, base_args, monkeypatch):
    from mlx_ssp import io

    tf = make_tasks(tmp_path / "t.jsonl")
    monkeypatch.setattr(io.JsonlAppender, "_write", _enospc)
    res = rollout(*base_args, "--tasks", str(tf), "-o", str(tmp_path / "r.jsonl"))
    _one_line_disk_full(res)
    assert "r.jsonl" in res.output


def test_disk_full_and_quota_in_verify_are_one_line(tmp_path, monkeypatch):
    from mlx_ssp import io

    src = tmp_path / "c.jsonl"
    task = {"id": "a", "domain": "d", "prompt": "p", "answer": "1", "verifier": "exact"}
    src.write_text(json.dumps({"task": task, "completion": "1"}) + "\n")
    real = io.write_jsonl_atomic

    def full(path, records):  # the disk fills up while the records are written
        def gen():
            yield from records
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, gen())

    monkeypatch.setattr(io, "write_jsonl_atomic", full)
    res = CliRunner().invoke(main, ["verify", str(src), "-o", str(tmp_path / "o.jsonl"), "--no-progress"])
    _one_line_disk_full(res)
    assert not (tmp_path / "o.jsonl").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".o.jsonl")]

    def quota(path, records):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path))

    monkeypatch.setattr(io, "write_jsonl_atomic", quota)
    res = CliRunner().invoke(main, ["verify", str(src), "-o", str(tmp_path / "o.jsonl"), "--no-progress"])
    assert res.exit_code == 2 and "error: disk quota exceeded writing" in res.output, res.output


def _tiny_merge_inputs(tmp_path):
    import mlx.core as mx

    models = []
    for i in range(2):
        d = tmp_path / f"m{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 4, "vocab_size": 8}))
        mx.save_safetensors(str(d / "model.safetensors"), {"w.weight": mx.ones((8, 4)) * i}, metadata={"format": "pt"})
        models.append(d)
    cfg = tmp_path / "merge.yml"
    cfg.write_text(json.dumps({"merge_method": "linear", "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in models]}))
    return cfg


def test_disk_full_in_merge_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    cfg = _tiny_merge_inputs(tmp_path)
    monkeypatch.setattr(os, "pwrite", _enospc)
    res = CliRunner().invoke(main, ["merge", str(cfg), str(tmp_path / "out"), "--quiet", "--workers", "1"])
    _one_line_disk_full(res)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_invalid_utf8_in_jsonl_names_file_and_line(tmp_path, base_args):
    from mlx_ssp.io import read_jsonl

    bad = tmp_path / "t.jsonl"
    good = json.dumps({"id": "a", "domain": "d", "prompt": "p", "answer": "1", "verifier": "exact"})
    bad.write_bytes(good.encode() + b"\n" + good.replace('"p"', '"caf\xe9"').encode("latin-1") + b"\n")
    with pytest.raises(UserError, match=r"t\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column"):
        read_jsonl(bad)
    res = rollout(*base_args, "--tasks", str(bad), "-o", str(tmp_path / "r.jsonl"))
    assert res.exit_code == 2 and "t.jsonl:2: not valid UTF-8" in res.output, res.output
    res = CliRunner().invoke(main, ["verify", str(bad), "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2 and "t.jsonl:2: not valid UTF-8" in res.output, res.output


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


def test_yaml_alias_bomb_is_refused_fast(tmp_path, monkeypatch):
    from mlx_ssp import config
    from mlx_ssp.config import parse_override, read_yaml

    f = tmp_path / "bomb.yaml"
    f.write_text(BOMB)
    # the size check walks the node graph (28 nodes, each visited twice), never the 9**9 values
    # it expands to; past 1000 visits the walk is not bounded and the test stops it
    visits, real = [0], config._children

    def children(node):
        visits[0] += 1
        assert visits[0] <= 1000, "the alias expansion is walked value by value"
        return real(node)

    monkeypatch.setattr(config, "_children", children)
    with pytest.raises(UserError, match="expands to more than"):
        read_yaml(f)
    assert visits == [2 * 28]
    with pytest.raises(UserError, match="expands to more than"):
        parse_override("merge.x={" + ", ".join(BOMB.splitlines()) + "}")
    assert visits == [4 * 28]
    monkeypatch.undo()
    # ordinary anchors and aliases still work
    f.write_text("base: &b {k: 8, batch_size: 4}\nrollout: *b\n")
    assert read_yaml(f)["rollout"] == {"k": 8, "batch_size": 4}
    # a recursive alias, deep nesting, an oversized file and bytes that are not UTF-8: one line each
    for text, msg in [("a: &a [*a]\n", "expands"), ("a: " + "[" * 20000 + "\n", "nested too deeply|not valid YAML"),
                      ("a: '" + "x" * (1 << 21) + "'\n", "more than a config")]:
        f.write_text(text)
        with pytest.raises(UserError, match=msg):
            read_yaml(f)
    f.write_bytes(b"a: caf\xe9\n")
    with pytest.raises(UserError, match="not valid UTF-8"):
        read_yaml(f)


def test_yaml_alias_bomb_in_a_merge_config_is_one_line(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text(BOMB)
    res = CliRunner().invoke(main, ["merge", str(f), str(tmp_path / "out")])
    assert res.exit_code == 2 and "expands to more than" in res.output, res.output


# -- item 11: temporary siblings of killed runs are removed by the next run ---------------------------


def _killed_inside(target: Path, kind: str) -> None:
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from mlx_ssp.io import atomic_dir, atomic_path
        if {kind!r} == "dir":
            with atomic_dir({str(target)!r}, overwrite=True) as tmp:
                (tmp / "half.bin").write_bytes(b"x" * 1000)
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            with atomic_path({str(target)!r}) as tmp:
                tmp.write_text("half")
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=str(Path(__file__).parents[1]))
    assert r.returncode == -signal.SIGKILL


def _siblings(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_stale_temporary_siblings_are_removed_by_the_next_write(tmp_path, kind):
    from mlx_ssp.io import _HOST, atomic_dir, write_text_atomic

    target = tmp_path / ("out" if kind == "dir" else "out.json")
    _killed_inside(target, kind)
    first = _siblings(target)
    assert len(first) == 1 and not target.exists()  # what a killed run leaves
    _killed_inside(target, kind)  # the next run removes it (and is killed in turn)
    second = _siblings(target)
    assert len(second) == 1 and second != first
    live = tmp_path / f".{target.name}.tmp-{os.getpid()}@{_HOST}.live"
    live.mkdir()  # a temporary of a live process (this one) is not touched
    other_host = tmp_path / f".{target.name}.tmp-1@some-other-host.x"
    other_host.mkdir()  # nor one of another host, whose pids cannot be checked here
    if kind == "dir":
        with atomic_dir(target) as tmp:
            (tmp / "ok").write_text("done")
    else:
        write_text_atomic(target, "done")
    assert target.exists()
    assert _siblings(target) == sorted([live.name, other_host.name])


# -- item 12: outputs get the permissions a plain write would ----------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_atomic_outputs_follow_the_umask(tmp_path, umask):
    from mlx_ssp.io import atomic_dir, write_json_atomic, write_jsonl_atomic

    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "a.json", {"x": 1})
        write_jsonl_atomic(tmp_path / "b.jsonl", [{"x": 1}])
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "f").write_text("x")
        (tmp_path / "plain.txt").write_text("x")
        os.mkdir(tmp_path / "plain_dir")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "a.json") == mode(tmp_path / "b.jsonl") == mode(tmp_path / "plain.txt") == 0o666 & ~umask
    assert mode(tmp_path / "d") == mode(tmp_path / "plain_dir") == 0o777 & ~umask


def test_overwriting_a_file_keeps_its_mode(tmp_path):
    from mlx_ssp.io import write_text_atomic

    f = tmp_path / "a.txt"
    f.write_text("old")
    f.chmod(0o640)
    write_text_atomic(f, "new")
    assert f.read_text() == "new" and stat.S_IMODE(f.stat().st_mode) == 0o640


# -- item 16 (rollout part): pass@k is never pass@n under the pass@k label ---------------------------


def test_summary_pass_at_k_only_over_tasks_with_k_samples():
    from mlx_ssp.rollout import format_table, summarize

    recs = [{"task_id": "full", "domain": "d", "sample": s, "reward": float(s == 0), "num_tokens": 3, "finish_reason": "stop"}
            for s in range(4)]
    recs += [{"task_id": "short", "domain": "d", "sample": s, "reward": 1.0, "num_tokens": 3, "finish_reason": "stop"}
             for s in range(2)]
    summ = summarize(recs, 4)
    rows = {t["task_id"]: t for t in summ["tasks"]}
    assert rows["short"]["pass@4"] is None and rows["full"]["pass@4"] == 1.0
    d = summ["domains"]["d"]
    assert d["n_tasks"] == 2 and d["pass@4_tasks"] == 1 and d["pass@4"] == 1.0
    assert d["pass@1"] == pytest.approx((0.25 + 1.0) / 2)  # pass@1 still over every task
    table = format_table(summ)
    assert "pass@4_tasks" in table.splitlines()[0]
    only_short = summarize([r for r in recs if r["task_id"] == "short"], 4)
    assert only_short["overall"]["pass@4"] is None and only_short["overall"]["pass@4_tasks"] == 0
    head, _, *rows = format_table(only_short).splitlines()
    col = head.split().index("pass@4")
    assert rows[-1].split()[0] == "overall" and rows[-1].split()[col] == "-"  # no number under the pass@4 label
