"""`mlx_ssp run`'s registry and plan, pure and fast: the stage list, the plan of one stage, the
fingerprints (stable across refactors), the shipped configs and the eval table."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_ssp import pipeline
from mlx_ssp.commands import run as run_command
from mlx_ssp.errors import UserError

from test_pipeline import _write

ROOT = Path(__file__).resolve().parents[1]


def test_eval_table_and_gain():
    results = {
        "base": {"domains": {"a": {"pass@1": 0.1, "pass@4": 0.3}}, "overall": {"pass@1": 0.1, "pass@4": 0.3}},
        "rl": {"domains": {"a": {"pass@1": 0.25, "pass@4": 0.5}}, "overall": {"pass@1": 0.25, "pass@4": 0.5}},
    }
    table = pipeline.eval_table(results, k=4)
    assert table["gain"]["pass@1"] == pytest.approx(0.15) and table["gain"]["to"] == "rl"
    text = pipeline.format_eval_table(table)
    assert "| base | 0.100 | 0.300 | 0.100 | 0.300 |" in text and "+0.150" in text


def test_eval_table_breadth_counts_every_domain_once():
    """Overall is the mean over tasks; breadth the mean over domains (a big domain cannot hide a small
    one a specialist eroded)."""
    results = {"merged": {"domains": {"fs": {"pass@1": 0.8, "pass@2": 0.9, "n_tasks": 30},
                                      "trade": {"pass@1": 0.2, "pass@2": 0.4, "n_tasks": 10}},
                          "overall": {"pass@1": 0.65, "pass@2": 0.775}}}
    row = pipeline.eval_table(results, k=2)["rows"][0]
    assert row["breadth"]["pass@1"] == pytest.approx(0.5) and row["breadth"]["pass@2"] == pytest.approx(0.65)
    assert "breadth p@1" in pipeline.format_eval_table(pipeline.eval_table(results, k=2))
    results["merged"]["domains"]["trade"]["pass@1"] = None  # a domain without a figure: no breadth
    assert pipeline.eval_table(results, k=2)["rows"][0]["breadth"]["pass@1"] is None


def test_every_shipped_config_validates():
    """configs/*.yaml load with every section validated (no network: hub ids are not resolved here)."""
    from mlx_ssp.merge.config import load_merge_config
    from mlx_ssp.merge.multi import is_multimerge, load_multimerge, read_merge_documents

    for f in sorted((ROOT / "configs").glob("*.yaml")):
        run = pipeline.load_run(f)
        assert run.section("tasks").domains, f
    for f in sorted((ROOT / "configs").glob("*.yml")):
        if is_multimerge(read_merge_documents(f)):  # its models are a quickstart run's: not here
            assert len(load_multimerge(f, check_models=False).steps) > 1, f
        else:
            assert load_merge_config(f)[0].merge_method


def test_plan_stage_decisions():
    plan = pipeline.plan_stage
    done = {"fingerprint": "a", "complete": True}
    kw = dict(from_stage=None, only=None, invalidated=False)
    assert plan("sft", {}, "a", **kw)[0] == "run"
    assert plan("sft", done, "a", **kw)[0] == "skip"
    assert plan("sft", {"fingerprint": "a", "complete": False}, "a", **kw)[0] == "resume"
    assert plan("sft", done, "b", **kw) == ("rerun", "its config (or an earlier stage's) changed")
    assert plan("sft", done, "a", **{**kw, "invalidated": True})[0] == "rerun"
    assert plan("sft", done, "a", **{**kw, "from_stage": "sft"})[0] == "rerun"
    assert plan("select", done, "a", **{**kw, "from_stage": "sft"})[0] == "skip"
    assert plan("eval", {}, "a", **{**kw, "only": "sft"})[0] == "pass"
    # --only/--from force a complete stage to rerun, but an interrupted one with the same config resumes
    # (before: `--only rollout` after a Ctrl-C moved the finished samples to .stale/ and started again)
    partial = {"fingerprint": "a", "complete": False}
    assert plan("rollout", partial, "a", **{**kw, "only": "rollout"}) == ("resume", "interrupted")
    assert plan("rollout", partial, "a", **{**kw, "from_stage": "rollout"}) == ("resume", "interrupted")
    assert plan("rollout", done, "a", **{**kw, "only": "rollout"}) == ("rerun", "forced by --from/--only")
    assert plan("rollout", {}, "a", **{**kw, "only": "rollout"})[0] == "run"
    assert plan("rollout", partial, "b", **{**kw, "only": "rollout"})[0] == "rerun"  # another config: stale
    assert plan("select", partial, "a", **{**kw, "from_stage": "rollout", "invalidated": True})[0] == "rerun"
    with pytest.raises(UserError, match="--only sft"):
        plan("select", {}, "a", **{**kw, "only": "sft"})
    with pytest.raises(UserError, match="--from sft"):
        plan("select", done, "b", **{**kw, "from_stage": "sft"})


def test_stage_list_is_the_registry(tmp_path):
    """One registry: the stage order, the --from/--only choices and each fingerprint's sections come
    from STAGE_REGISTRY and SECTIONS; every stage says what it reports."""
    assert pipeline.STAGES == tuple(pipeline.STAGE_REGISTRY)
    choices = {p.name: tuple(p.type.choices) for p in run_command.cli.params if p.name in ("from_stage", "only")}
    assert choices == {"from_stage": pipeline.STAGES, "only": pipeline.STAGES}
    for st in pipeline.STAGE_REGISTRY.values():
        assert st.reports and callable(st.run) and all(s in pipeline.SECTIONS for s in st.sections)


def test_fingerprints_stable_and_sandbox_only_when_set(tmp_path):
    """A run directory made before a refactor keeps its fingerprints (so it is not redone); the
    top-level sandbox section counts only when the run file sets it."""
    cfg = _write(tmp_path)

    def fps(*overrides):
        run, prev, out = pipeline.load_run(cfg, overrides), "", {}
        for s in pipeline.active_stages(run):
            prev = out[s] = pipeline.fingerprint(run, s, prev)
        return out

    plain, boxed = fps(), fps("sandbox.nproc=16")
    assert plain["tasks"] == boxed["tasks"] == "e3cd922da9a72f60"  # the tasks section alone, seed 0
    assert all(plain[s] != boxed[s] for s in list(plain)[1:])
    # an optional stage is in the chain only when its section is set: eval then chains distill's
    with_distill = fps("distill.k=2")
    assert "distill" not in plain and "distill" in with_distill
    assert with_distill["rl"] == plain["rl"] and with_distill["eval"] != plain["eval"]


def test_shipped_smoke_config_keeps_every_stage_fingerprint():
    """Every stage fingerprint of configs/smoke.yaml as written by 3e5b942 (before issues 15-16) and
    0307e0a: a refactor that changes a resolved section (e.g. a new key in a dump) would make every
    existing run directory redo its stages from there."""
    from pathlib import Path

    cfg = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
    want = {
        "tasks": "b7587a9c699dd9bd", "rollout": "6b1a17128ef60a07", "select": "24e997def5cc588e",
        "sft": "4988e9a6d1bfe003", "merge": "3f6c85c28017ceec", "rl": "8e13e157f625e7cc",
        "eval": "9266bd535282d726",
    }
    # the trackers and the run's name say where metrics go, not what a stage computes
    for overrides in ((), ("report_to=[tensorboard,wandb]", "name=x")):
        run, prev, got = pipeline.load_run(cfg, overrides), "", {}
        assert run.report_to == (("tensorboard", "wandb") if overrides else ())
        for s in pipeline.active_stages(run):
            prev = got[s] = pipeline.fingerprint(run, s, prev)
        assert got == want, overrides
