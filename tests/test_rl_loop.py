"""The RL loop on tiny random models: LoRA reference, one step, learning, resume, NaN handling, CLI."""

from __future__ import annotations

import json

import mlx_ssp  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from mlx.utils import tree_flatten

from mlx_ssp.errors import UserError
from mlx_ssp.finetune.lora import adapters_disabled
from mlx_ssp.models import load_model
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.logprobs import model_token_logprobs
from mlx_ssp.rl.policy import setup_model
from mlx_ssp.rl.trainer import train
from mlx_ssp.tasks import Task, write_tasks
from mlx_ssp.verify import VerifyResult, register

PROMPTS = ["What is 2 + 3?", "Compute 12 + 30.", "Let x = 4.", "The quick brown fox", "Give your final answer",
           "def add(a, b):", "You are a helpful assistant.", "How many apples are left?"]


@register("rl_test_has_digit")
def _has_digit(completion: str, task) -> VerifyResult:
    """A reward a tiny random model can learn fast: the completion contains a digit."""
    ok = any(ch.isdigit() for ch in completion)
    return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer")


def _tasks():
    return [Task(id=f"t{i}", domain="toy", prompt=p, answer="-", verifier="rl_test_has_digit") for i, p in enumerate(PROMPTS)]


def _cfg(**kw):
    base = dict(steps=2, batch_size=2, group_size=4, sampling={"temperature": 1.0, "max_tokens": 4},
                learning_rate=2e-2, progress=False, checkpoint_every=100, micro_batch_size=4)
    base.update(kw)
    return RLConfig(**base)


def _policy(path, cfg):
    model, tok, _ = load_model(str(path))
    setup_model(model, cfg)
    return model, tok


def test_adapters_disabled_equals_base_model(tiny_qwen3):
    cfg = _cfg()
    model, _ = _policy(tiny_qwen3, cfg)
    # make the adapters non-trivial (lora_b starts at zero)
    for name, p in tree_flatten(model.trainable_parameters()):
        if name.endswith("lora_b"):
            model.update(_nested(name, mx.random.normal(p.shape) * 0.5))
    base, _, _ = load_model(str(tiny_qwen3))
    ids = mx.random.randint(0, base.args.vocab_size, (2, 12))
    lp_base = model_token_logprobs(base, ids[:, :-1], ids[:, 1:], 0.7)
    lp_lora = model_token_logprobs(model, ids[:, :-1], ids[:, 1:], 0.7)
    with adapters_disabled(model):
        lp_off = model_token_logprobs(model, ids[:, :-1], ids[:, 1:], 0.7)
    assert float(mx.abs(lp_lora - lp_base).max()) > 1e-3  # the adapters do something
    assert np.allclose(np.array(lp_off), np.array(lp_base), atol=1e-6)
    lp_again = model_token_logprobs(model, ids[:, :-1], ids[:, 1:], 0.7)  # restored afterwards
    assert np.array_equal(np.array(lp_again), np.array(lp_lora))


def _nested(name, value):
    from mlx.utils import tree_unflatten

    return tree_unflatten([(name, value)])


def test_one_step_changes_lora_and_nothing_frozen(tiny_llama, tmp_path):
    cfg = _cfg(steps=1, batch_size=4, beta=0.05, mu=2)
    model, tok = _policy(tiny_llama, cfg)
    before_all = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    assert trainable and all(k.endswith(("lora_a", "lora_b")) for k in trainable)
    s = train(model, tok, _tasks(), cfg, tmp_path / "run", seed=1)
    after = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    changed = {k for k in after if not np.array_equal(after[k], before_all[k])}
    assert changed and changed <= trainable
    assert any(k.endswith("lora_b") for k in changed)
    rec = s["last"]
    for key in ("reward_mean", "pass_rate", "frac_groups_mixed", "mgpo_weight_mean", "clip_frac", "kl", "entropy",
                "gen_tokens_per_s", "train_tokens_per_s", "step_s", "ref_s", "peak_memory_mb", "ratio_mean"):
        assert key in rec, key
    assert rec["behaviour_logp_absdiff"] < 1e-3  # sampler and trainer agree on the log-probs
    assert rec["ratio_max"] != 1.0  # mu = 2: the second inner update sees a real ratio
    # adapters are written where mlx-lm's loader finds them
    from mlx_lm.tuner.utils import load_adapters

    fresh, _, _ = load_model(str(tiny_llama))
    load_adapters(fresh, str(tmp_path / "run"))


