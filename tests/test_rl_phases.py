"""The later RL phases: Long2Short shaping (pure), the 0/1 prompt filter (pure + through the rollout
engine), sequential phases (config, resume, skip, eval rows) on a tiny float32 model."""

from __future__ import annotations

import json
import zlib

import mlx_ssp  # noqa: F401
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from mlx_ssp.config import load_section
from mlx_ssp.errors import UserError
from mlx_ssp.models import ModelConfig
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.prompt_filter import accuracies, split_by_accuracy
from mlx_ssp.rl.shaping import correct_length_metrics, long2short, long2short_group
from mlx_ssp.tasks import Task, write_tasks
from mlx_ssp.verify import VerifyResult, register


# -- Long2Short ------------------------------------------------------------------------------------


def _reference(rewards, lengths, lam):
    """The Long2Short formula (mlx_ssp.rl.shaping's docstring) written out with Python floats (no NumPy)."""
    C = [i for i, r in enumerate(rewards) if r >= 0.999]
    out = [float(r) for r in rewards]
    if len(C) < 2:
        return out
    s = {i: 1.0 / lengths[i] for i in C}
    m = sum(s.values()) / len(C)
    mx_dev = max(abs(s[i] - m) for i in C)
    if mx_dev == 0:
        return out
    for i in C:
        out[i] = rewards[i] + lam * (s[i] - m) / mx_dev
    return out


def test_long2short_properties_on_random_groups():
    rng = np.random.default_rng(0)
    for trial in range(200):
        G = int(rng.integers(2, 9))
        r = rng.integers(0, 2, G).astype(float)
        L = rng.integers(1, 50, G).astype(float)
        lam = float(rng.choice([0.2, 0.5, 1.0]))
        got = long2short_group(r, L, lam)
        assert np.allclose(got, _reference(list(r), list(L), lam), atol=1e-12), trial
        assert abs(got.mean() - r.mean()) < 1e-12  # zero-sum: the group mean (MGPO's p) is unchanged
        wrong = r < 0.999
        assert np.array_equal(got[wrong], r[wrong])  # incorrect rewards untouched
        c = np.flatnonzero(~wrong)
        if len(c) >= 2 and len(set(L[c])) > 1:
            assert np.abs(got[c] - r[c]).max() == pytest.approx(lam)  # the largest shift is exactly lambda
            for i in c:  # strictly shorter correct -> strictly more reward
                for j in c:
                    if L[i] < L[j]:
                        assert got[i] > got[j]


def test_long2short_equal_lengths_and_single_correct_unchanged():
    r = np.array([1.0, 1.0, 0.0, 1.0])
    assert np.array_equal(long2short_group(r, [7, 7, 3, 7]), r)
    assert np.array_equal(long2short_group([1.0, 0.0, 0.0], [5, 1, 9]), [1.0, 0.0, 0.0])
    assert np.array_equal(long2short_group([0.0, 0.0], [5, 1]), [0.0, 0.0])


def test_long2short_batch_is_per_group():
    r = np.array([1, 1, 0, 1, 1, 1], float)
    L = np.array([2, 4, 1, 10, 10, 10], float)
    gid = np.array([0, 0, 0, 1, 1, 1])
    out = long2short(r, L, gid, 0.2)
    assert np.allclose(out[:3], [1.2, 0.8, 0.0])  # s = 0.5, 0.25: mean 0.375, max |dev| 0.125
    assert np.array_equal(out[3:], r[3:])  # the other group (equal lengths) is untouched


def test_correct_length_metrics():
    g = [[{"reward": 1.0, "num_tokens": 4}, {"reward": 0.0, "num_tokens": 9}],
         [{"reward": 1.0, "num_tokens": 8}, {"reward": 0.5, "num_tokens": 2}]]
    m = correct_length_metrics(g)
    assert m["pass@1"] == 0.5 and m["correct_len_mean"] == 6.0 and m["len_mean"] == 5.75
    assert correct_length_metrics([[{"reward": 0.0, "num_tokens": 3}]])["correct_len_mean"] is None


