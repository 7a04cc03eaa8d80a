"""The three SSP experiment scripts (scripts/experiments/) run end to end at toy size (--tiny: a tiny
random model and a stand-in verifier), share their cached work, and hold the properties each
comparison relies on (equal SFT examples, a true average, lambda = 0 for the GRPO arm)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import mlx_ssp  # noqa: F401

EXP = Path(__file__).resolve().parents[1] / "scripts" / "experiments"


def _load(name: str):
    if str(EXP) not in sys.path:
        sys.path.insert(0, str(EXP))
    spec = importlib.util.spec_from_file_location(name, EXP / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(name: str, work: Path, *extra: str) -> dict:
    mod = _load(name)
    mod.cli.main(["--tiny", "--work-dir", str(work), "--no-progress", *extra], standalone_mode=False)
    return json.loads((work / name.split("_")[0] / "results.json").read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("experiments")


def _one(work: Path, pattern: str) -> Path:
    """The single cached directory matching ``pattern`` (directories are keyed by config hashes)."""
    found = sorted(work.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def _jsonl(p: Path) -> list[dict]:
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def test_exp1_spectrum_equal_examples(work):
    res = _run("exp1_spectrum", work)
    assert res["tiny"] is True and res["per_seed"]
    rows = res["per_seed"]["0"]
    assert set(rows) == {"addition", "subtraction"}
    for dom, r in rows.items():
        assert r["diverse"]["n_tasks"] == 3 and r["first_matched"]["n_tasks"] == 3
        for arm in ("diverse", "first_matched"):
            assert 0.0 <= r[arm]["pass@1"] <= r[arm]["pass@k"] <= 1.0
        # the paired difference is the difference of the means (same tasks on both sides)
        d = r["diverse_minus_first"]["d_pass@1"]
        assert d == pytest.approx(r["diverse"]["pass@1"] - r["first_matched"]["pass@1"])
    # both arms train on the same prompts and the same number of examples per prompt; first-win
    # repeats one solution, diverse holds distinct ones
    for dom in ("addition", "subtraction"):
        first = _jsonl(_one(work, "select/*/first_matched") / dom / "train.jsonl")
        div = _jsonl(_one(work, "select/*/diverse") / dom / "train.jsonl")
        assert len(first) == len(div) > 0
        key = lambda r: json.dumps(r["messages"][:-1])  # noqa: E731
        per_first: dict = {}
        per_div: dict = {}
        for r in first:
            per_first.setdefault(key(r), []).append(r["messages"][-1]["content"])
        for r in div:
            per_div.setdefault(key(r), []).append(r["messages"][-1]["content"])
        assert {k: len(v) for k, v in per_first.items()} == {k: len(v) for k, v in per_div.items()}
        assert all(len(set(v)) == 1 for v in per_first.values())
        assert all(len(set(v)) == len(v) for v in per_div.values())
        assert res["spectrum"][dom]["train_examples"]["first_matched"] == len(first)
    assert (work / "exp1" / "results.md").read_text().startswith("## Experiment 1")
    # the same RL budget from each arm's specialist, on that domain's train prompts only
    for dom, r in rows.items():
        for arm in ("diverse", "first_matched"):
            assert r["rl"][arm]["n_tasks"] == 3
        assert r["rl_diverse_minus_first"]["d_pass@1"] == pytest.approx(
            r["rl"]["diverse"]["pass@1"] - r["rl"]["first_matched"]["pass@1"])
    runs = [Path(rows["addition"]["rl_dir"][arm]) for arm in ("diverse", "first_matched")]
    assert [p.name for p in runs] == ["diverse-s0-addition", "first_matched-s0-addition"]
    assert sorted(work.glob("rl_from/*/*-s0-addition"), key=lambda p: p.name) == runs  # no other RL run
    cfgs = [json.loads((p / "rl_config.json").read_text()) for p in runs]
    assert cfgs[0]["rl"] == cfgs[1]["rl"]
    # each arm's RL started from that arm's own specialist
    assert [Path(c["model"]).resolve() for c in cfgs] == [
        _one(work, f"sft/*/{arm}-s0/specialists/addition").resolve() for arm in ("diverse", "first_matched")]


def test_exp1_rerun_is_cached_and_config_keys_the_cache(work):
    spec = _one(work, "sft/*/diverse-s0/specialists/addition/model.safetensors")
    before = spec.stat().st_mtime_ns
    n_evals = len(list(work.glob("eval/*/*.json")))
    _run("exp1_spectrum", work)
    assert spec.stat().st_mtime_ns == before  # nothing retrained
    assert len(list(work.glob("eval/*/*.json"))) == n_evals  # nothing re-evaluated
    common = _load("common")
    a = common.make_ctx(True, str(work), (), True)
    b = common.make_ctx(True, str(work), ("select.per_prompt=2",), True)
    # a changed selection setting reuses the rollouts but gets its own selection and SFT directories
    assert (a.k_tasks, a.k_rollout, a.k_eval) == (b.k_tasks, b.k_rollout, b.k_eval)
    assert a.k_select != b.k_select and a.k_sft != b.k_sft and a.k_merge != b.k_merge
    c = common.make_ctx(True, str(work), ("eval.n=3",), True)
    assert c.k_eval != a.k_eval and c.k_sft == a.k_sft
    with pytest.raises(mlx_ssp.errors.UserError, match="unknown experiment key"):
        common.make_ctx(True, str(work / "other"), ("nope=1",), True)


def test_a_domain_with_fewer_records_than_the_batch_trains_on_all_of_them(tmp_path):
    # found at demo scale: seed 2's base model solved 3 of 12 subtraction prompts, batch 4
    from mlx_ssp.io import write_jsonl_atomic

    common = _load("common")
    ctx = common.make_ctx(True, str(tmp_path), ("sft.batch_size=2", "sft.iters=1", "sft.save_every=1"), True)
    rec = {"messages": [{"role": "user", "content": "1 + 1 ="}, {"role": "assistant", "content": "2"}]}
    sizes = {"addition": 3, "subtraction": 1}
    for d, n in sizes.items():
        write_jsonl_atomic(tmp_path / "data" / d / "train.jsonl", [rec] * n)
    probe = str(ctx.tasks("probe"))
    out = ctx.sft("cap", {d: {"data": str(tmp_path / "data" / d), "probe_tasks": probe} for d in sizes}, 0)
    assert set(out) == set(sizes) and all(Path(m).is_dir() for m in out.values())
    used = {d: json.loads((ctx.sft_dir("cap") / d / "adapter_config.json").read_text())["batch_size"]
            for d in sizes}
    assert used == {"addition": 2, "subtraction": 1}  # the configured batch where the data allow it
    summary = json.loads((ctx.sft_dir("cap") / "summary.json").read_text())
    assert set(summary["domains"]) == set(sizes)  # the two run_sft calls share one summary
    stamp = {d: (ctx.sft_dir("cap") / d / "result.json").stat().st_mtime_ns for d in sizes}
    assert ctx.sft("cap", {d: {"data": str(tmp_path / "data" / d), "probe_tasks": probe} for d in sizes}, 0) == out
    assert stamp == {d: (ctx.sft_dir("cap") / d / "result.json").stat().st_mtime_ns for d in sizes}  # cached


@pytest.mark.slow
def test_exp2_controls_are_what_they_claim(tmp_path):
    """merge_controls: the half-strength blend is base + half the blend's update, merge_x{a} is base +
    a x the specialists' mean update (a 1 = the linear merge), the soup averages two blend seeds, and
    the task vectors' cosines are symmetric with 1 on the diagonal."""
    import mlx.core as mx

    res = _run("exp2_merge_vs_blend", tmp_path, "--set", "merge_controls={alphas: [1, 2]}")
    ctl = res["controls"]
    assert set(ctl["models"]) == {"blend_half", "blend_soup", "merge_x1", "merge_x2"}
    load = lambda p: mx.load(str(p / "model.safetensors"))  # noqa: E731
    base = load(tmp_path / "tiny_model")
    merged = load(Path(res["merged_model"]))
    name = next(n for n in merged if "q_proj" in n and n.startswith("model.layers.1"))  # a LoRA-trained layer
    x1 = load(_one(tmp_path, "merge/*/diverse-s0-x1/model"))
    x2 = load(_one(tmp_path, "merge/*/diverse-s0-x2/model"))
    assert mx.allclose(x1[name], merged[name], atol=1e-6).item()
    assert mx.allclose(x2[name] - base[name], 2 * (merged[name] - base[name]), atol=1e-5).item()
    blend = load(_one(tmp_path, "sft/*/mixed-s0/specialists/blend"))
    half = load(_one(tmp_path, "sft/*/mixed-s0/blend_half"))
    assert mx.allclose(half[name] - base[name], (blend[name] - base[name]) / 2, atol=1e-5).item()
    assert not mx.allclose(half[name], blend[name]).item()
    other = load(_one(tmp_path, "sft/*/mixed-s1000/specialists/blend"))
    soup = load(_one(tmp_path, "merge/*/blend-soup-s0/model"))
    assert mx.allclose(soup[name], (blend[name] + other[name]) / 2, atol=1e-6).item()
    tv = ctl["task_vectors"]
    assert tv["models"] == ["addition", "subtraction", "blend", "blend_seed2"]
    c = tv["cosine"]
    assert all(c[i][i] == pytest.approx(1.0) and c[i][j] == pytest.approx(c[j][i]) for i in range(4) for j in range(4))
    assert -1 <= tv["mean_cosine_specialists"] <= 1 and tv["cosine_blends"] == pytest.approx(c[2][3])
    head = _load("exp2_merge_vs_blend").headline(res)
    assert "overall blend_soup - blend pass@1" in head and "overall merged - blend_half pass@1" in head
    with pytest.raises(Exception, match="merge_controls"):
        _run("exp2_merge_vs_blend", tmp_path / "bad", "--set", "merge_controls={alphas: [0]}")


