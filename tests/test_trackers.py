"""Experiment trackers (``report_to``, ``--report-to``; :mod:`mlx_ssp.trackers`) with the real libraries,
offline: TensorBoard event files read back with TensorBoard's own reader, W&B offline run files
(the ``.wandb`` record log read with W&B's own protobuf records), Trackio's local store read with
Trackio's own storage class. Real stages (SFT, RL with phases, eval, merge, the whole ``mlx_ssp run``
driver) send their metrics; a missing package is one line naming the extra. That rank 1 logs nothing
is checked in tests/test_distributed_stages.py (a 2-rank eval with --report-to)."""

from __future__ import annotations

import glob
import importlib
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from mlx_ssp import trackers
from mlx_ssp.cli import main
from mlx_ssp.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PARAMS = {"seed": 1, "sft": {"lora": {"rank": 8}, "domains": ["a", "b"]}, "note": None}


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard run directory, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def one_logdir(root: Path, prefix: str) -> Path:
    dirs = sorted((root / "tensorboard").glob(f"{prefix}*"))
    assert len(dirs) == 1, dirs
    return dirs[0]


def write_tasks_file(path: Path, n: int = 4) -> Path:
    from mlx_ssp.tasks import Task, write_tasks

    write_tasks(path, [Task(id=f"q{i}", domain="even" if i % 2 == 0 else "odd", prompt=f"Count to {i + 1}.",
                            answer=str(i + 1), verifier="exact") for i in range(n)])
    return path


# -- the key and the flag ------------------------------------------------------------------------


def test_report_to_values_and_choices_from_the_registry(tmp_path, monkeypatch):
    from mlx_ssp.stage_config import load_stage

    assert trackers.choices() == ["none", "tensorboard", "wandb", "trackio"] == ["none", *trackers.TRACKERS]
    parse = trackers.parse_report_to
    assert parse(None) == parse("none") == parse([]) == parse(["none"]) == ()
    assert parse("tensorboard") == ("tensorboard",)
    assert parse(["wandb", "tensorboard, wandb"]) == ("wandb", "tensorboard")  # in order, once each
    assert trackers.from_cli(()) is None and trackers.from_cli(("none",)) == ()
    assert trackers.from_cli(("tensorboard,trackio",)) == ("tensorboard", "trackio")
    for bad, msg in [("tensorbord", "unknown tracker 'tensorbord'; valid: none, tensorboard, wandb, trackio"),
                     (["none", "wandb"], "'none' cannot go with trackers"), (3, "a tracker name or a list")]:
        with pytest.raises(UserError, match=msg):
            parse(bad)
    # through the one stage loader: the file and the key in the message, at load time
    f = tmp_path / "run.yaml"
    f.write_text("report_to: [tensorboard, wandbb]\n")
    with pytest.raises(UserError, match=r"run\.yaml: report_to: unknown tracker 'wandbb'"):
        load_stage(f, (), "eval", flags={})
    f.write_text("report_to: tensorboard\n")
    assert load_stage(f, (), "eval", flags={}).report_to == ("tensorboard",)
    assert load_stage(f, ("report_to=[wandb,trackio]",), "eval", flags={}).report_to == ("wandb", "trackio")
    assert load_stage(f, ("report_to=none",), "eval", flags={}).report_to == ()
    # an adapter added to the registry is a choice at once
    monkeypatch.setitem(trackers.TRACKERS, "mine", trackers.TensorBoardSink)
    assert parse("mine") == ("mine",) and "mine" in trackers.choices()


def test_every_command_that_writes_metrics_has_the_flag():
    for cmd in ("sft", "rl", "eval", "rollout", "merge", "run"):
        r = CliRunner().invoke(main, [cmd, "--help"])
        assert r.exit_code == 0 and "--report-to" in r.output, cmd


# -- each tracker, driven through the sink --------------------------------------------------------