def test_short_run_raises_mean_reward(tiny_qwen3, tmp_path):
    cfg = _cfg(steps=10, batch_size=4, group_size=8, mgpo_lambda=1.0)
    model, tok = _policy(tiny_qwen3, cfg)
    train(model, tok, _tasks(), cfg, tmp_path / "run", seed=0)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    r = [row["reward_mean"] for row in rows]
    assert len(r) == 10
    assert np.mean(r[-3:]) > np.mean(r[:3]) + 0.25, r


def _strip(row):
    return {k: v for k, v in row.items() if not k.endswith(("_s", "_per_s", "_mb"))}


def test_resume_continues_identically(tiny_qwen3, tmp_path):
    cfg4 = _cfg(steps=4, checkpoint_every=2)
    m1, tok = _policy(tiny_qwen3, cfg4)
    train(m1, tok, _tasks(), cfg4, tmp_path / "a", seed=3)

    cfg2 = _cfg(steps=2, checkpoint_every=2)
    m2, _ = _policy(tiny_qwen3, cfg2)
    train(m2, tok, _tasks(), cfg2, tmp_path / "b", seed=3)
    m3, _ = _policy(tiny_qwen3, cfg4)  # a fresh process would start like this
    train(m3, tok, _tasks(), cfg4, tmp_path / "b", seed=3)

    a = dict(tree_flatten(m1.trainable_parameters()))
    b = dict(tree_flatten(m3.trainable_parameters()))
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
    ra = [_strip(json.loads(x)) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rb = [_strip(json.loads(x)) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert ra == rb


def poison_loss(monkeypatch, is_bad) -> None:
    """Make the RL loss NaN on the loss calls ``n`` (counted from 1, one per micro-batch and inner
    update) for which ``is_bad(n)`` holds."""
    import mlx_ssp.rl.step as step  # where the update looks the loss up

    real = step.make_loss
    calls = {"n": 0}

    def poisoned(cfg_, units):
        fn = real(cfg_, units)

        def f(model, mb, hidden=None):
            loss, aux = fn(model, mb, hidden)
            calls["n"] += 1
            return (loss * mx.nan if is_bad(calls["n"]) else loss), aux

        return f

    monkeypatch.setattr(step, "make_loss", poisoned)


def test_non_finite_steps_are_skipped_then_stop(tiny_qwen3, tmp_path, monkeypatch):
    cfg = _cfg(steps=6, max_bad_steps=2, checkpoint_every=1)
    model, tok = _policy(tiny_qwen3, cfg)
    poison_loss(monkeypatch, lambda n: n > 2)  # step 1 ok, then NaN forever
    good = None

    def snap(tr, rec):
        nonlocal good
        if not rec["skipped"]:
            good = {k: np.array(v) for k, v in tree_flatten(tr.model.trainable_parameters())}

    with pytest.raises(UserError, match="2 steps in a row.*step_0000003"):
        train(model, tok, _tasks(), cfg, tmp_path / "run", seed=0, on_step=snap)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, True, True]
    assert rows[-1]["skipped_total"] == 2
    now = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    assert all(np.array_equal(now[k], good[k]) for k in good)  # skipped steps changed nothing
    assert (tmp_path / "run" / "checkpoints" / "step_0000003" / "adapters.safetensors").is_file()


def test_dynamic_sampling_drops_uninformative_groups(tiny_qwen3, tmp_path):
    cfg = _cfg(steps=2, batch_size=3, group_size=2, dynamic_sampling=True, max_refill_rounds=3)
    model, tok = _policy(tiny_qwen3, cfg)
    train(model, tok, _tasks(), cfg, tmp_path / "run", seed=0)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["groups_kept"] == min(3, r["groups_sampled"] - r["groups_dropped"])
        if r["groups_dropped"] and r["groups_kept"] < 3:
            assert r["refill_rounds"] == 3  # refilled up to the limit
    assert any(r["groups_dropped"] > 0 for r in rows)  # G=2 on a coin-flip reward: many equal pairs


def test_micro_batches_give_the_full_batch_gradient(tiny_llama):
    from mlx_ssp.rl.batch import build_batch
    from mlx_ssp.rl.trainer import Trainer

    rng = np.random.default_rng(0)
    recs = [{"prompt_token_ids": rng.integers(0, 300, 5 + i % 3).tolist(),
             "token_ids": rng.integers(0, 300, 2 + i % 4).tolist(), "logprobs": [-1.0] * (2 + i % 4)}
            for i in range(8)]
    adv = rng.normal(size=8).astype(np.float32)
    out = {}
    for agg in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"):
        for mbs in (8, 3):
            cfg = _cfg(micro_batch_size=mbs, optimizer="sgd", learning_rate=1.0, max_grad_norm=None, aggregation=agg,
                       beta=0.1)
            model, tok = _policy(tiny_llama, cfg)
            for name, p in tree_flatten(model.trainable_parameters()):  # non-zero lora_b: KL is non-trivial
                if name.endswith("lora_b"):
                    model.update(_nested(name, mx.random.normal(p.shape, key=mx.random.key(1)) * 0.1))
            before = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
            tr = Trainer(model, tok, _tasks(), cfg, "/tmp", seed=0)
            ok, _ = tr.updater.update(build_batch(recs, adv))
            assert ok
            out[mbs] = {k: np.array(v) - before[k] for k, v in tree_flatten(model.trainable_parameters())}
        for k in out[8]:
            np.testing.assert_allclose(out[3][k], out[8][k], rtol=1e-3, atol=1e-4)  # float32 rounding


def test_config_errors():
    from mlx_ssp.config import load_section

    with pytest.raises(UserError, match="unknown key 'rl.lamda'"):
        load_section({"rl": {"lamda": 1}}, "rl")
    with pytest.raises(UserError, match="seq-mean-token-mean"):
        load_section({"rl": {"aggregation": "mean"}}, "rl")
    with pytest.raises(UserError, match="temperature"):
        load_section({"rl": {"sampling": {"temperature": 0}}}, "rl")


def test_cli_runs_and_resumes(tiny_qwen3, tmp_path):
    from mlx_ssp.cli import main

    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, _tasks())
    run = {"model": str(tiny_qwen3), "seed": 0, "run_dir": str(tmp_path / "runs"),
           "rl": {"tasks": str(tasks), "steps": 1, "batch_size": 2, "group_size": 2, "progress": False,
                  "sampling": {"max_tokens": 3}}}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(run))
    r = CliRunner().invoke(main, ["rl", str(cfg)])
    assert r.exit_code == 0, r.output
    out = tmp_path / "runs" / "rl"
    assert (out / "adapters.safetensors").is_file() and (out / "adapter_config.json").is_file()
    r = CliRunner().invoke(main, ["rl", str(cfg), "--set", "rl.steps=2"])
    assert r.exit_code == 0, r.output
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    r = CliRunner().invoke(main, ["rl", str(cfg), "--set", "rl.bogus=1"])
    assert r.exit_code == 2 and "rl.bogus" in r.output