def test_exp2_merge_is_the_average_and_blend_sees_all_domains(work):
    import mlx.core as mx

    res = _run("exp2_merge_vs_blend", work)
    assert res["blend_iters"] == 2 * 2  # specialists' total: 2 domains x sft.iters
    for dom in ("addition", "subtraction"):
        r = res["per_domain"][dom]
        for name in ("specialist", "merged", "blend", "base"):
            assert r[name]["n_tasks"] == 3
        # interference: each specialist on every domain; on its own domain it is the own-domain eval
        # again (same tasks, same per-sample seeds: evaluating more domains at once changes nothing)
        assert set(r["specialists"]) == {"addition", "subtraction"}
        assert r["specialists"][dom]["pass@1"] == r["specialist"]["pass@1"]
        assert r["specialists"][dom]["pass@k"] == r["specialist"]["pass@k"]
    merged = mx.load(str(Path(res["merged_model"]) / "model.safetensors"))
    specs = [mx.load(str(_one(work, f"sft/*/diverse-s0/specialists/{d}/model.safetensors")))
             for d in ("addition", "subtraction")]
    name = next(n for n in merged if "q_proj" in n and n.startswith("model.layers.1"))  # a LoRA-trained layer
    assert mx.allclose(merged[name], (specs[0][name] + specs[1][name]) / 2, atol=1e-6).item()
    assert not mx.array_equal(specs[0][name], specs[1][name]).item()
    # the blend's checkpoint choice probes every domain (probe.max_tasks per domain)
    curve = _jsonl(_one(work, "sft/*/mixed-s0/blend/probe_curve.jsonl"))
    assert curve and all(r["n_tasks"] == 2 * 2 for r in curve)
    blend = _jsonl(_one(work, "select/*/blend/blend/train.jsonl"))
    n_div = sum(len(_jsonl(_one(work, "select/*/diverse") / d / "train.jsonl")) for d in ("addition", "subtraction"))
    assert len(blend) == n_div


