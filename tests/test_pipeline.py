"""`mlx_ssp run`: stage order, skipping, resuming, config changes, --from/--only, the table, the report.

The driver tests replace the stage functions with fast fakes that record calls; the end-to-end test
runs configs/smoke.yaml on the demo model (every real stage, minimal sizes), then simulates a kill in
several stages and checks that the resumed run ends with the same table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mlx_ssp import pipeline
from mlx_ssp.errors import UserError
from mlx_ssp.pipeline import stages

from test_hub import fake_hub  # noqa: F401  (the loopback Hub stand-in, a fixture)
from test_trackers import one_logdir, scalars

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
run_dir: {run_dir}
seed: 0
model: demo
tasks:
  domains:
    addition:
      source: reasoning_gym:basic_arithmetic
      params: {{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ["+"]}}
      sizes: {{train: 2, probe: 1, eval: 1}}
rollout: {{k: {k}}}
"""


@pytest.fixture
def fake_stages(monkeypatch):
    calls: list[str] = []

    def make(name):
        def fn(run):
            calls.append(name)
            d = run.stage_dir(name)
            d.mkdir(parents=True, exist_ok=True)
            (d / "out.txt").write_text(name)
            if name == "sft":  # what the driver reads to find the run's models
                (d / "summary.json").write_text(json.dumps({"domains": {}}))
            if name == "eval":
                table = {"k": 2, "domains": ["addition"], "rows": [
                    {"stage": "base", "overall": {"pass@1": 0.1, "pass@2": 0.2},
                     "domains": {"addition": {"pass@1": 0.1, "pass@2": 0.2}}}]}
                (d / "table.json").write_text(json.dumps(table))
            return {"ok": name}

        return fn

    for s, st in list(pipeline.STAGE_REGISTRY.items()):  # in place: every module holds this one registry
        monkeypatch.setitem(pipeline.STAGE_REGISTRY, s, replace(st, run=make(s)))
    return calls


def _write(tmp_path, k=4):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(run_dir=tmp_path / "run", k=k))
    return cfg


def test_runs_all_stages_then_skips(tmp_path, fake_stages):
    cfg = _write(tmp_path)
    out: list[str] = []
    pipeline.run_pipeline(cfg, echo=out.append)
    active = [s for s in pipeline.STAGES if pipeline.STAGE_REGISTRY[s].section is None]  # no distill: section
    assert fake_stages == active
    run = tmp_path / "run"
    assert (run / "config.resolved.yaml").exists()
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["stage"] for e in events if e["event"] == "end"] == active
    assert any("| base |" in line for line in out)  # the table is printed at the end
    fake_stages.clear()
    out.clear()
    pipeline.run_pipeline(cfg, echo=out.append)
    assert fake_stages == []
    assert all("skipping" in line for line in out if line.startswith("["))


def test_config_change_reruns_that_stage_and_later(tmp_path, fake_stages):
    cfg = _write(tmp_path)
    pipeline.run_pipeline(cfg, echo=lambda s: None)
    fake_stages.clear()
    out: list[str] = []
    pipeline.run_pipeline(cfg, ("rollout.k=8",), echo=out.append)
    assert fake_stages == ["rollout", "select", "sft", "merge", "rl", "eval"]
    assert any("[rollout] rerunning" in line and "changed" in line for line in out)
    stale = list((tmp_path / "run" / ".stale").iterdir())
    assert any(p.name.startswith("rollout-") for p in stale)  # moved aside, not deleted
    # a change to an early section invalidates everything after it
    fake_stages.clear()
    pipeline.run_pipeline(cfg, ("rollout.k=8", "tasks.seed=7"), echo=lambda s: None)
    assert fake_stages == [s for s in pipeline.STAGES if s != "distill"]  # no distill: section


def test_interrupted_stage_resumes_and_later_stages_rerun(tmp_path, fake_stages, monkeypatch):
    cfg = _write(tmp_path)
    boom = {"n": 0}
    real = pipeline.STAGE_REGISTRY["sft"].run

    def flaky(run):
        boom["n"] += 1
        if boom["n"] == 1:
            raise KeyboardInterrupt  # killed mid-stage
        return real(run)

    monkeypatch.setitem(pipeline.STAGE_REGISTRY, "sft", replace(pipeline.STAGE_REGISTRY["sft"], run=flaky))
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_pipeline(cfg, echo=lambda s: None)
    assert fake_stages == ["tasks", "rollout", "select"]
    fake_stages.clear()
    out: list[str] = []
    pipeline.run_pipeline(cfg, echo=out.append)
    assert fake_stages == ["sft", "merge", "rl", "eval"]
    assert any("[sft] resuming" in line for line in out)