def test_advantage_hook_shapes_only_when_set():
    """The loop's reward -> advantage step: with long2short the kept groups' rewards are shaped
    before MGPO (its weights unchanged: the group means are the same); without, nothing changes."""
    from mlx_ssp.rl.batch import advantage_batch

    groups = [[{"reward": 1.0, "num_tokens": n, "prompt_token_ids": [1, 2], "token_ids": [3] * n,
                "logprobs": [-1.0] * n} for n in (2, 6)] + [
        {"reward": 0.0, "num_tokens": 3, "prompt_token_ids": [1, 2], "token_ids": [3] * 3, "logprobs": [-1.0] * 3}]]
    plain, shaped = RLConfig(), RLConfig(long2short={"lambda": 0.2})
    r0, r1 = {}, {}
    b0 = advantage_batch(plain, groups, r0)
    b1 = advantage_batch(shaped, groups, r1)
    a0, a1 = np.array(b0["adv"]), np.array(b1["adv"])
    assert "shaping_abs_mean" not in r0 and r1["shaping_abs_mean"] > 0
    assert a0[0] == pytest.approx(a0[1]) and a1[0] > a1[1]  # the short correct answer gets more
    assert r0["mgpo_weight_mean"] == pytest.approx(r1["mgpo_weight_mean"])


# -- the 0/1 filter ----------------------------------------------------------------------------------


def test_split_by_accuracy_removes_exactly_saturated_and_impossible():
    acc = {"a": 0.0, "b": 1.0, "c": 0.5, "d": 0.125, "e": 1.0, "f": 0.875}
    kept, removed = split_by_accuracy(acc)
    assert kept == ["c", "d", "f"]
    assert removed == {"all_correct": ["b", "e"], "all_wrong": ["a"]}
    recs = [{"task_id": "x", "reward": r} for r in (1.0, 0.0, 1.0)] + [{"task_id": "y", "reward": 0.9995}]
    assert accuracies(recs) == {"x": pytest.approx(2 / 3), "y": 1.0}


# -- config ----------------------------------------------------------------------------------------


def test_new_keys_are_left_out_of_dumps_until_set():
    """An rl: section that sets none of the later phases' keys dumps as before (its fingerprints hold)."""
    d = RLConfig().model_dump(mode="json")
    assert not {"long2short", "prompt_filter", "phases"} & set(d)
    c = load_section({"rl": {"long2short": {}, "prompt_filter": {"k": 4}}}, "rl")
    d = c.model_dump(mode="json")
    assert d["long2short"] == {"lambda": 0.2} and d["prompt_filter"]["k"] == 4
    assert RLConfig.model_validate(d) == c  # the dump loads back (config.resolved.yaml)


def test_phase_config_merges_and_validates():
    c = load_section({"rl": {"steps": 5, "sampling": {"max_tokens": 32}, "phases": [
        {"name": "math", "domains": ["addition"]},
        {"name": "short", "long2short": {"lambda": 0.3}, "sampling": {"max_tokens": 16}, "steps": 2}]}}, "rl")
    (_, c1), (_, c2) = c.resolved_phases()
    assert (c1.steps, c1.sampling.max_tokens, c1.long2short) == (5, 32, None)
    assert (c2.steps, c2.sampling.max_tokens, c2.long2short.lambda_) == (2, 16, 0.3)
    assert c2.sampling.temperature == 1.0  # deep merge: the rest of rl.sampling is kept
    assert c.model_dump(mode="json")["phases"][0] == {"name": "math", "domains": ["addition"]}
    bad = [({"phases": [{"name": "m", "stepz": 1}]}, "rl.phases.0.stepz"),
           ({"phases": [{"name": "m", "steps": 0}]}, "phases.0.steps"),
           ({"phases": [{"name": "m", "output": "x"}]}, "rl.phases.0.output"),
           ({"phases": [{"name": "a"}, {"name": "a"}]}, "names must differ"),
           ({"phases": [{"name": "../x"}]}, "rl.phases.0.name"),
           ({"phases": [{"name": "m", "verifier": "nope"}]}, "unknown verifier"),
           ({"phases": []}, "rl.phases"),
           ({"long2short": {"lambda": -1}}, "rl.long2short.lambda"),
           ({"prompt_filter": {"k": 0}}, "rl.prompt_filter.k")]
    for raw, msg in bad:
        with pytest.raises(UserError, match=msg.replace(".", r"\.")):
            load_section({"rl": raw}, "rl")


# -- phases on a tiny model ------------------------------------------------------------------------


@register("rl_phase_test")
def _by_answer(completion: str, task) -> VerifyResult:
    """'all': always right; 'none': never; 'mixed': right for about half the completions."""
    ok = {"all": True, "none": False}.get(task.answer, zlib.crc32(completion.encode()) % 2 == 0)
    return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer")


