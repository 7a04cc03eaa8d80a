"""`mlx_ssp run` on the agents config (configs/agents-bfcl.yaml) at smoke size, on a tiny model whose
tokenizer was trained on BFCL's tool schemas (so prompts are ~650 tokens): every stage on episodes
(gold selection, multi-turn SFT per backend and the blend, merge, RL on episodes, eval with breadth),
then a kill during SFT resumes to the identical table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from mlx_ssp import pipeline
from mlx_ssp.pipeline import stages

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_agent_model(tmp_path_factory) -> Path:
    from mlx_ssp.testing import make_tiny_agent_model

    return make_tiny_agent_model(tmp_path_factory.mktemp("tiny_agent"))


def _config(tmp_path: Path, model: Path) -> Path:
    """configs/agents-bfcl.yaml cut to two backends, one task per split, a few tokens and steps."""
    cfg = yaml.safe_load((ROOT / "configs" / "agents-bfcl.yaml").read_text())
    cfg["model"] = str(model)
    cfg["run_dir"] = str(tmp_path / "run")
    cfg["tasks"]["domains"] = {d: {**v, "sizes": {"train": 1, "probe": 1, "eval": 1}}
                               for d, v in cfg["tasks"]["domains"].items() if d in ("file_system", "trading")}
    short = {"temperature": 1.0, "max_tokens": 4}
    cfg["rollout"].update(k=2, sampling=short, batch_size=4)
    cfg["sft"].update(iters=2, save_every=1, lora={"rank": 2, "num_layers": -1}, learning_rate=1e-3,
                      probe={"k": 1, "max_tasks": 1, "sampling": short, "progress": False})
    cfg["rl"].update(steps=2, sampling=short, lora={"rank": 2, "num_layers": -1}, learning_rate=1e-4)
    cfg["eval"].update(k=1, sampling=short)
    p = tmp_path / "agents.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.slow
def test_agents_pipeline_end_to_end_and_resume(tmp_path, tiny_agent_model):
    cfg = _config(tmp_path, tiny_agent_model)
    run_dir = tmp_path / "run"
    out: list[str] = []
    pipeline.run_pipeline(cfg, (), progress=False, echo=out.append)
    table = json.loads((run_dir / "eval" / "table.json").read_text())
    stages = [r["stage"] for r in table["rows"]]
    assert stages == ["base", "specialist:file_system", "specialist:trading", "blend", "merged", "rl"]
    assert table["domains"] == ["file_system", "trading"] and all("breadth" in r for r in table["rows"])
    # the SFT data: gold episodes (the tiny model passes nothing) as whole conversations with masks
    rows = [json.loads(x) for x in (run_dir / "select" / "file_system" / "train.jsonl").read_text().splitlines()]
    assert rows and all(r["source"] == "gold" and len(r["token_ids"]) == len(r["mask"]) for r in rows)
    blend = [json.loads(x) for x in (run_dir / "select" / "_blend" / "train.jsonl").read_text().splitlines()]
    assert {r["task_id"].split("-")[0] for r in blend} == {"file_system", "trading"}
    summary = json.loads((run_dir / "sft" / "summary.json").read_text())
    assert set(summary["domains"]) == {"file_system", "trading", "blend"}
    merged_from = json.loads((run_dir / "merge" / "_stage.json").read_text())["metrics"]["models"]
    assert set(merged_from) == {"file_system", "trading"}  # the blend is compared with, never merged
    recs = [json.loads(x) for x in (run_dir / "rollout" / "rollouts.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["kind"] == "episode" for r in recs)

    # a kill during SFT, in the blend's first step (in place: SFT's fingerprint names its data files):
    # the specialists are done, the blend has no checkpoint yet, nothing after SFT ran
    sft = run_dir / "sft"
    weights = {p.relative_to(run_dir): _sha(p) for p in sorted(run_dir.glob("**/*.safetensors"))
               if "checkpoints" not in p.parts}  # the fused specialists, blend, merged and RL models
    assert len(weights) >= 5
    shutil.rmtree(sft / "specialists" / "blend")
    for p in (sft / "blend" / "checkpoints").iterdir():
        shutil.rmtree(p)
    (sft / "blend" / "result.json").unlink()
    (sft / "summary.json").unlink()
    done_before = (sft / "file_system" / "result.json").stat().st_mtime_ns
    st = json.loads((sft / "_stage.json").read_text())
    st["complete"] = False
    (sft / "_stage.json").write_text(json.dumps(st))
    for stage in ("merge", "rl", "eval"):
        shutil.rmtree(run_dir / stage)
    out2: list[str] = []
    pipeline.run_pipeline(cfg, (), progress=False, echo=out2.append)
    assert any("[rollout] complete, skipping" in line for line in out2)
    assert (sft / "file_system" / "result.json").stat().st_mtime_ns == done_before  # not retrained
    assert json.loads((run_dir / "eval" / "table.json").read_text()) == table
    # the table of a tiny model is all zeros: the weights are what shows the resume redid the same work
    assert {p: _sha(run_dir / p) for p in weights} == weights


def _sha(p: Path) -> str:
    import hashlib

    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_episode_select_refuses_a_teacher_with_another_tokenizer(tmp_path, tiny_agent_model, tiny_qwen3):
    """Episode SFT examples are the teacher's sampled ids: a teacher whose tokenizer differs from the
    model's would train the student on another vocabulary, so the select stage stops, naming why."""
    from mlx_ssp.errors import UserError
    from mlx_ssp.models import ModelConfig
    from mlx_ssp.tasks import write_tasks
    from mlx_ssp.tasks.build import export_source

    run = pipeline.Run(run_dir=tmp_path, data={"teacher": {"path": str(tiny_qwen3)}}, source="agents.yaml", seed=0)
    run.sections.update(model=ModelConfig(path=str(tiny_agent_model)), teacher=ModelConfig(path=str(tiny_qwen3)))
    write_tasks(run.tasks_path("train"), export_source("bfcl_multi_turn:base", params={"backend": "trading"})[:1])
    with pytest.raises(UserError, match="teacher's tokenizer differs"):
        stages.stage_select(run)