def log_some() -> None:
    """What a run logs: two namespaces with their own steps, a nested one, values to leave out."""
    with trackers.scope("sft"):
        for step in (1, 2, 3):
            trackers.log("math", {"step": step, "train_loss": 1.0 / step, "note": "text", "nan": math.nan,
                                  "inf": math.inf, "none": None, "list": [1, 2], "probe": {"pass@1": step / 10,
                                                                                           "chosen": step == 2}}, step)
    with trackers.scope("rl"), trackers.scope("phase1"):
        trackers.log("", {"reward_mean": 0.5}, 1)
    trackers.log("rl", {"stage_seconds": 7.0}, 0)


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    with trackers.session(["tensorboard"], dir=tmp_path, project="p", command="run", name="try1", params=PARAMS):
        assert trackers.active()
        log_some()
    assert not trackers.active()
    trackers.log("sft", {"after": 1.0}, 9)  # no session: nothing, no error
    got = scalars(tmp_path / "tensorboard" / "try1")
    assert got == {
        "sft/math/train_loss": [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))],
        "sft/math/probe/pass@1": [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))],
        "sft/math/probe/chosen": [(1, 0.0), (2, 1.0), (3, 0.0)],
        "rl/phase1/reward_mean": [(1, 0.5)],
        "rl/stage_seconds": [(0, 7.0)],
    }
    # the params: the HParams dashboard (flattened) and the whole config as text
    ea = EventAccumulator(str(tmp_path / "tensorboard" / "try1"))
    ea.Reload()
    hp = plugin_data_pb2.HParamsPluginData.FromString(ea.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    h = hp.session_start_info.hparams
    assert h["sft.lora.rank"].number_value == 8 and h["seed"].number_value == 1
    assert h["sft.domains"].string_value == "['a', 'b']"
    text = ea.Tensors("config")[0].tensor_proto.string_val[0].decode()
    assert yaml.safe_load(text.strip("`\n")) == PARAMS


def wandb_records(run_file: Path) -> list:
    """The records of a ``.wandb`` file: a 7-byte header (":W&B", magic, version), then LevelDB
    log-format chunks in 32 KiB blocks, each chunk a serialized ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            pos += block - pos % block if pos % block else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # full / first, then middle / last
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(pending)
            out.append(r)
    return out


def read_wandb(root: Path) -> tuple[list[dict], dict, dict]:
    """(history rows, key -> its step metric, config) of the one offline run under ``root``, once
    W&B's service has stopped (it writes the run file after ``finish`` returns)."""
    import wandb

    wandb.teardown()
    files = glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    rows, axes, config = [], {}, {}
    key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731
    for r in wandb_records(Path(files[0])):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            rows.append({key(i): json.loads(i.value_json) for i in r.history.item if not key(i).startswith("_")})
        elif kind == "metric" and r.metric.step_metric:
            axes[r.metric.name] = r.metric.step_metric
        elif kind in ("run", "config"):
            for i in (r.run.config if kind == "run" else r.config).update:
                config[key(i)] = json.loads(i.value_json)
    return rows, axes, config


@pytest.mark.slow
def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    with trackers.session(["wandb"], dir=tmp_path / "run", project="run", command="run", params=PARAMS):
        log_some()
    rows, axes, config = read_wandb(tmp_path / "run")  # dir defaults to the run directory
    loss = [(r["sft/math/step"], r["sft/math/train_loss"]) for r in rows if "sft/math/train_loss" in r]
    assert loss == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    phase = [(r["rl/phase1/step"], r["rl/phase1/reward_mean"]) for r in rows if "rl/phase1/reward_mean" in r]
    assert phase == [(1, 0.5)]
    assert [r["rl/step"] for r in rows if "rl/stage_seconds" in r] == [0]  # its own axis: no clash with rl/phase1
    assert not any(k.endswith(("/note", "/nan", "/inf", "/none", "/list")) for r in rows for k in r)
    assert axes["sft/math/train_loss"] == axes["sft/math/probe/pass@1"] == "sft/math/step"
    assert axes["rl/stage_seconds"] == "rl/step"
    assert config["sft"] == PARAMS["sft"] and config["seed"] == 1 and config["note"] is None


@pytest.mark.slow
def test_wandb_respects_wandb_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    with trackers.session(["wandb"], dir=tmp_path / "run", project="run", command="eval"):
        trackers.log("eval", {"overall": {"pass@1": 0.25}}, 0)
    rows, _, _ = read_wandb(tmp_path / "elsewhere")
    assert [r["eval/overall/pass@1"] for r in rows if "eval/overall/pass@1" in r] == [0.25]
    assert not (tmp_path / "run" / "wandb").exists()


TRACKIO_SCRIPT = """
import json, sys
from mlx_ssp import trackers
params = json.loads(sys.argv[2])
with trackers.session(["trackio"], dir=sys.argv[1], project="myrun", command="rl", name="try1", params=params,
                      scope_name="rl"):
    trackers.log("", {"step": 1, "reward_mean": 0.25, "note": "x", "timings": {"gen_s": 1.5}}, 1)
    trackers.log("", {"step": 2, "reward_mean": 0.5, "kl": float("nan")}, 2)
    with trackers.scope("phase1"):
        trackers.log("", {"reward_mean": 0.75}, 1)
from trackio.sqlite_storage import SQLiteStorage
runs = SQLiteStorage.get_runs("myrun")
print(json.dumps({"runs": runs, "logs": SQLiteStorage.get_logs("myrun", "try1"),
                  "config": SQLiteStorage.get_run_config("myrun", "try1")}))
"""


@pytest.mark.slow
def test_trackio_local_store(tmp_path):
    """In a child process: trackio fixes its store directory (TRACKIO_DIR) when first imported.
    The child's stdout is only its JSON: trackio's banners went to stderr."""
    pytest.importorskip("trackio")
    env = dict(os.environ, TRACKIO_DIR=str(tmp_path / "store"), HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path / "run"), json.dumps(PARAMS)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["runs"] == ["try1"] and (tmp_path / "store" / "myrun.db").is_file()
    logs = [{k: v for k, v in row.items() if k != "timestamp"} for row in got["logs"]]
    assert logs == [{"rl/reward_mean": 0.25, "rl/timings/gen_s": 1.5, "step": 1}, {"rl/reward_mean": 0.5, "step": 2},
                    {"rl/phase1/reward_mean": 0.75, "step": 1}]
    assert {k: v for k, v in got["config"].items() if not k.startswith("_")} == PARAMS


# -- failures and ranks --------------------------------------------------------------------------


def test_missing_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    real = importlib.import_module

    def without_wandb(name, *a, **kw):  # as if wandb were not installed; every other import is real
        if name == "wandb":
            raise ModuleNotFoundError("No module named 'wandb'", name="wandb")
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", without_wandb)
    msg = 'report_to: wandb needs the wandb package: pip install -e ".[trackers]"'
    with pytest.raises(UserError) as e:
        with trackers.session(["wandb"], dir=tmp_path, project="p", command="run"):
            pytest.fail("the block ran without its tracker")
    assert str(e.value) == msg
    # from a command: exit 2, one line, before any work (no output, no model loaded)
    tasks = write_tasks_file(tmp_path / "tasks.jsonl")
    out = tmp_path / "ev" / "eval.json"
    r = CliRunner().invoke(main, ["eval", "--model", str(tmp_path / "no-model"), "--tasks", str(tasks), "-o", str(out),
                                  "--report-to", "tensorboard,wandb"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [f"error: {msg}"]
    assert not (tmp_path / "ev" / "tensorboard").exists() and not out.exists()
    # an adapter whose module does not exist at all
    nope = type("Nope", (trackers.TensorBoardSink,), {"name": "nope", "module": "mlx_ssp_no_such_tracker",
                                                      "package": "nope-tracker"})
    monkeypatch.setitem(trackers.TRACKERS, "nope", nope)
    msg = r'^report_to: nope needs the nope-tracker package: pip install -e "\.\[trackers\]"$'
    with pytest.raises(UserError, match=msg):
        with trackers.session(["nope"], dir=tmp_path, project="p", command="run"):
            pass
    # an installed package whose import breaks (a name missing from a dependency, as a protobuf clash does)
    (tmp_path / "mlx_ssp_broken_tracker.py").write_text("from json import no_such_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = type("Broken", (trackers.TensorBoardSink,), {"name": "broken", "module": "mlx_ssp_broken_tracker",
                                                          "package": "broken-tracker"})
    monkeypatch.setitem(trackers.TRACKERS, "broken", broken)
    with pytest.raises(UserError) as e:
        with trackers.session(["broken"], dir=tmp_path, project="p", command="run"):
            pytest.fail("the block ran without its tracker")
    assert str(e.value).startswith("report_to: broken: importing mlx_ssp_broken_tracker failed (ImportError: ")
    assert "no_such_name" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_missing_package_stops_every_rank(tmp_path):
    """A tracker whose package is missing: both ranks stop with the one line (neither waits for the other)."""
    from test_distributed import finish, spawn_ranks

    res = finish(spawn_ranks("trackers_missing", tmp_path, tmp_path, env={"PYTHONPATH": str(ROOT)}), timeout=120)
    for rc, _out, err in res.values():
        assert rc == 2 and 'error: report_to: nope needs the nope-tracker package: pip install -e ".[trackers]"' in err


# -- real stages ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_command_sends_loss_and_probe(tmp_path, tiny_qwen3):
    """`mlx_ssp sft` with report_to in the run file: loss reports and probe results per step."""
    pytest.importorskip("tensorboard")
    from test_sft import write_data, write_probe

    data, probe = write_data(tmp_path), write_probe(tmp_path)
    run = {
        "model": str(tiny_qwen3), "run_dir": str(tmp_path / "run"), "seed": 1, "report_to": "tensorboard",
        "sft": {
            "domains": {"math": {"data": str(data), "probe_tasks": str(probe)}},
            "lora": {"rank": 2, "num_layers": -1}, "learning_rate": 1e-3, "iters": 2, "batch_size": 2,
            "save_every": 1, "max_seq_length": 64,
            "probe": {"k": 2, "n": 2, "sampling": {"temperature": 1.0, "max_tokens": 3}, "progress": False},
        },
    }
    cfgp = tmp_path / "run.yaml"
    cfgp.write_text(yaml.safe_dump(run))
    res = CliRunner().invoke(main, ["sft", str(cfgp), "--no-progress"])
    assert res.exit_code == 0, res.output
    sft = tmp_path / "run" / "sft"
    got = scalars(one_logdir(sft, "sft-"))  # beside the stage's outputs
    metrics = [json.loads(x) for x in (sft / "math" / "metrics.jsonl").read_text().splitlines()]
    curve = [json.loads(x) for x in (sft / "math" / "probe_curve.jsonl").read_text().splitlines()]
    assert got["sft/math/train_loss"] == [(m["step"], pytest.approx(m["train_loss"])) for m in metrics]
    assert [s for s, _ in got["sft/math/train_loss"]] == [1, 2]
    assert got["sft/math/probe/pass@1"] == [(r["step"], pytest.approx(r["pass@1"])) for r in curve]
    assert got["sft/math/val_loss"] == [(r["step"], pytest.approx(r["val_loss"])) for r in curve]
    assert [s for s, _ in got["sft/math/probe/pass@k"]] == [1, 2]
    chosen = next(r["step"] for r in curve if r["chosen"])
    assert got["sft/math/chosen_step"] == [(2, chosen)] and "sft/math/train_seconds" in got
    assert {"sft/math/learning_rate", "sft/math/tokens_per_second"} <= set(got)
    # --report-to beats the file: none -> no second tracker run
    res = CliRunner().invoke(main, ["sft", str(cfgp), "--no-progress", "--report-to", "none"])
    assert res.exit_code == 0, res.output
    assert len(list((sft / "tensorboard").iterdir())) == 1


@pytest.mark.slow
def test_rl_command_phases_get_their_own_namespaces(tmp_path, tiny_qwen3):
    pytest.importorskip("tensorboard")
    tasks = write_tasks_file(tmp_path / "tasks.jsonl")
    run = {"model": str(tiny_qwen3), "seed": 0, "run_dir": str(tmp_path / "runs"),
           "rl": {"tasks": str(tasks), "batch_size": 2, "group_size": 2, "progress": False,
                  "sampling": {"max_tokens": 3}, "phases": [{"name": "a", "steps": 2}, {"name": "b", "steps": 1}]}}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(run))
    r = CliRunner().invoke(main, ["rl", str(cfg), "--report-to", "tensorboard", "--no-progress"])
    assert r.exit_code == 0, r.output
    json.loads(r.output.strip().splitlines()[-1])  # the command's JSON line is still the last line of stdout
    out = tmp_path / "runs" / "rl"
    got = scalars(one_logdir(out, "rl-"))
    for phase, steps in (("a", [1, 2]), ("b", [1])):
        rows = [json.loads(x) for x in (out / "phases" / phase / "metrics.jsonl").read_text().splitlines()]
        assert got[f"rl/{phase}/reward_mean"] == [(s, pytest.approx(m["reward_mean"])) for s, m in zip(steps, rows)]
        assert [s for s, _ in got[f"rl/{phase}/step_s"]] == steps
        assert f"rl/{phase}/step" not in got and f"rl/{phase}/reason" not in got  # the axis, a string: not metrics


def test_merge_command_sends_its_timing(tmp_path, tiny_qwen3):
    import shutil

    pytest.importorskip("tensorboard")
    twin = shutil.copytree(tiny_qwen3, tmp_path / "twin")
    cfg = tmp_path / "merge.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(tiny_qwen3), "parameters": {"weight": 0.5}},
        {"model": str(twin), "parameters": {"weight": 0.5}}]}))
    out = tmp_path / "merged" / "model"
    r = CliRunner().invoke(main, ["merge", str(cfg), str(out), "--quiet", "--report-to", "tensorboard"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output.strip().splitlines()[-1])
    got = scalars(one_logdir(out.parent, "merge-"))  # beside OUT_DIR, not in it
    assert got["merge/seconds"] == [(0, pytest.approx(res["seconds"]))]
    assert got["merge/tensors"] == [(0, res["tensors"])]
    assert not (out / "tensorboard").exists()


def test_run_driver_one_tracker_run_with_a_namespace_per_stage(tmp_path, monkeypatch):
    """`mlx_ssp run`: one tracker run in RUN_DIR/tensorboard, each stage under its own name (the stage
    functions here are stand-ins that log like the real ones); --report-to beats report_to: none."""
    pytest.importorskip("tensorboard")
    from dataclasses import replace

    from mlx_ssp import pipeline

    def make(name):
        def fn(run):
            run.stage_dir(name).mkdir(parents=True, exist_ok=True)
            trackers.log("", {"value": len(name)}, step=3)  # as a stage logs: no stage name of its own
            return {}
        return fn

    for s, st in list(pipeline.STAGE_REGISTRY.items()):  # in place: every module holds this one registry
        monkeypatch.setitem(pipeline.STAGE_REGISTRY, s, replace(st, run=make(s)))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\nreport_to: none\nmodel: demo\nrollout: {{k: 2}}\n"
                   "tasks: {domains: {addition: {source: 'reasoning_gym:basic_arithmetic', "
                   "sizes: {train: 2, probe: 1, eval: 1}}}}\n")
    r = CliRunner().invoke(main, ["run", str(cfg), "--report-to", "tensorboard", "--no-progress"])
    assert r.exit_code == 0, r.output
    logdir = one_logdir(tmp_path / "run", "run-")
    got = scalars(logdir)
    stages = pipeline.active_stages(pipeline.load_run(cfg))
    for s in stages:
        assert got[f"{s}/value"] == [(3, len(s))] and [st for st, _ in got[f"{s}/stage_seconds"]] == [0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir))
    ea.Reload()
    params = yaml.safe_load(ea.Tensors("config")[0].tensor_proto.string_val[0].decode().strip("`\n"))
    assert params == yaml.safe_load((tmp_path / "run" / "config.resolved.yaml").read_text())
    assert params["rollout"]["k"] == 2 and "sampling" in params["rollout"]  # with its defaults filled in
    # the file's report_to: none, no flag -> no second tracker run
    r = CliRunner().invoke(main, ["run", str(cfg), "--no-progress", "--from", "eval"])
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 1