def _tasks():
    answers = ["all", "none", "mixed", "mixed", "all", "mixed"]
    doms = ["a", "a", "a", "b", "b", "b"]
    return [Task(id=f"t{i}", domain=d, prompt=f"Question {i}: what next?", answer=a, verifier="rl_phase_test")
            for i, (a, d) in enumerate(zip(answers, doms))]


def _rl(**kw):
    base = dict(steps=1, batch_size=2, group_size=2, sampling={"temperature": 1.0, "max_tokens": 3},
                learning_rate=1e-2, progress=False, checkpoint_every=100, micro_batch_size=4)
    base.update(kw)
    return load_section({"rl": base}, "rl")


def test_phases_run_in_order_skip_when_finished_and_resume(tiny_qwen3, tmp_path, monkeypatch):
    from mlx_ssp.rl import phases, trainer
    from mlx_ssp.rl.phases import phase_models, run_phases

    cfg = _rl(phases=[{"name": "first", "domains": ["a"], "prompt_filter": {"k": 8}},
                      {"name": "second", "long2short": {}, "steps": 2}])
    out = tmp_path / "rl"
    s = run_phases(ModelConfig(path=str(tiny_qwen3)), _tasks(), cfg, out, seed=0)
    assert [p["name"] for p in s["phases"]] == ["first", "second"] and s["steps"] == 3
    first, second = out / "phases" / "first", out / "phases" / "second"
    # the filter ran on domain a only: t0 (always right) and t1 (never) are removed, t2 kept
    rep = json.loads((first / "prompt_filter.json").read_text())
    assert rep["counts"] == {"prompts": 3, "kept": 1, "all_correct": 1, "all_wrong": 1, "skipped": 0}
    assert rep["removed"]["all_correct"] == ["t0"] and rep["removed"]["all_wrong"] == ["t1"]
    assert s["phases"][0]["prompt_filter"] == rep["counts"] and s["phases"][0]["tasks"] == 1
    # the second phase starts from the first one's fused model, and logs the Long2Short figures
    assert json.loads((second / "rl_config.json").read_text())["model"] == str(first / "model")
    rows = [json.loads(x) for x in (second / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("pass@1" in r and "correct_len_mean" in r for r in rows)
    assert list(phase_models(out, cfg)) == ["first", "second"]

    # a rerun trains nothing; a killed second phase (no phase.json, no model) is the only one redone
    calls = []
    real_train = trainer.train
    monkeypatch.setattr(phases, "train", lambda *a, **k: calls.append(a[4]) or real_train(*a, **k))
    run_phases(ModelConfig(path=str(tiny_qwen3)), _tasks(), cfg, out, seed=0)
    assert calls == []
    (second / "phase.json").unlink()
    import shutil

    shutil.rmtree(second / "model")
    s2 = run_phases(ModelConfig(path=str(tiny_qwen3)), _tasks(), cfg, out, seed=0)
    assert [str(c) for c in calls] == [str(second)] and (second / "model").is_dir()
    assert s2["phases"][1]["steps"] == 2
    # a finished phase whose settings changed is an error, not a silent reuse
    changed = _rl(phases=[{"name": "first", "domains": ["a"], "prompt_filter": {"k": 8}, "learning_rate": 1e-3},
                          {"name": "second", "long2short": {}, "steps": 2}])
    with pytest.raises(UserError, match="'first' finished with other settings"):
        run_phases(ModelConfig(path=str(tiny_qwen3)), _tasks(), changed, out, seed=0)


def test_single_phase_filter_and_cli(tiny_qwen3, tmp_path):
    """``mlx_ssp rl`` without phases: one run in rl/ as before, with the 0/1 filter's counts; and a
    filter that leaves nothing is one clear error."""
    from mlx_ssp.cli import main

    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, _tasks())
    run = {"model": str(tiny_qwen3), "seed": 0, "run_dir": str(tmp_path / "runs"),
           "rl": {"tasks": str(tasks), "steps": 1, "batch_size": 2, "group_size": 2, "progress": False,
                  "sampling": {"max_tokens": 3}, "prompt_filter": {"k": 8}}}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(run))
    r = CliRunner().invoke(main, ["rl", str(cfg)])
    assert r.exit_code == 0, r.output
    line = json.loads(r.output.strip().splitlines()[-1])
    assert line["prompt_filter"]["kept"] == 3 and line["prompt_filter"]["all_correct"] == 2
    assert (tmp_path / "runs" / "rl" / "adapters.safetensors").is_file()
    write_tasks(tasks, [t for t in _tasks() if t.answer != "mixed"])
    r = CliRunner().invoke(main, ["rl", str(cfg), "--restart"])
    assert r.exit_code == 2 and "removed every prompt" in r.output