def test_from_and_only(tmp_path, fake_stages):
    cfg = _write(tmp_path)
    with pytest.raises(UserError, match="not complete"):
        pipeline.run_pipeline(cfg, only="eval", echo=lambda s: None)
    pipeline.run_pipeline(cfg, echo=lambda s: None)
    fake_stages.clear()
    pipeline.run_pipeline(cfg, from_stage="merge", echo=lambda s: None)
    assert fake_stages == ["merge", "rl", "eval"]
    fake_stages.clear()
    pipeline.run_pipeline(cfg, only="select", echo=lambda s: None)
    assert fake_stages == ["select"]


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mlx_ssp.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_second_process_is_refused_while_the_driver_runs(tmp_path, fake_stages, monkeypatch):
    """The driver holds the run directory's lock for the whole run and every stage directory's lock:
    while it is in the sft stage, a second `mlx_ssp run` (before: "resuming an interrupted run", then
    training beside it) and a standalone `mlx_ssp sft` into RUN_DIR/sft each fail at once with one
    line naming the directory and the driver's pid; the rollout stage inside the driver takes its own
    lock (rollout/.rollouts.jsonl.lock), a different file, so the driver never waits on itself."""
    from mlx_ssp.io import exclusive_lock
    from mlx_ssp.rollout.resume import lock_path

    cfg = _write(tmp_path)
    run_dir = tmp_path / "run"
    seen = {}
    rollout = pipeline.STAGE_REGISTRY["rollout"].run

    def locked_rollout(run):  # what run_rollouts does inside the driver
        with exclusive_lock(lock_path(run.stage_dir("rollout") / "rollouts.jsonl"), "rollouts"):
            return rollout(run)

    sft_fake = pipeline.STAGE_REGISTRY["sft"].run

    def sft(run):
        seen["run"] = _cli("run", cfg, "--only", "sft")
        seen["sft"] = _cli("sft", cfg)
        return sft_fake(run)

    monkeypatch.setitem(pipeline.STAGE_REGISTRY, "rollout", replace(pipeline.STAGE_REGISTRY["rollout"], run=locked_rollout))
    monkeypatch.setitem(pipeline.STAGE_REGISTRY, "sft", replace(pipeline.STAGE_REGISTRY["sft"], run=sft))
    out: list[str] = []
    pipeline.run_pipeline(cfg, echo=out.append)
    for cmd, what in (("run", f"run directory {run_dir}"), ("sft", f"{run_dir / 'sft'}")):
        r = seen[cmd]
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert what in r.stderr and f"pid {os.getpid()}" in r.stderr, r.stderr
        assert "resuming" not in r.stdout
    assert not any("resuming" in line for line in out)
    assert not (run_dir / pipeline.RUN_LOCK).exists() and not (run_dir / ".sft.lock").exists()  # released


def test_run_lock_left_by_a_killed_driver_is_not_stale(tmp_path, fake_stages):
    """A driver killed with SIGKILL leaves its lock file; the OS released the flock, so the next run goes on."""
    cfg = _write(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from mlx_ssp import pipeline\n"
        "run = pipeline.load_run(sys.argv[1]); run.run_dir.mkdir(parents=True)\n"
        "with pipeline.lock_run(run):\n"
        "    print('held', flush=True); time.sleep(60)\n"), str(cfg)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"run directory .*run is being written by another run \(pid {holder.pid}"):
            pipeline.run_pipeline(cfg, echo=lambda s: None)
        assert fake_stages == []
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "run" / pipeline.RUN_LOCK).exists()  # left behind by the kill
    pipeline.run_pipeline(cfg, echo=lambda s: None)
    assert fake_stages[-1] == "eval"


