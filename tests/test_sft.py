"""Specialist SFT on a tiny float32 Qwen3: training through mlx-lm's trainer, checkpoint
choice by the recorded probe curve, fuse, resume, bad input. Most tests use a deterministic fake
probe (a function of the adapter weights) so that they run in seconds and the curve is not flat;
one test probes through the real rollout engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_ssp.errors import UserError
from mlx_ssp.models import load_model
from mlx_ssp.sft import SFTConfig, run_sft, select_checkpoint


def _chat(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                         {"role": "assistant", "content": f"Answer: {a + b}"}]}


def write_data(root: Path, n_train: int = 12, n_valid: int = 4) -> Path:
    d = root / "data"
    d.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(1, 9) for b in range(1, 4)]
    with open(d / "train.jsonl", "w") as f:
        for a, b in pairs[:n_train]:
            f.write(json.dumps(_chat(a, b)) + "\n")
    if n_valid:
        with open(d / "valid.jsonl", "w") as f:
            for a, b in pairs[-n_valid:]:
                f.write(json.dumps(_chat(a, b)) + "\n")
    return d


def write_probe(root: Path, domain: str = "math", n: int = 3) -> Path:
    p = root / "probe.jsonl"
    with open(p, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "domain": domain, "prompt": f"What is {i} + 1?",
                                "answer": str(i + 1), "verifier": "exact"}) + "\n")
    return p


def fake_probe(model, tokenizer, tasks, probe, seed):
    """A deterministic, non-monotone function of the adapter weights (not of history)."""
    s = sum(float(mx.abs(v).sum()) for k, v in tree_flatten(model.trainable_parameters()) if k.endswith("lora_b"))
    f = (s * 1e4) % 1.0
    return {"pass@1": round(f / 2, 6), "pass@k": round(f, 6)}


def make_cfg(root: Path, data: Path, probe: Path, **kw) -> SFTConfig:
    base = dict(
        domains={"math": {"data": str(data), "probe_tasks": str(probe)}},
        out_dir=str(root / "sft"),
        lora={"rank": 2, "num_layers": -1, "scale": 10.0},
        learning_rate=5e-3, iters=6, batch_size=2, max_seq_length=64, save_every=2, report_every=1, val_batches=2,
        probe={"k": 2, "sampling": {"temperature": 1.0, "max_tokens": 4}, "progress": False},
        seed=3,
    )
    for k, v in kw.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict) and k != "domains":
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return SFTConfig(**base)


@pytest.fixture(scope="module")
def base(tiny_qwen3):
    """The tiny base model loaded once for the module (the stage never reloads it either)."""
    model, tok, path = load_model(str(tiny_qwen3))
    return model, tok, Path(path)


def _base_weights(model) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def _run(cfg, base, **kw):
    return run_sft(cfg, None, model_and_tokenizer=base, probe_fn=kw.pop("probe_fn", fake_probe), **kw)


# -- pure selection rule ------------------------------------------------------------------------

def test_select_rules_and_tie_breaks():
    rows = [
        {"step": 2, "pass@1": 0.2, "pass@k": 0.5, "val_loss": 1.0},
        {"step": 4, "pass@1": 0.4, "pass@k": 0.5, "val_loss": 0.9},
        {"step": 6, "pass@1": 0.5, "pass@k": 0.4, "val_loss": 0.8},
        {"step": 8, "pass@1": 0.4, "pass@k": 0.5, "val_loss": 0.7},
    ]
    assert rows[select_checkpoint(rows, "pass@k")]["step"] == 8  # tie on pass@k and pass@1 -> lower val loss
    assert rows[select_checkpoint(rows, "pass@1")]["step"] == 6
    assert rows[select_checkpoint(rows, "val_loss")]["step"] == 8
    # a full tie goes to the earlier step, whatever the order of the rows
    tie = [{"step": 6, "pass@1": 0.1, "pass@k": 0.3, "val_loss": None},
           {"step": 2, "pass@1": 0.1, "pass@k": 0.3, "val_loss": None}]
    assert tie[select_checkpoint(tie, "pass@k")]["step"] == 2
    # a missing metric ranks last
    miss = [{"step": 2, "pass@1": 0.1, "pass@k": None}, {"step": 4, "pass@1": 0.0, "pass@k": 0.0}]
    assert miss[select_checkpoint(miss, "pass@k")]["step"] == 4
    with pytest.raises(UserError):
        select_checkpoint(rows, "best")


def test_config_validation():
    cfg = SFTConfig(domains=["math", "code"])
    assert list(cfg.domains) == ["math", "code"] and cfg.select == "pass@k" and cfg.mask_prompt
    from mlx_ssp.config import load_section

    for bad, needle in [
        ({"domains": ["m"], "select": "best"}, "select"),
        ({"domains": ["m"], "lora": {"rnak": 4}}, "rnak"),
        ({"domains": ["m"], "lora": {"num_layers": 0}}, "num_layers"),
        ({"domains": ["m"], "probe": {"k": 4, "n": 2}}, "probe"),
        ({"domains": ["m"], "select": "val_loss", "val_batches": 0}, "val_loss"),
    ]:
        with pytest.raises(UserError, match=needle):
            load_section({"sft": bad}, "sft", source="run.yaml")


# -- training, choice, fuse ---------------------------------------------------------------------

def test_train_choose_fuse(tmp_path, base):
    from mlx_lm import load
    from mlx_lm.generate import generate
    from mlx_lm.tuner.utils import load_adapters

    model, tok, path = base
    before = _base_weights(model)
    data, probe = write_data(tmp_path), write_probe(tmp_path)
    cfg = make_cfg(tmp_path, data, probe, iters=7)  # 7: the last checkpoint is off the save grid

    seen = {}

    class Spy:  # mid-training: frozen weights untouched, LoRA weights moved
        def on_train_loss_report(self, info):
            if info["iteration"] == 3:
                now = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
                # base weights sit under each LoRA wrapper's .linear; the rest (norms, embeddings) as before
                base_now = {k.replace(".linear.", "."): v for k, v in now.items() if "lora_" not in k}
                seen["n_wrapped"] = sum(".linear." in k for k in now)
                seen["frozen_same"] = base_now.keys() == before.keys() and all(
                    np.array_equal(v, before[k]) for k, v in base_now.items())
                seen["lora_b_moved"] = all(float(mx.abs(v).max()) > 0 for k, v in now.items() if k.endswith("lora_b"))

    summary = _run(cfg, base, callbacks=[Spy()])
    assert seen["frozen_same"] and seen["lora_b_moved"] and seen["n_wrapped"] > 0
    # the in-memory model is the base model again
    after = _base_weights(model)
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)

    ddir = tmp_path / "sft" / "math"
    curve = [json.loads(line) for line in open(ddir / "probe_curve.jsonl")]
    assert [r["step"] for r in curve] == [2, 4, 6, 7]
    assert {"step", "loss", "pass@1", "pass@k", "chosen", "val_loss"} <= set(curve[0])
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) and r["val_loss"] is not None for r in curve)
    # the chosen checkpoint is the argmax of the recorded pass@k curve (values are distinct here)
    ks = [r["pass@k"] for r in curve]
    assert len(set(ks)) == len(ks)
    assert sum(r["chosen"] for r in curve) == 1
    best = curve[int(np.argmax(ks))]["step"]
    assert summary["domains"]["math"]["chosen_step"] == best and curve[int(np.argmax(ks))]["chosen"]
    assert (ddir / "probe_curve.png").stat().st_size > 1000
    metrics = [json.loads(line) for line in open(ddir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, 8))

    # every checkpoint loads with mlx-lm's own adapter loader; checkpoints differ
    ws = []
    for step in (2, 4, 6, 7):
        ck = ddir / "checkpoints" / f"step_{step:07d}"
        m2, _ = load(str(path))
        load_adapters(m2, str(ck))
        ws.append(np.concatenate([np.array(v).ravel() for k, v in tree_flatten(m2.parameters()) if k.endswith("lora_b")]))
    assert not np.allclose(ws[0], ws[1])

    # the fused specialist loads, generates, and computes what base + chosen adapter computes
    spec = Path(summary["domains"]["math"]["specialist"])
    fused, ftok = load(str(spec))
    lora_model, _ = load(str(path), adapter_path=str(ddir))  # ddir holds the chosen adapter
    chosen_ck = ddir / "checkpoints" / f"step_{best:07d}"
    assert (ddir / "adapters.safetensors").read_bytes() == (chosen_ck / "adapters.safetensors").read_bytes()
    x = mx.array([tok.encode("What is 2 + 3?")])
    a, b, c = fused(x), lora_model(x), model(x)
    assert np.allclose(np.array(a), np.array(b), atol=1e-4)
    assert not np.allclose(np.array(a), np.array(c), atol=1e-4)
    text = generate(fused, ftok, "What is 2 + 3?", max_tokens=5)
    assert isinstance(text, str)
    assert json.loads((spec / "config.json").read_text())["model_type"] == "qwen3"

    # a second call finds the domain done and changes nothing
    mtime = (spec / "model.safetensors").stat().st_mtime_ns
    _run(cfg, base)
    assert (spec / "model.safetensors").stat().st_mtime_ns == mtime
    # another rule re-selects from the recorded curve and re-fuses, without training again
    s1 = _run(make_cfg(tmp_path, data, probe, iters=7, select="pass@1"), base)
    p1 = [r["pass@1"] for r in curve]
    assert s1["domains"]["math"]["chosen_step"] == curve[int(np.argmax(p1))]["step"]
    assert len(open(ddir / "metrics.jsonl").readlines()) == 7


def test_dora_fuses_to_the_adapter_model(tmp_path, base):
    from mlx_lm import load

    model, tok, path = base
    data, probe = write_data(tmp_path), write_probe(tmp_path)
    cfg = make_cfg(tmp_path, data, probe, iters=2, lora={"fine_tune_type": "dora", "keys": ["self_attn.q_proj"]})
    s = _run(cfg, base)
    fused, _ = load(s["domains"]["math"]["specialist"])
    adapted, _ = load(str(path), adapter_path=str(tmp_path / "sft" / "math"))
    x = mx.array([tok.encode("What is 2 + 3?")])
    np.testing.assert_allclose(np.array(fused(x)), np.array(adapted(x)), atol=1e-4)
    assert not any("lora" in k or ".m" == k[-2:] for k, _ in tree_flatten(model.parameters()))


def test_probe_set_from_tasks_section(tmp_path, base, shared_data):
    from mlx_ssp.sft import plan_domains

    data = write_data(tmp_path)
    cfg = SFTConfig(domains={"gsm8k": {"data": str(data)}}, batch_size=2, lora={"num_layers": -1})
    run_data = {"tasks": {"domains": {"gsm8k": {"source": f"gsm8k:{shared_data / 'gsm8k' / 'test.jsonl'}",
                                                "sizes": {"probe": 3, "eval": 2}}}}}
    (plan,) = plan_domains(cfg, base[0], base[1], run_data, tmp_path)
    assert len(plan.probe_tasks) == 3 and all(t.domain == "gsm8k" and t.verifier == "math" for t in plan.probe_tasks)
    assert "probe split" in plan.probe_source
    with pytest.raises(UserError, match="sft.domains is empty"):
        run_sft(SFTConfig(), None, model_and_tokenizer=base)
    with pytest.raises(UserError, match="no probe tasks"):
        plan_domains(cfg, base[0], base[1], {}, tmp_path)


class Kill(Exception):
    pass


class KillAt:
    """A training callback that kills the run at a loss report of ``iteration``."""

    def __init__(self, iteration):
        self.iteration = iteration

    def on_train_loss_report(self, info):
        if info["iteration"] == self.iteration:
            raise Kill()


def test_resume_equals_uninterrupted(tmp_path, base):
    """Kill at step 5 (mid-interval) and again during a probe; resume; same adapters as one run.
    Dropout and an LR schedule are on, so RNG and optimizer state must be restored."""
    data, probe = write_data(tmp_path), write_probe(tmp_path)
    kw = dict(iters=8, lora={"dropout": 0.2}, lr_schedule={"name": "cosine_decay", "arguments": [5e-3, 8], "warmup": 2})
    full = make_cfg(tmp_path / "a", data, probe, **kw)
    _run(full, base)

    cut = make_cfg(tmp_path / "b", data, probe, **kw)

    with pytest.raises(Kill):
        _run(cut, base, callbacks=[KillAt(5)])
    bdir = tmp_path / "b" / "sft" / "math"
    assert sorted(p.name for p in (bdir / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]

    calls = []

    def dying_probe(model, tokenizer, tasks, probe, seed):  # dies probing step 6, after it was saved
        calls.append(1)
        if len(calls) == 1:
            raise Kill()
        return fake_probe(model, tokenizer, tasks, probe, seed)

    with pytest.raises(Kill):
        _run(cut, base, probe_fn=dying_probe)
    assert (bdir / "checkpoints" / "step_0000006" / "state.json").is_file()
    assert not (bdir / "checkpoints" / "step_0000006" / "probe.json").exists()
    _run(cut, base)

    adir = tmp_path / "a" / "sft" / "math"
    for step in (2, 4, 6, 8):
        wa = mx.load(str(adir / "checkpoints" / f"step_{step:07d}" / "adapters.safetensors"))
        wb = mx.load(str(bdir / "checkpoints" / f"step_{step:07d}" / "adapters.safetensors"))
        assert wa.keys() == wb.keys()
        for k in wa:
            np.testing.assert_allclose(np.array(wa[k]), np.array(wb[k]), rtol=0, atol=1e-6, err_msg=f"step {step} {k}")
    ca = [json.loads(x) for x in open(adir / "probe_curve.jsonl")]
    cb = [json.loads(x) for x in open(bdir / "probe_curve.jsonl")]
    for ra, rb in zip(ca, cb):
        assert ra["step"] == rb["step"] and ra["chosen"] == rb["chosen"]
        assert ra["pass@k"] == pytest.approx(rb["pass@k"], abs=1e-4)
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5) and ra["val_loss"] == pytest.approx(rb["val_loss"], rel=1e-5)
    ma = [json.loads(x)["train_loss"] for x in open(adir / "metrics.jsonl")]
    mb = [json.loads(x)["train_loss"] for x in open(bdir / "metrics.jsonl")]
    assert len(mb) == 8 and np.allclose(ma, mb, rtol=1e-5)
    # only the newest checkpoint keeps the optimizer state
    assert [p.name for p in (bdir / "checkpoints").iterdir() if (p / "optimizer.safetensors").exists()] == ["step_0000008"]


def test_a_run_with_old_checkpoint_names_resumes_and_fuses(tmp_path, base):
    """A run killed before the one layout (SFT checkpoints named ``NNNNNNN``) resumes from its
    newest checkpoint and the chosen checkpoint is found whatever its name: the same adapters as
    one uninterrupted run."""
    from mlx_ssp.finetune import checkpoints as ckpts

    data, probe = write_data(tmp_path), write_probe(tmp_path)
    _run(make_cfg(tmp_path / "a", data, probe), base)
    cut = make_cfg(tmp_path / "b", data, probe)

    with pytest.raises(Kill):
        _run(cut, base, callbacks=[KillAt(5)])
    root = tmp_path / "b" / "sft" / "math" / "checkpoints"
    for p in ckpts.list_checkpoints(root):
        p.rename(root / f"{ckpts.step_of(p.name):07d}")
    _run(cut, base)
    assert [p.name for p in ckpts.list_checkpoints(root)] == ["0000002", "0000004", "step_0000006"]
    assert [p.name for p in root.iterdir() if (p / "optimizer.safetensors").exists()] == ["step_0000006"]
    curve = [json.loads(x)["step"] for x in open(root.parent / "probe_curve.jsonl")]
    assert curve == [2, 4, 6]
    ra = json.loads((tmp_path / "a" / "sft" / "math" / "result.json").read_text())
    rb = json.loads((tmp_path / "b" / "sft" / "math" / "result.json").read_text())
    assert ra["chosen_step"] == rb["chosen_step"] and Path(rb["adapter"]).parent == root
    wa = mx.load(str(tmp_path / "a" / "sft" / "math" / "adapters.safetensors"))
    wb = mx.load(str(tmp_path / "b" / "sft" / "math" / "adapters.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        np.testing.assert_allclose(np.array(wa[k]), np.array(wb[k]), rtol=0, atol=1e-6, err_msg=k)


def test_domains_in_one_process_are_independent(tmp_path, base):
    """Two domains in one process, one base model: the second specialist equals the one trained
    alone from a fresh load (nothing of the first leaks), and the base is not reloaded."""
    data = write_data(tmp_path / "m")
    probe = write_probe(tmp_path, "code")
    probe_m = write_probe(tmp_path / "m", "math")
    domains = {"math": {"data": str(data), "probe_tasks": str(probe_m)},
               "code": {"data": str(data / "train.jsonl"), "probe_tasks": str(probe)}}
    cfg = make_cfg(tmp_path / "both", data, probe, domains=domains, iters=4, val_batches=0)
    s = _run(cfg, base)
    assert set(s["domains"]) == {"math", "code"}
    solo = make_cfg(tmp_path / "solo", data, probe, domains={"code": domains["code"]}, iters=4, val_batches=0)
    fresh = load_model(str(base[2]))
    _run(solo, fresh)
    a = mx.load(str(tmp_path / "both" / "sft" / "specialists" / "code" / "model.safetensors"))
    b = mx.load(str(tmp_path / "solo" / "sft" / "specialists" / "code" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), atol=1e-6, err_msg=k)
    summary = json.loads((tmp_path / "both" / "sft" / "summary.json").read_text())
    assert set(summary["domains"]) == {"math", "code"}


def test_a_validation_set_smaller_than_the_batch_still_gives_a_loss(tmp_path, base):
    from mlx_ssp.sft.data import val_batch_size

    assert [val_batch_size(4, n) for n in (1, 3, 4, 9)] == [1, 3, 4, 4]
    assert val_batch_size(4, 3, world=2) == 2 and val_batch_size(4, 1, world=2) == 0  # whole batches per rank
    data, probe = write_data(tmp_path, n_valid=2), write_probe(tmp_path)
    _run(make_cfg(tmp_path, data, probe, batch_size=4, iters=4, val_batches=-1), base)
    curve = [json.loads(line) for line in open(tmp_path / "sft" / "math" / "probe_curve.jsonl")]
    assert len(curve) == 2 and all(r["val_loss"] is not None and math.isfinite(r["val_loss"]) for r in curve)


# -- bad input: errors before any training ------------------------------------------------------

@pytest.mark.parametrize(
    "case, needle",
    [
        ("bad_json", r"train.jsonl:3: not valid JSON"),
        ("empty", "empty"),
        ("no_messages", r"train.jsonl:2: unknown record format"),
        ("no_assistant", r"train.jsonl:1: with mask_prompt the last message"),
        ("mixed", r"train.jsonl:2: a 'completions' record in a 'chat' file"),
        ("too_few", r"fewer than batch_size=2; set sft\.batch_size to at most 1, or give domain 'math' more data"),
        ("no_probe_for_domain", "no probe tasks for domain 'math'"),
        ("bad_keys", "no layer 'self_attn.qq_proj'"),
        ("too_many_layers", "only has|has only 2 blocks"),
        ("missing_data", "SFT data not found"),
        ("empty_answer", r"train.jsonl:1: 'completion' is empty"),
        ("all_prompts_too_long", r"every record's prompt fills max_seq_length"),
    ],
)
def test_bad_input_fails_before_training(tmp_path, base, case, needle):
    data, probe = write_data(tmp_path), write_probe(tmp_path)
    train = data / "train.jsonl"
    lines = train.read_text().splitlines()
    kw = {}
    if case == "bad_json":
        lines[2] = '{"messages": [ oops'
    elif case == "empty":
        lines = []
    elif case == "no_messages":
        lines[1] = json.dumps({"msgs": []})
    elif case == "no_assistant":
        lines[0] = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    elif case == "mixed":
        lines[1] = json.dumps({"prompt": "a", "completion": "b"})
    elif case == "too_few":
        lines = lines[:1]
    elif case == "no_probe_for_domain":
        probe = write_probe(tmp_path, "code")
    elif case == "bad_keys":
        kw["lora"] = {"keys": ["self_attn.q_proj", "self_attn.qq_proj"]}
    elif case == "too_many_layers":
        kw["lora"] = {"num_layers": 5}
    elif case == "missing_data":
        data = tmp_path / "nowhere"
    elif case == "empty_answer":
        lines[0] = json.dumps({"prompt": "What is 1 + 1?", "completion": ""})
        lines = lines[:1]
    elif case == "all_prompts_too_long":
        kw["max_seq_length"] = 8
    train.write_text("".join(x + "\n" for x in lines))
    cfg = make_cfg(tmp_path, data, probe, **kw)
    with pytest.raises(UserError, match=needle):
        _run(cfg, base)
    assert not (tmp_path / "sft" / "math" / "checkpoints").exists()


def test_long_prompts_are_dropped_with_a_warning(tmp_path, base):
    from mlx_ssp.sft import load_sft_file

    data = write_data(tmp_path)
    train = data / "train.jsonl"
    long = {"messages": [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "x"}]}
    train.write_text(train.read_text() + json.dumps(long) + "\n")
    with pytest.warns(UserWarning, match=r"1 record\(s\) dropped.*line 13"):
        ds, stats = load_sft_file(train, base[1], mask_prompt=True, max_seq_length=64)
    assert len(ds) == 12 and stats["dropped"] == 1 and stats["records"] == 12


def test_changed_settings_refuse_to_resume(tmp_path, base):
    data, probe = write_data(tmp_path), write_probe(tmp_path)
    _run(make_cfg(tmp_path, data, probe, iters=2), base)
    with pytest.raises(UserError, match="learning_rate"):
        _run(make_cfg(tmp_path, data, probe, iters=2, learning_rate=1e-3), base)
    # --overwrite starts again
    _run(make_cfg(tmp_path, data, probe, iters=2, learning_rate=1e-3, overwrite=True), base)


# -- the real probe and the CLI -----------------------------------------------------------------

def test_real_probe_and_cli(tmp_path, tiny_qwen3):
    """`mlx_ssp sft CONFIG.yaml --set ...` end to end with the real rollout engine as the probe."""
    from click.testing import CliRunner

    from mlx_ssp.cli import main

    data, probe = write_data(tmp_path), write_probe(tmp_path)
    run = {
        "model": str(tiny_qwen3),
        "run_dir": str(tmp_path / "run"),
        "seed": 1,
        "sft": {
            "domains": {"math": {"data": str(data), "probe_tasks": str(probe)}},
            "lora": {"rank": 2, "num_layers": -1},
            "learning_rate": 1e-3, "iters": 2, "batch_size": 2, "save_every": 1, "max_seq_length": 64,
            "probe": {"k": 2, "n": 3, "sampling": {"temperature": 1.0, "max_tokens": 3}, "progress": False},
        },
    }
    cfgp = tmp_path / "run.yaml"
    import yaml

    cfgp.write_text(yaml.safe_dump(run))
    res = CliRunner().invoke(main, ["sft", str(cfgp), "--set", "sft.select=pass@1"])
    assert res.exit_code == 0, res.output
    ddir = tmp_path / "run" / "sft" / "math"
    curve = [json.loads(x) for x in open(ddir / "probe_curve.jsonl")]
    assert [r["step"] for r in curve] == [1, 2]
    for r in curve:
        assert 0.0 <= r["pass@1"] <= r["pass@k"] <= 1.0 and r["k"] == 2
    pr = json.loads((ddir / "checkpoints" / "step_0000001" / "probe.json").read_text())
    assert pr["n_probed"] == 3 and pr["seconds"] > 0
    assert (tmp_path / "run" / "sft" / "specialists" / "math" / "model.safetensors").is_file()
    # a user mistake is one line and exit 2
    res = CliRunner().invoke(main, ["sft", str(cfgp), "--set", "sft.lora.rank=0"])
    assert res.exit_code == 2 and "sft.lora.rank" in res.output