def test_exp3_mgpo_vs_grpo(work):
    res = _run("exp3_signal", work)
    steps = res["steps"]
    assert steps == 2 and res["lambda"] == 1.0
    for arm in ("mgpo", "grpo"):
        assert sorted(int(s) for s in res["curve"][arm]) == [0, 1, 2]
        m = res["train_metrics"][arm]
        assert [r["step"] for r in m] == [1, 2]
    # lambda = 0 is plain GRPO: every group weight is exactly 1
    assert all(r.get("mgpo_weight_mean", 1.0) == 1.0 for r in res["train_metrics"]["grpo"])
    # step 0 of both arms is the merged model's evaluation (experiment 2's)
    exp2 = json.loads((work / "exp2" / "results.json").read_text())
    assert res["curve"]["mgpo"]["0"]["pass@1"] == pytest.approx(exp2["overall"]["merged"]["pass@1"])
    cfgs = [json.loads((Path(res["out_dir"]) / arm / "rl_config.json").read_text())["rl"] for arm in ("mgpo", "grpo")]
    assert cfgs[0]["mgpo_lambda"] == 1.0 and cfgs[1]["mgpo_lambda"] == 0.0
    rest = [{k: v for k, v in c.items() if k != "mgpo_lambda"} for c in cfgs]
    assert rest[0] == rest[1]

    # a third arm: GRPO at the MGPO arm's mean weight x the learning rate; the two arms above are reused
    mod = _load("exp3_signal")
    res2 = _run("exp3_signal", work, "--set", "grpo_lr_scale=mgpo")
    w = [r["mgpo_weight_mean"] for r in res["train_metrics"]["mgpo"]]
    assert res2["grpo_lr_scale"] == pytest.approx(sum(w) / len(w)) and res2["grpo_lr_scale"] < 1.0
    assert res2["curve"]["mgpo"] == res["curve"]["mgpo"] and res2["curve"]["grpo"] == res["curve"]["grpo"]
    lr_dirs = list(Path(res["out_dir"]).glob("grpo-lr*"))
    assert lr_dirs == [Path(res2["run_dirs"]["grpo_lr"])]
    c = json.loads((lr_dirs[0] / "rl_config.json").read_text())["rl"]
    assert c["mgpo_lambda"] == 0.0 and c["learning_rate"] == pytest.approx(cfgs[1]["learning_rate"] * res2["grpo_lr_scale"])
    assert {k: v for k, v in c.items() if k != "learning_rate"} == {k: v for k, v in cfgs[1].items() if k != "learning_rate"}
    assert sorted(int(s) for s in res2["curve"]["grpo_lr"]) == [0, 1, 2]
    h = mod.headline(res2)
    assert h["mgpo - grpo_lr pass@1"] == res2["curve"]["mgpo_minus_grpo_lr"]["2"]["d_pass@1"]
    assert "grpo_lr pass@1" not in mod.headline(res)
    assert mod.headline(res)["mgpo mean MGPO weight"] == pytest.approx(sum(w) / len(w))
    diffs = mod.task_diffs(res)["mgpo - grpo pass@1"]  # per task, averaging to the headline's difference
    assert sum(diffs.values()) / len(diffs) == pytest.approx(mod.headline(res)["mgpo - grpo pass@1"])
    # the seed driver's curves: each arm's RL run, drawn with a band across seeds
    cur = mod.curves(work, 0)
    assert set(cur) == {"MGPO", "GRPO", "GRPO (lr scaled)"} and cur["GRPO (lr scaled)"] == [lr_dirs[0]]
    from mlx_ssp.report import build_comparison

    build_comparison([f"{label}={p}" for label, ps in cur.items() for p in ps], work / "report-exp3")
    assert "GRPO (lr scaled)" in (work / "report-exp3" / "compare.md").read_text()
    from mlx_ssp.errors import UserError

    for bad in ("-1", "foo", ".inf"):
        with pytest.raises(UserError, match="grpo_lr_scale.*valid: null, a finite number > 0, or mgpo"):
            _run("exp3_signal", work, "--set", f"grpo_lr_scale={bad}")
    # a number: the arm's learning rate is that multiple
    res3 = _run("exp3_signal", work, "--set", "grpo_lr_scale=0.5")
    c = json.loads((Path(res3["run_dirs"]["grpo_lr"]) / "rl_config.json").read_text())["rl"]
    assert res3["grpo_lr_scale"] == 0.5 and c["learning_rate"] == pytest.approx(cfgs[1]["learning_rate"] * 0.5)

    # a lambda grid: one more MGPO arm per extra lambda, all against the one GRPO arm (reused)
    for bad in ("[1.0]", "[0]", "[2, 2]", "4", "[.inf]", "[0.5, 0.5000001]"):
        with pytest.raises(UserError, match="extra_lambdas.*valid: a list of distinct finite numbers > 0"):
            _run("exp3_signal", work, "--set", f"extra_lambdas={bad}")
    res4 = _run("exp3_signal", work, "--set", "extra_lambdas=[4, 0.5]")
    assert res4["extra_lambdas"] == {"mgpo-l4": 4.0, "mgpo-l0.5": 0.5}
    assert res4["curve"]["grpo"] == res["curve"]["grpo"] and res4["curve"]["mgpo"] == res["curve"]["mgpo"]
    for arm, lam in res4["extra_lambdas"].items():
        c = json.loads((Path(res4["run_dirs"][arm]) / "rl_config.json").read_text())["rl"]
        assert c["mgpo_lambda"] == lam and {k: v for k, v in c.items() if k != "mgpo_lambda"} == rest[1]
        assert sorted(int(s) for s in res4["curve"][arm]) == [0, 1, 2]
        d = res4["curve"][f"{arm}_minus_grpo"]["2"]["d_pass@1"]
        assert d == pytest.approx(res4["curve"][arm]["2"]["pass@1"] - res4["curve"]["grpo"]["2"]["pass@1"])
        assert mod.headline(res4)[f"{arm} - grpo pass@1"] == d
    # step 1 (the same rollouts in every arm): a larger lambda weights the groups less (w = exp(-lambda D))
    w1 = [res4["train_metrics"][a][0]["mgpo_weight_mean"] for a in ("mgpo-l0.5", "mgpo", "mgpo-l4")]
    assert w1[0] >= w1[1] >= w1[2]
    assert set(mod.curves(work, 0)) == {"MGPO", "GRPO", "MGPO lambda 4", "MGPO lambda 0.5"}  # labels hold no "="
    # each setting of added arms keeps its own copy of the results beside the shared arms
    out = Path(res4["out_dir"])
    assert (out / "results.json").is_file() and len(list(out.glob("results-*.json"))) == 3  # 2 scales + the grid