def test_run_dir_that_is_not_a_run_is_refused(tmp_path, fake_stages):
    """A non-empty run_dir without the run's state file (config.resolved.yaml) is refused before anything
    is written into it; an empty directory is a fresh run, and a run directory is resumed."""
    cfg = _write(tmp_path)
    run_dir = tmp_path / "run"
    (run_dir / "sft").mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"run_dir .*run is not empty \(notes.txt, sft\) and is not an mlx_ssp run"):
        pipeline.run_pipeline(cfg, echo=lambda s: None)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt", "sft"] and fake_stages == []
    r = _cli("run", cfg)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not an mlx_ssp run" in r.stderr
    shutil.rmtree(run_dir)
    run_dir.write_text("a file")
    with pytest.raises(UserError, match="is a file, not a directory"):
        pipeline.run_pipeline(cfg, echo=lambda s: None)
    run_dir.unlink()
    run_dir.mkdir()
    pipeline.run_pipeline(cfg, echo=lambda s: None)  # empty: a fresh run
    assert (run_dir / pipeline.RUN_MARKER).is_file()
    fake_stages.clear()
    pipeline.run_pipeline(cfg, echo=lambda s: None)  # a run: resumed (all complete)
    assert fake_stages == []


def test_bad_config_fails_before_any_stage(tmp_path, fake_stages):
    cfg = _write(tmp_path)
    with pytest.raises(UserError, match="rl.stepz"):
        pipeline.run_pipeline(cfg, ("rl.stepz=3",), echo=lambda s: None)
    with pytest.raises(UserError, match="eval.k"):
        pipeline.run_pipeline(cfg, ("eval.k=0",), echo=lambda s: None)
    assert fake_stages == []


# -- model cards and the upload of the final model -------------------------------------------------


def _model_dir(d: Path, card=None) -> Path:
    """A directory resolve_model accepts, with our card when ``card`` is given."""
    from mlx_ssp.card import write_card

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}\n')
    (d / "model.safetensors").write_bytes(bytes(range(256)))
    if card is not None:
        write_card(d, card)
    return d


@pytest.fixture
def model_stages(tmp_path, fake_stages, monkeypatch):
    """fake_stages whose sft, merge and rl write what the real ones leave: a fused specialist, the merge
    and the RL model, each a model directory with our card; the base is a user's model with its own
    README.md. Returns (run file, base)."""
    from mlx_ssp.card import Card

    base = _model_dir(tmp_path / "base")
    (base / "README.md").write_text("---\nlicense: mit\n---\n\n# my base model\n")

    def sft(run):
        fake_stages.append("sft")
        spec = _model_dir(run.stage_dir("sft") / "specialists" / "addition", Card("lora", (str(base),)))
        (run.stage_dir("sft") / "summary.json").write_text(json.dumps({"domains": {"addition": {"specialist": str(spec)}}}))
        return {}

    def merge(run):
        fake_stages.append("merge")
        _model_dir(run.stage_dir("merge") / "model", Card("merge", (str(run.stage_dir("sft") / "specialists" / "addition"),)))
        return {}

    def rl(run):
        fake_stages.append("rl")
        d = _model_dir(run.stage_dir("rl") / "model", Card("grpo", (str(run.stage_dir("merge") / "model"),)))
        (d / ".README.md.tmp-stale").write_text("an interrupted write")  # never uploaded
        return {}

    for name, fn in (("sft", sft), ("merge", merge), ("rl", rl)):
        monkeypatch.setitem(pipeline.STAGE_REGISTRY, name, replace(pipeline.STAGE_REGISTRY[name], run=fn))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(run_dir=tmp_path / "run", k=4).replace("model: demo", f"model: {base}"))
    return cfg, base


def _commits(hub) -> int:
    return sum(1 for method, path, _, _ in hub.requests if method == "POST" and "/commit/" in path)


