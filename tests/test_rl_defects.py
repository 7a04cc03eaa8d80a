"""RL defects found in review, each pinned by a test that failed before the fix.

13: chunked log-probs of half-precision hidden states across several chunks (helper thread);
14: a step skipped at inner update k > 0 leaves parameters, optimizer state and checkpoint as they were;
15: logged clip_frac / ratio_max / means are whole-batch values, whatever the micro-batching;
16: behaviour_logp_absdiff is one global mean under data parallel; bf16 behaviour log-probs in float32.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_ssp  # noqa: F401
from mlx_ssp.rl import naive_token_logprobs, token_logprobs

# -- 13: bfloat16 chunks on the helper thread --------------------------------------------------


def _half_head(dtype, trained: bool):
    mx.random.seed(3)
    head = nn.Linear(16, 50, bias=False)
    head.set_dtype(dtype)
    if not trained:
        head.freeze()
    return head


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("save_grad", [False, True])
def test_chunked_logprobs_half_precision_several_chunks(dtype, save_grad):
    """20 tokens in chunks of 8 (3 chunks, built on the helper thread) equal the unchunked op,
    forward and gradient into the hidden states; before the fix bfloat16 raised
    'There is no Stream(cpu, 0) in current thread'."""
    head = _half_head(dtype, trained=False)
    h = mx.random.normal((20, 16), key=mx.random.key(1)).astype(dtype)
    t = mx.random.randint(0, 50, (20,), key=mx.random.key(2))
    coef = mx.random.normal((20,), key=mx.random.key(4))

    def lp(x, chunk):
        return token_logprobs(x, head, t, 0.7, chunk, save_grad=save_grad)

    one, chunked = lp(h, 64), lp(h, 8)
    np.testing.assert_allclose(np.array(chunked), np.array(one), atol=1e-6)
    # the float32 log-softmax of the head's own logits (in its dtype): no half-precision arithmetic
    np.testing.assert_allclose(np.array(chunked), np.array(naive_token_logprobs(h, head, t, 0.7)), atol=2e-6)
    g_one = mx.grad(lambda x: (lp(x, 64) * coef).sum())(h)
    g_chunked = mx.grad(lambda x: (lp(x, 8) * coef).sum())(h)
    assert g_chunked.dtype == dtype
    np.testing.assert_allclose(np.array(g_chunked.astype(mx.float32)), np.array(g_one.astype(mx.float32)), atol=1e-6)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_chunked_logprobs_half_precision_trained_head(dtype):
    """A trained half-precision head (full fine-tuning): its gradient accumulates over the chunks."""
    head = _half_head(dtype, trained=True)
    h = mx.random.normal((20, 16), key=mx.random.key(1)).astype(dtype)
    t = mx.random.randint(0, 50, (20,), key=mx.random.key(2))

    def loss(chunk):
        def f(x, w):
            head.weight = w
            return token_logprobs(x, head, t, 1.0, chunk).sum()
        return f

    w0 = head.weight
    ga = mx.grad(loss(8), argnums=(0, 1))(h, w0)
    gb = mx.grad(loss(64), argnums=(0, 1))(h, w0)
    head.weight = w0
    for a, b in zip(ga, gb):
        # the chunked sum of per-chunk head gradients rounds once per chunk in the head's dtype
        np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)), atol=2e-2, rtol=1e-2)


def test_bfloat16_training_step_with_several_chunks(tiny_qwen3, tmp_path):
    """The loop itself with train_dtype bfloat16 and 8-token chunks (the CPU crash of item 13),
    and its sampler and trainer log-probs agreeing (item 16)."""
    import json

    from test_rl_loop import _cfg, _policy, _tasks

    from mlx_ssp.rl.trainer import train

    cfg = _cfg(steps=1, mu=2, train_dtype="bfloat16", chunk_size=8)
    model, tok = _policy(tiny_qwen3, cfg)
    train(model, tok, _tasks(), cfg, tmp_path / "run", seed=0)
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not row["skipped"] and row["gen_tokens"] > 16
    assert row["behaviour_logp_absdiff"] < 1e-3, row["behaviour_logp_absdiff"]


# -- 15 and 16: whole-batch statistics -----------------------------------------------------------

STAT_KEYS = ("clip_frac", "dual_clip_frac", "ratio_mean", "ratio_max", "entropy", "behaviour_logp_absdiff")


def _by_hand_checks(stats):
    import rl_defects_worker as w

    assert stats["behaviour_logp_absdiff"] == pytest.approx(w.ABSDIFF, abs=1e-5)
    assert stats["clip_frac"] == pytest.approx(w.CLIP_FRAC, abs=1e-6)
    assert stats["ratio_max"] == pytest.approx(w.RATIO_MAX, abs=1e-5)
    assert stats["ratio_mean"] == pytest.approx(w.RATIO_MEAN, abs=1e-5)
    assert stats["dual_clip_frac"] == 0.0


def test_logged_statistics_do_not_depend_on_micro_batch_size(tiny_llama):
    """Lengths 2/5/8, 5 of 15 tokens clipped, max ratio 1.7: every micro-batching logs exactly that
    (before: clip_frac 0.3833 at micro-batch 1, 0.3690 at 2; ratio_max 1.5 at 1)."""
    import rl_defects_worker as w

    from mlx_ssp.models import load_model
    from mlx_ssp.rl.batch import build_batch
    from mlx_ssp.rl.pieces import sequence_logprobs
    from mlx_ssp.rl.policy import setup_model

    runs = {mbs: w.logged_stats(str(tiny_llama), mbs) for mbs in (1, 2, 3, 4)}
    for mbs, stats in runs.items():
        _by_hand_checks(stats)
        for k in STAT_KEYS:
            assert stats[k] == pytest.approx(runs[3][k], abs=1e-6), (mbs, k)
    # the entropy is the token mean over the whole batch
    model, _, _ = load_model(str(tiny_llama))
    setup_model(model, w.rl_config(3))
    recs, adv = w.constructed_case(model)
    b = build_batch(recs, adv)
    _, ent = sequence_logprobs(model, b["inputs"], b["targets"], 0.8, None, entropy=True)
    want = float(((ent * b["mask"]).sum() / b["mask"].sum()).item())
    assert runs[1]["entropy"] == pytest.approx(want, abs=1e-5)


def test_totals_reduce_exactly_over_parts_and_ranks():
    """Pure reduction: per-micro-batch / per-rank totals give the whole batch's values, the count
    summed once (the data-parallel bug divided each rank's sum by its own count and summed)."""
    from mlx_ssp.rl.loss import finalize_totals, policy_loss
    from mlx_ssp.rl.pieces import behaviour_totals
    from mlx_ssp.rl.step import reduce_totals

    rng = np.random.default_rng(0)
    lens = [2, 5, 8]
    mask = np.zeros((3, 8), np.float32)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    logp = rng.normal(size=(3, 8)).astype(np.float32) * 0.3 - 2
    old = logp + rng.normal(size=(3, 8)).astype(np.float32) * 0.3
    adv = np.array([1.0, -1.0, 0.5], np.float32)

    def totals(rows):
        lp, o, m = (mx.array(x[rows]) for x in (logp, old, mask))
        t = policy_loss(lp, o, mx.array(adv[rows]), m, entropy=-lp).totals
        t = {**t, **behaviour_totals(lp, o, m)}
        return {k: float(v.item()) for k, v in t.items()}

    whole = finalize_totals(totals([0, 1, 2]))
    m = mask > 0
    ratio = np.exp(logp - old)
    clipped = ((ratio < 0.8) & (adv[:, None] < 0)) | ((ratio > 1.2) & (adv[:, None] > 0))
    assert whole["clip_frac"] == pytest.approx(clipped[m].mean(), abs=1e-7)
    assert whole["ratio_max"] == pytest.approx(ratio[m].max(), rel=1e-6)
    assert whole["behaviour_logp_absdiff"] == pytest.approx(np.abs(logp - old)[m].mean(), rel=1e-6)
    for split in ([[0], [1], [2]], [[0, 1], [2]], [[0], [1, 2]]):
        # micro-batches of one rank, or ranks gathered with gather_per_rank: the same reduction
        got = finalize_totals(reduce_totals([totals(rows) for rows in split]))
        for k, v in whole.items():
            assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-7), (split, k)
    # a rank without a sequence contributes nothing
    assert finalize_totals(reduce_totals([{}, totals([0, 1, 2])])) == whole