def test_exp5_checkpoint_rule_rl_from_every_checkpoint(work):
    from mlx_ssp.sft.probe import select_checkpoint

    res = _run("exp5_checkpoint_rule", work, "--set", "domains=[addition]")
    assert list(res["per_domain"]) == ["addition"]  # the domains key narrows the tasks
    r = res["per_domain"]["addition"]
    ck = r["checkpoints"]
    assert [c["step"] for c in ck] == [1, 2]  # sft.iters 2, save_every 1: every checkpoint starts RL
    assert all(c["val_loss"] is not None and c["rl"]["n_tasks"] == 3 for c in ck)
    rows = [{"step": c["step"], "pass@1": c["probe pass@1"], "pass@k": c["probe pass@k"], "val_loss": c["val_loss"]}
            for c in ck]
    best = max(c["rl"]["pass@1"] for c in ck)
    for rule, x in r["rules"].items():  # each rule's choice is the one `mlx_ssp sft` would make
        c = ck[select_checkpoint(rows, rule)]
        assert x["step"] == c["step"] and x["rl_pass@1"] == c["rl"]["pass@1"]
        assert x["regret"] == pytest.approx(best - x["rl_pass@1"]) and x["regret"] >= 0
    assert set(r["spearman"]) == {"probe pass@k", "probe pass@1", "-val_loss", "held-out SFT pass@1",
                                  "held-out SFT pass@k"}
    assert all(v is None for v in r["spearman"].values())  # two checkpoints: too few to rank
    exp5 = _load("exp5_checkpoint_rule")
    sig = exp5.signals(ck)
    assert set(sig) == set(exp5.SIGNALS)
    assert sig["held-out SFT pass@k"] == [c["sft"]["pass@k"] for c in ck]
    assert sig["held-out SFT pass@1"] == [c["sft"]["pass@1"] for c in ck]
    assert sig["-val_loss"] == [-c["val_loss"] for c in ck]