@pytest.mark.slow
def test_auto_micro_batch_cuts_pieces_and_old_runs_resume(tiny_llama, tmp_path):
    """With long rows the memory model cuts a group into one-row pieces (auto_micro_batch, the
    default) where micro_batch_size alone would take 4, with the same update; a run directory
    written before the key existed (its rl_config.json without it) resumes under the new default."""
    from mlx_ssp.rl.batch import build_batch
    from mlx_ssp.rl.trainer import Trainer

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 300, 40).tolist()
    recs = [{"prompt_token_ids": prompt, "token_ids": rng.integers(0, 300, 400).tolist(), "logprobs": [-1.0] * 400}
            for _ in range(4)]
    adv = rng.normal(size=4).astype(np.float32)
    moved, pieces = {}, {}
    for auto in (True, False):
        cfg = _cfg(batch_size=1, micro_batch_size=4, auto_micro_batch=auto, optimizer="sgd", learning_rate=1.0,
                   max_grad_norm=None, chunk_size=4096)
        model, tok = _policy(tiny_llama, cfg)
        before = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
        tr = Trainer(model, tok, _tasks(), cfg, tmp_path, seed=0)
        batch = build_batch(recs, adv)
        pieces[auto] = [j - i for _, ps in tr.updater.layout(batch) for i, j in ps]
        ok, _ = tr.updater.update(batch)
        assert ok
        moved[auto] = {k: np.array(v) - before[k] for k, v in tree_flatten(model.trainable_parameters())}
    assert pieces == {True: [1, 1, 1, 1], False: [4]}
    for k in moved[False]:
        np.testing.assert_allclose(moved[True][k], moved[False][k], rtol=1e-3, atol=1e-5, err_msg=k)

    old = _cfg(steps=1, checkpoint_every=1, auto_micro_batch=False)  # the layout before the key existed
    m, tok = _policy(tiny_llama, old)
    train(m, tok, _tasks(), old, tmp_path / "run", seed=1)
    saved = tmp_path / "run" / "rl_config.json"
    record = json.loads(saved.read_text())
    del record["rl"]["auto_micro_batch"]  # as the code before the key wrote it
    saved.write_text(json.dumps(record))
    new = _cfg(steps=2, checkpoint_every=1)
    m, tok = _policy(tiny_llama, new)
    train(m, tok, _tasks(), new, tmp_path / "run", seed=1)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    assert "auto_micro_batch" not in json.loads(saved.read_text())["rl"]