@pytest.mark.slow
def test_two_ranks_log_the_one_process_statistics(tiny_llama, tmp_path):
    """Under mlx.launch -n 2 the logged statistics equal one process's (behaviour_logp_absdiff was
    about twice too large before: each rank's mean summed over the ranks)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import rl_defects_worker as w
    from test_distributed import free_ports

    worker = Path(__file__).with_name("rl_defects_worker.py")
    root = worker.parents[1]
    s1 = w.logged_stats(str(tiny_llama), 2)
    cmd = ["mlx.launch", "-n", "2", "--backend", "ring", "-p", str(free_ports(2)), "--", sys.executable, str(worker),
           str(tiny_llama), str(tmp_path / "two.json"), "2"]
    # PYTHONPATH: the ranks import this checkout's package (not whichever one is installed)
    env = dict(os.environ, PYTHONPATH=str(root))
    two = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert two.returncode == 0, two.stderr
    s2 = json.loads((tmp_path / "two.json").read_text())
    assert s2["size"] == 2
    _by_hand_checks(s2)
    for k in STAT_KEYS + ("loss", "grad_norm"):
        assert s2[k] == pytest.approx(s1[k], rel=1e-5, abs=1e-6), k


# -- 14: a skipped step changes nothing ----------------------------------------------------------


def _flat_state(tr) -> dict:
    from mlx.utils import tree_flatten

    out = {f"param/{k}": np.array(v) for k, v in tree_flatten(tr.model.trainable_parameters())}
    out.update({f"opt/{k}": np.array(v) for k, v in tree_flatten(tr.opt.state)})
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def test_step_skipped_at_a_later_inner_update_changes_nothing(tiny_qwen3, tmp_path, monkeypatch):
    """mu = 2 and a NaN loss at the second inner update of step 2: parameters, the optimizer state
    (its step count included) and the checkpoint are bit-identical to after step 1 (before: the
    first inner update stayed applied, optimizer step 3)."""
    import json

    from test_rl_loop import _cfg, _policy, _tasks, poison_loss

    from mlx_ssp.rl.trainer import train

    cfg = _cfg(steps=3, mu=2, micro_batch_size=4, max_bad_steps=5, checkpoint_every=1, optimizer="adamw")
    model, tok = _policy(tiny_qwen3, cfg)
    # 2 groups x 4 samples, micro-batch 4: 2 loss calls per inner update, 4 per step; 7-8 are step 2's
    # second inner update
    poison_loss(monkeypatch, lambda n: n in (7, 8))
    states = []
    ck = tmp_path / "run" / "checkpoints"
    saved = {}  # each checkpoint as written: the next one drops its optimizer state

    def on_step(tr, rec):
        states.append(_flat_state(tr))
        if tr.step_no > 1:
            saved[tr.step_no - 1] = {name: mx.load(str(ck / f"step_{tr.step_no - 1:07d}" / name))
                                     for name in ("adapters.safetensors", "optimizer.safetensors")}

    train(model, tok, _tasks(), cfg, tmp_path / "run", seed=0, on_step=on_step)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, True, False]
    assert _same(states[1], states[0])
    assert int(states[1]["opt/step"]) == 2  # mu = 2 updates of step 1, none of step 2
    assert not _same(states[2], states[1])  # and the run goes on from there
    for name in ("adapters.safetensors", "optimizer.safetensors"):
        a, b = saved[1][name], saved[2][name]
        assert _same({k: np.array(v) for k, v in a.items()}, {k: np.array(v) for k, v in b.items()}), name


# -- 16: behaviour log-probs of half-precision models in float32 --------------------------------


def _rollout_case(model, tok, temperature):
    from test_rl_loop import PROMPTS

    from mlx_ssp.rl.batch import build_batch
    from mlx_ssp.rollout import SamplingConfig, generate_rollouts
    from mlx_ssp.tasks import Task

    tasks = [Task(id=f"t{i}", domain="toy", prompt=p, answer="-", verifier="rl_test_has_digit")
             for i, p in enumerate(PROMPTS[:3])]
    recs = generate_rollouts(model, tok, tasks, k=4, sampling=SamplingConfig(temperature=temperature, max_tokens=24),
                             seed=1, progress=False)
    return recs, build_batch(recs, np.zeros(len(recs), np.float32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_behaviour_logprobs_match_the_trainer(tiny_qwen3, dtype):
    """The sampler's recorded log-probs equal the trainer's float32 log-softmax of the same model
    (before: bf16 mean gap 0.0135 at T=0.7, fp16 0.0025: mlx-lm normalised in the model's dtype)."""
    from mlx_ssp.models import load_model
    from mlx_ssp.rl.pieces import sequence_logprobs

    model, tok, _ = load_model(str(tiny_qwen3))
    model.set_dtype(getattr(mx, dtype))
    _, b = _rollout_case(model, tok, 0.7)
    lp = sequence_logprobs(model, b["inputs"], b["targets"], 0.7, None, save_grad=True)
    m = b["mask"]
    gap = float(((mx.abs(lp - b["behaviour"]) * m).sum() / m.sum()).item())
    assert float(m.sum().item()) > 50
    assert gap < 1e-3, gap


def test_float32_rollouts_are_untouched_by_the_float32_cast(tiny_qwen3, monkeypatch):
    """A float32 model samples the same tokens with the same log-probs with or without the cast."""
    import mlx_ssp.sampling as sampling
    from mlx_ssp.models import load_model

    model, tok, _ = load_model(str(tiny_qwen3))
    with_cast, _ = _rollout_case(model, tok, 0.7)
    monkeypatch.setattr(sampling, "Float32Logits", lambda m: m)
    without, _ = _rollout_case(model, tok, 0.7)
    key = lambda r: (r["task_id"], r["sample"], r["token_ids"], r["logprobs"])
    assert [key(r) for r in with_cast] == [key(r) for r in without]