def test_exp5_large_k_probe_is_a_signal_and_a_rule(work):
    """``large_k``: every checkpoint sampled n times per probe prompt; pass@k from those samples is a
    signal and pass@(largest k) a rule judged after RL, on the cached SFT and RL work."""
    from mlx_ssp.errors import UserError
    from mlx_ssp.metrics import pass_at_k
    from mlx_ssp.sft.probe import select_checkpoint

    for bad in ("{n: 0, ks: [1]}", "{n: 4, ks: [8]}", "{n: 4, ks: []}", "{n: 4, ks: [2], x: 1}", "16", "{n: 4, ks: [1]}"):
        with pytest.raises(UserError, match="large_k.*valid: null or"):
            _run("exp5_checkpoint_rule", work, "--set", "domains=[addition]", "--set", f"large_k={bad}")
    res = _run("exp5_checkpoint_rule", work, "--set", "domains=[addition]", "--set", "large_k={n: 4, ks: [4, 2]}")
    r = res["per_domain"]["addition"]
    labels = ["probe pass@2 (n=4)", "probe pass@4 (n=4)"]
    assert list(r["spearman"])[-2:] == labels and set(r["rules"]) == {"pass@k", "pass@1", "val_loss", "pass@4"}
    assert {"pass@4 - pass@k", "pass@4 - pass@1"} <= set(r["paired"])
    # large k probes what `mlx_ssp sft` probes: the same sampling, the same tasks
    with pytest.raises(UserError, match="differs from sft.probe.sampling"):
        _run("exp5_checkpoint_rule", work, "--set", "domains=[addition]", "--set", "large_k={n: 4, ks: [4]}",
             "--set", "eval.sampling.temperature=0.5")
    with pytest.raises(UserError, match="sft.probe.max_tasks=1"):
        _run("exp5_checkpoint_rule", work, "--set", "domains=[addition]", "--set", "large_k={n: 4, ks: [4]}",
             "--set", "sft.probe.max_tasks=1")
    evals = sorted(work.glob("eval/*/ckpt-s0-addition-step*-probe-*.json"),
                   key=lambda f: int(f.name.split("-step")[1].split("-")[0]))
    assert len(evals) == 2  # one n=4 probe evaluation per checkpoint
    for c, f in zip(r["checkpoints"], evals):
        tasks = json.loads(f.read_text())["tasks"]
        assert len(tasks) == 2 and all(t["n"] == 4 for t in tasks)  # the probe split, n samples each
        for kk in (2, 4):  # the signal is the mean unbiased pass@k over the probe tasks
            want = sum(pass_at_k(4, t["c"], kk) for t in tasks) / 2
            assert c["probe large k"][f"probe pass@{kk} (n=4)"] == pytest.approx(want)
    rows = [{"step": c["step"], "pass@1": c["probe pass@1"], "pass@k": c["probe large k"][labels[1]],
             "val_loss": c["val_loss"]} for c in r["checkpoints"]]
    assert r["rules"]["pass@4"]["step"] == r["checkpoints"][select_checkpoint(rows, "pass@k")]["step"]
    # the rule ranks by the largest k's pass@k, where the small-k probe, the large probe's smaller k and
    # pass@1 all disagree; ties go to the probe's pass@1
    exp5 = _load("exp5_checkpoint_rule")
    probed = [{"step": 10, "pass@1": 0.9, "pass@k": 0.5, "val_loss": 1.0},
              {"step": 20, "pass@1": 0.1, "pass@k": 0.9, "val_loss": 0.5},
              {"step": 30, "pass@1": 0.2, "pass@k": 0.4, "val_loss": 2.0}]
    big = [{"s": 0.9, "L": 0.5}, {"s": 0.2, "L": 0.6}, {"s": 0.1, "L": 0.8}]
    assert exp5.large_k_rule(probed, big, "L") == 2 and exp5.large_k_rule(probed, big, "s") == 0
    assert exp5.large_k_rule(probed, [{"L": 1.0}, {"L": 1.0}, {"L": 0.9}], "L") == 0  # tie: pass@1 decides