def test_run_uploads_the_final_model_once_with_the_table_in_our_cards_only(tmp_path, model_stages, fake_stages, fake_hub):
    cfg, base = model_stages
    user_card = (base / "README.md").read_bytes()
    hub = fake_hub()
    out: list[str] = []
    pipeline.run_pipeline(cfg, ("upload.repo=org/final",), echo=out.append)
    run = tmp_path / "run"
    rl_model = run / "rl" / "model"
    assert _commits(hub) == 1 and list(hub.repos) == ["org/final"]
    assert hub.repos["org/final"]["visibility"] == "private"
    files = hub.repos["org/final"]["files"]
    assert set(files) == {"config.json", "model.safetensors", "README.md"}  # the hidden leftover stayed home
    assert all(files[n] == (rl_model / n).read_bytes() for n in files)
    readme = files["README.md"].decode()
    assert "## Held-out evaluation" in readme and "| base |" in readme and "row `rl`" in readme
    assert str(tmp_path) not in readme
    for d in (run / "sft" / "specialists" / "addition", run / "merge" / "model"):
        assert "| base |" in (d / "README.md").read_text() and str(tmp_path) not in (d / "README.md").read_text()
    assert (base / "README.md").read_bytes() == user_card  # the user's base model is never written
    assert any(line.startswith("[upload]") and "org/final" in line for line in out)
    # --only rl stops before eval: nothing is uploaded
    pipeline.run_pipeline(cfg, ("upload.repo=org/final",), only="rl", echo=lambda s: None)
    assert fake_stages.count("rl") == 2 and _commits(hub) == 1