def test_eval_models_one_row_per_phase(tiny_qwen3, tmp_path):
    from mlx_ssp import pipeline

    run = pipeline.Run(run_dir=tmp_path, data={"model": "demo", "rl": {"phases": [{"name": "m"}, {"name": "c"}]}},
                       source="t", seed=0)
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "summary.json").write_text(json.dumps({"domains": {"x": {"specialist": "/s/x"}}}))
    for name in ("m", "c"):
        (tmp_path / "rl" / "phases" / name / "model").mkdir(parents=True)
    run.sections["model"] = ModelConfig(path=str(tiny_qwen3))  # a local path: no hub lookup
    models = pipeline.eval_models(run)
    assert list(models) == ["base", "specialist:x", "merged", "rl:m", "rl:c"]
    assert models["rl:c"] == str(tmp_path / "rl" / "phases" / "c" / "model")
    run.sections["rl"] = RLConfig()  # without phases: the one "rl" row, when its model exists
    assert "rl" not in pipeline.eval_models(run)
    (tmp_path / "rl" / "model").mkdir()
    assert list(pipeline.eval_models(run))[-1] == "rl"


def test_pipeline_rl_stage_with_phases(tiny_qwen3, tmp_path):
    """The pipeline's rl stage: phases from the merged model, one metrics entry per phase, and the
    eval rows of their models."""
    from mlx_ssp import pipeline
    from mlx_ssp.pipeline import stages

    rl = {"steps": 1, "batch_size": 2, "group_size": 2, "progress": False, "sampling": {"max_tokens": 3},
          "phases": [{"name": "p1", "domains": ["b"]}, {"name": "p2", "long2short": {"lambda": 0.2}}]}
    run = pipeline.Run(run_dir=tmp_path, data={"model": str(tiny_qwen3), "rl": rl}, source="t", seed=0,
                       progress=False)
    write_tasks(run.tasks_path("train"), _tasks())
    (tmp_path / "merge").mkdir()
    (tmp_path / "merge" / "model").symlink_to(tiny_qwen3)
    m = stages.stage_rl(run)
    assert [p["name"] for p in m["phases"]] == ["p1", "p2"] and m["steps"] == 2
    assert m["phases"][0]["tasks"] == 3 and m["phases"][1]["tasks"] == 6
    assert m["model"] == str(tmp_path / "rl" / "phases" / "p2" / "model")
    assert all(p["pass@1"] is not None for p in m["phases"])
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "summary.json").write_text(json.dumps({"domains": {}}))
    assert list(pipeline.eval_models(run))[-2:] == ["rl:p1", "rl:p2"]
    assert not (tmp_path / "rl" / "model").exists()  # no single-run model beside the phases


def test_report_reads_every_phase_in_order(tmp_path):
    """mlx_ssp report on a phased run: the steps of every phase, in the run's phase order, one
    table row per phase (pass@1 and the correct length: Long2Short's effect)."""
    import json as _json

    import yaml as _yaml

    from mlx_ssp.report import rl_md, rl_rows

    run = tmp_path / "run"
    (run / "rl" / "phases").mkdir(parents=True)
    (run / "config.resolved.yaml").write_text(_yaml.safe_dump({"rl": {"phases": [{"name": "math"}, {"name": "short"}]}}))
    for name, lens in (("short", [9.0, 7.0]), ("math", [12.0, 12.5, 12.0])):
        d = run / "rl" / "phases" / name
        d.mkdir()
        d.joinpath("metrics.jsonl").write_text("".join(
            _json.dumps({"step": i + 1, "reward_mean": 0.5, "pass@1": 0.5, "correct_len_mean": L}) + "\n"
            for i, L in enumerate(lens)))
    rows = rl_rows(run)
    assert [(r["phase"], r["phase_step"], r["step"]) for r in rows] == [
        ("math", 1, 1), ("math", 2, 2), ("math", 3, 3), ("short", 1, 4), ("short", 2, 5)]
    md = "\n".join(rl_md(run, tmp_path))
    assert "| math | 3 |" in md and "| short | 2 |" in md and "9.000 -> 7.000" in md