def test_seed_statistics_are_exact():
    exp5 = _load("exp5_checkpoint_rule")
    sp = exp5.spearman
    assert sp([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert sp([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert sp([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # ties take average ranks
    assert sp([1, 1, 1], [1, 2, 3]) is None and sp([1, None, 2, 3], [1, 2, 3, 4]) == pytest.approx(1.0)
    seeds = _load("seeds")
    agg = seeds.aggregate({0: {"a": 0.1, "b": None}, 1: {"a": 0.3, "b": 2.0}, 2: {"a": 0.2}})
    assert agg["a"]["n"] == 3 and agg["a"]["mean"] == pytest.approx(0.2) and agg["a"]["se"] == pytest.approx(0.1 / 3 ** 0.5)
    assert agg["b"] == {"mean": 2.0, "se": None, "n": 1, "values": {1: 2.0}}  # None is "not measured", not 0
    assert seeds.parse_seeds("0-4") == [0, 1, 2, 3, 4] and seeds.parse_seeds("1,3") == [1, 3]


def test_seed_tests_match_the_t_distribution_and_split_the_se_into_seeds_and_tasks():
    """p-values of the one-sample t-test equal scipy's (values computed with scipy 1.17 once), signs
    are counted, and the two-way SE is the seed-means SE and the task-means SE."""
    common, seeds = _load("common"), _load("seeds")
    for xs, t, p in (([-0.04, -0.03, -0.05, -0.045, -0.02], -6.870727512550919, 0.0023505449803477452),
                     ([0.1, -0.05, 0.02], 0.5384615384615384, 0.6441700025572561),
                     ([1, 2, 3, 4, 5, 6, 7, 8, -1], 3.975732839729454, 0.0040860145000355735)):
        r = common.t_test(xs)
        assert r["t"] == pytest.approx(t, rel=1e-12) and r["p"] == pytest.approx(p, rel=1e-9) and r["df"] == len(xs) - 1
    assert common.t_test([0.1, 0.1]) is None and common.t_test([0.3]) is None
    diffs = {0: {"a": 0.1, "b": 0.3, "c": 0.2}, 1: {"a": 0.0, "b": 0.2, "c": 0.1, "x": 9.0}}  # x: not in every seed
    w = common.two_way_se(diffs)
    assert w["tasks"] == 3 and w["seeds"] == 2 and w["mean"] == pytest.approx(0.15)
    assert w["se_seeds"] == pytest.approx(common.mean_se([0.2, 0.1])[1])
    assert w["se_tasks"] == pytest.approx(common.mean_se([0.05, 0.25, 0.15])[1])
    assert w["se"] == pytest.approx((w["se_seeds"] ** 2 + w["se_tasks"] ** 2) ** 0.5)
    agg = seeds.aggregate({0: {"m - n": 0.2, "level": 0.5}, 1: {"m - n": 0.1, "level": 0.4}}, {0: {"m - n": diffs[0]},
                                                                                              1: {"m - n": diffs[1]}})
    assert agg["m - n"]["test"]["positive"] == 2 and "test" not in agg["level"]
    assert agg["m - n"]["two_way"] == w
    md = seeds.summary_md("expX", agg, [0, 1], "cmd")
    assert "t(1) = 3.00" in md and "SE tasks" in md


def test_seed_driver_refuses_a_second_driver_on_the_same_out(tmp_path):
    """Two drivers on one OUT would read each other's OUT/seed-S/EXP/results.json into their summaries."""
    seeds = _load("seeds")
    held = seeds.lock_out(tmp_path)
    with pytest.raises(SystemExit, match="another seeds.py is running in"):
        seeds.lock_out(tmp_path)
    seeds.lock_out(tmp_path / "..").close()  # another OUT is free
    held.close()
    seeds.lock_out(tmp_path).close()  # free again once the first driver has exited


@pytest.mark.slow
def test_exp4_agents_transfer_runs_every_model_on_every_backend(tmp_path):
    """Experiment 4 at toy size: per SFT seed, each backend's specialist, the blend and the merge are
    evaluated on every backend (breadth needs all of them); the blend is trained on all backends."""
    res = _run("exp4_agents_transfer", tmp_path)
    assert res["tiny"] is True and res["backends"] == ["file_system", "trading"]
    assert set(res["per_seed"]) == {"0", "1"}
    for ev in res["per_seed"].values():
        assert set(ev) == {"specialist:file_system", "specialist:trading", "merged", "blend"}
        assert all(set(m["per_backend"]) == {"file_system", "trading"} for m in ev.values())
    s = res["summary"]
    assert s["blend"]["breadth"][0] == pytest.approx(sum(s["blend"]["per_backend"][b][0] for b in res["backends"]) / 2)
    blend = [json.loads(x) for f in tmp_path.glob("select/*/blend/blend/train.jsonl") for x in f.read_text().splitlines()]
    assert {r["task_id"].split("-")[0] for r in blend} == {"file_system", "trading"}


@pytest.mark.slow
def test_exp4_on_the_tool_testbed_gives_every_row_and_column_and_reproduces_from_the_cache(tmp_path):
    """The agents experiment on the tool-use testbed at plumbing size (a 2-step build of its model):
    base, both specialists, blend, linear merge, TIES, and MGPO and GRPO from the merge, each on both
    backends, the headline the seed driver averages, and a second run from the cache writes the same
    table."""
    mod = _load("exp4_agents_transfer")
    res = _run("exp4_agents_transfer", tmp_path, "--profile", "tools")
    assert res["backends"] == ["kv", "bank"]
    (ev,) = res["per_seed"].values()
    assert set(ev) == {"specialist:kv", "specialist:bank", "blend", "merged", "ties", "rl:mgpo", "rl:grpo"}
    assert all(set(m["per_backend"]) == {"kv", "bank"} for m in ev.values())
    head = mod.headline(res)
    for key in ("base breadth", "merged breadth", "ties breadth", "blend breadth", "merged - blend (breadth)",
                "merged - specialist (own backend)", "specialist - base (other backends)", "ties - blend (breadth)",
                "rl:mgpo - merged (breadth)", "rl:grpo - merged (breadth)", "rl:mgpo - rl:grpo (breadth)"):
        assert key in head
    assert 0 < head["rl:mgpo mean MGPO weight"] <= 1  # lambda 1: a weight in (0, 1] per group
    table = (tmp_path / "exp4" / "results.md").read_text()
    assert all(f"| {row} |" in table for row in ("base", "specialist:kv", "blend", "merged", "ties", "rl:mgpo", "rl:grpo"))
    again = _run("exp4_agents_transfer", tmp_path, "--profile", "tools")
    assert again["summary"] == res["summary"] and (tmp_path / "exp4" / "results.md").read_text() == table


@pytest.mark.slow
def test_exp1_from_the_generator_gives_arms_that_differ_and_a_pass_at_k_curve(tmp_path):
    """``spectrum_source: generator``: both arms' SFT data are the testbed generator's verified traces
    (no model samples), the diverse arm holds several distinct solutions per countdown prompt where
    first-win repeats one, and ``spectrum_eval`` adds pass@k at each k after SFT for every model."""
    tasks = {"seed": 3, "domains": {"countdown": {"source": "testbed:countdown", "params": {"levels": [3, 4]},
                                                  "sizes": {"train": 6, "probe": 2, "eval": 3}}}}
    res = _run("exp1_spectrum", tmp_path, "--set", f"tasks={json.dumps(tasks)}", "--set", "spectrum_source=generator",
               "--set", "spectrum_eval={n: 4, ks: [1, 2, 4]}")
    assert res["spectrum_source"] == "generator"
    st = res["spectrum"]["countdown"]
    assert st["distinct_per_prompt"]["first_matched"] == 1.0 and st["distinct_per_prompt"]["diverse"] > 1.5
    assert st["prompts_differing"] > 0.5 and st["train_examples"]["first_matched"] == st["train_examples"]["diverse"]
    assert not list(tmp_path.glob("rollout/*/rollouts.jsonl"))  # the model was never sampled for SFT data
    (per,) = res["per_seed"].values()
    curve = per["countdown"]["spectrum"]
    assert set(curve) == {"base", "first_matched", "diverse"}
    assert all(list(c) == ["pass@1 (n=4)", "pass@2 (n=4)", "pass@4 (n=4)"] for c in curve.values())
    assert all(c["pass@1 (n=4)"] <= c["pass@2 (n=4)"] <= c["pass@4 (n=4)"] for c in curve.values())
    with pytest.raises(Exception, match="spectrum_source"):
        _run("exp1_spectrum", tmp_path / "bad", "--set", "spectrum_source=teacher")