def test_run_upload_checks_come_before_the_first_stage(tmp_path, model_stages, fake_stages, fake_hub, monkeypatch):
    from huggingface_hub import constants as hf_constants

    cfg, _ = model_stages
    hub = fake_hub()
    with pytest.raises(UserError, match="upload.repo"):  # --public alone would upload nothing, silently
        pipeline.run_pipeline(cfg, ("upload.public=true",), echo=lambda s: None)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf_home" / "stored_tokens"))
    with pytest.raises(UserError, match="HF_TOKEN"):
        pipeline.run_pipeline(cfg, ("upload.repo=org/final",), echo=lambda s: None)
    assert fake_stages == [] and not (tmp_path / "run").exists() and hub.requests == []
    r = subprocess.run([sys.executable, "-m", "mlx_ssp.cli", "run", str(cfg), "--public"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "upload.repo" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_final_model_is_the_distilled_student_else_the_last_rl_model(tmp_path):
    run = pipeline.load_run(_write(tmp_path))
    with pytest.raises(UserError, match="the RL model is missing"):
        pipeline.final_model(run)
    rl_model = _model_dir(tmp_path / "run" / "rl" / "model")
    assert pipeline.final_model(run) == str(rl_model)
    phased = pipeline.load_run(_write(tmp_path), ("rl.phases=[{name: a}, {name: b}]",))
    b = _model_dir(tmp_path / "run" / "rl" / "phases" / "b" / "model")
    _model_dir(tmp_path / "run" / "rl" / "phases" / "a" / "model")
    assert pipeline.final_model(phased) == str(b)
    student = _model_dir(tmp_path / "student")
    distilled = pipeline.load_run(_write(tmp_path), ("distill={}",))
    with pytest.raises(UserError, match="distilled student"):
        pipeline.final_model(distilled)
    (tmp_path / "run" / "distill").mkdir(parents=True)
    (tmp_path / "run" / "distill" / "report.json").write_text(json.dumps({"model": str(student)}))
    assert pipeline.final_model(distilled) == str(student)


@pytest.mark.slow
@pytest.mark.demo
def test_smoke_end_to_end_and_resume(tmp_path, monkeypatch):
    """configs/smoke.yaml on the demo model, every real stage; then kill-and-resume gives the same table."""
    from mlx_ssp.report import build_report
    from mlx_ssp.rl.trainer import Trainer

    # the first RL checkpoint as a kill right after it would leave it (step 2's drops its optimizer state)
    at_kill = tmp_path / "rl_checkpoint_1"
    save = Trainer.save_checkpoint

    def save_and_keep_first(tr):
        path = save(tr)
        if tr.step_no == 1:
            shutil.copytree(path, at_kill)
        return path

    monkeypatch.setattr(Trainer, "save_checkpoint", save_and_keep_first)
    run_dir = tmp_path / "smoke"
    out: list[str] = []
    pipeline.run_pipeline(ROOT / "configs" / "smoke.yaml", (f"run_dir={run_dir}",), progress=False, echo=out.append,
                          report_to=("tensorboard",))
    table = json.loads((run_dir / "eval" / "table.json").read_text())
    stages = [r["stage"] for r in table["rows"]]
    assert stages[0] == "base" and "merged" in stages and stages[-1] == "rl"
    specialists = [s.removeprefix("specialist:") for s in stages if s.startswith("specialist:")]
    assert specialists
    # the real stages' metrics reached the one tracker run, each under its stage's name
    tags = scalars(one_logdir(run_dir, "run-"))
    want = {"rollout/overall/pass@1", "rl/reward_mean", "eval/base/overall/pass@1",
            *(f"sft/{d}/train_loss" for d in specialists)}
    assert want <= set(tags), sorted(want - set(tags))
    assert tags["eval/base/overall/pass@1"] == [(0, pytest.approx(table["rows"][0]["overall"]["pass@1"]))]
    assert any("| base |" in line for line in out)
    rollouts = (run_dir / "rollout" / "rollouts.jsonl").read_text().splitlines()
    assert len(rollouts) == 8 * 4  # 2 domains x 4 train prompts x K=4

    report = build_report(run_dir)
    text = report.read_text()
    assert "Held-out evaluation" in text and "![pass@k" in text
    assert (report.parent / "passk.png").stat().st_size > 1000

    # Simulate a kill during RL, after its first checkpoint: step 2, the fused model and the whole
    # eval stage are gone, the RL stage is marked incomplete.
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    rl = resumed / "rl"
    ckpts = sorted((rl / "checkpoints").iterdir())
    assert len(ckpts) == 2
    shutil.rmtree(ckpts[-1])
    shutil.rmtree(ckpts[0])
    shutil.copytree(at_kill, ckpts[0])
    shutil.rmtree(rl / "model")
    rows = (rl / "metrics.jsonl").read_text().splitlines()
    (rl / "metrics.jsonl").write_text(rows[0] + "\n" + rows[1][:20])  # a torn second row
    st = json.loads((rl / "_stage.json").read_text())
    st["complete"] = False
    (rl / "_stage.json").write_text(json.dumps(st))
    shutil.rmtree(resumed / "eval")
    out2: list[str] = []
    pipeline.run_pipeline(ROOT / "configs" / "smoke.yaml", (f"run_dir={resumed}",), progress=False, echo=out2.append)
    assert any("[rl] resuming" in line for line in out2)
    assert any("[sft] complete, skipping" in line for line in out2)
    assert json.loads((resumed / "eval" / "table.json").read_text()) == table

    # A kill during eval: the models already evaluated are kept, the rest are evaluated.
    ev = resumed / "eval"
    (ev / "rl.json").unlink()
    (ev / "table.json").unlink()
    st = json.loads((ev / "_stage.json").read_text())
    st["complete"] = False
    (ev / "_stage.json").write_text(json.dumps(st))
    before = (ev / "base.json").stat().st_mtime_ns
    pipeline.run_pipeline(ROOT / "configs" / "smoke.yaml", (f"run_dir={resumed}",), progress=False, echo=lambda s: None)
    assert (ev / "base.json").stat().st_mtime_ns == before  # not re-evaluated
    assert json.loads((ev / "table.json").read_text()) == table


def test_distill_stage_defaults_to_the_rl_models(tmp_path, monkeypatch):
    """distill: sources default to every kept RL model (phases in order), the student to the last,
    the sft: settings (minus its domains) are the student's SFT base; eval gets a distilled row."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(run_dir=tmp_path / "run", k=2) + "sft: {iters: 3, domains: [addition]}\ndistill: {k: 2}\n")
    run = pipeline.load_run(cfg)
    seen = {}

    def fake(dcfg, **kw):
        seen.update(kw, k=dcfg.k)
        return {"model": str(tmp_path / "student")}

    monkeypatch.setattr(stages, "run_distill", fake)
    monkeypatch.setattr(stages, "rl_models", lambda run: {"rl:math": "/m1", "rl:code": "/m2"})
    out = stages.stage_distill(run)
    assert seen["sources"] == {"rl:math": "/m1", "rl:code": "/m2"} and seen["student"] == "/m2" and seen["k"] == 2
    assert seen["sft_base"] == {"iters": 3} and seen["out_dir"] == run.stage_dir("distill")
    assert out["model"] == str(tmp_path / "student")
    assert "distill" in pipeline.active_stages(run)
    (run.stage_dir("distill")).mkdir(parents=True)
    (run.stage_dir("distill") / "report.json").write_text(json.dumps(out))
    monkeypatch.setattr(pipeline.Run, "specialists", lambda self: {})
    monkeypatch.setattr(pipeline.Run, "blend", lambda self: None)
    assert list(pipeline.eval_models(run))[-1] == "distilled"
