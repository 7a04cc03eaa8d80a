"""K-rollouts on tiny float32 models: behaviour log-probs, reproducibility, stops, bad input."""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest

import mlx_ssp  # noqa: F401
from mlx_ssp.errors import UserError
from mlx_ssp.rollout import SamplingConfig, generate_rollouts
from mlx_ssp.tasks import Task


@pytest.fixture(scope="module")
def qwen(tiny_qwen3):
    from mlx_lm import load

    return load(str(tiny_qwen3))


@pytest.fixture(scope="module")
def llama(tiny_llama):
    from mlx_lm import load

    return load(str(tiny_llama))


def make_tasks(n=4):
    return [
        Task(id=f"t{i}", domain="even" if i % 2 == 0 else "odd", prompt="What is " + " + ".join(["2"] * (i + 1)) + "?",
             answer=str(2 * (i + 1)), verifier="exact")
        for i in range(n)
    ]


def teacher_forced(model, prompt_ids, token_ids, temperature):
    """log_softmax(logits / T)[token] for each completion token, one unbatched forward pass."""
    x = mx.array([list(prompt_ids) + list(token_ids[:-1])])
    logits = model(x)[0, len(prompt_ids) - 1 :].astype(mx.float32) / temperature
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(lp, mx.array(token_ids)[:, None], axis=-1)[:, 0]


@pytest.mark.parametrize("fixture,temperature,top_p", [("qwen", 0.7, 1.0), ("llama", 1.3, 1.0), ("qwen", 0.7, 0.9)])
def test_behaviour_logprobs_match_teacher_forced(request, fixture, temperature, top_p):
    model, tok = request.getfixturevalue(fixture)
    recs = generate_rollouts(model, tok, make_tasks(3), k=3, seed=3, batch_size=5, progress=False,
                             sampling=SamplingConfig(temperature=temperature, top_p=top_p, max_tokens=24))
    assert len(recs) == 9
    for r in recs:
        assert len(r["logprobs"]) == len(r["token_ids"]) == r["num_tokens"] > 0
        ref = teacher_forced(model, r["prompt_token_ids"], r["token_ids"], temperature)
        got = mx.array(r["logprobs"])
        assert mx.allclose(got, ref, atol=2e-5, rtol=0).item(), float(mx.abs(got - ref).max())
        assert r["logprob_temperature"] == temperature
        # not mlx-lm's T=1 log-probs
    ref1 = teacher_forced(model, recs[0]["prompt_token_ids"], recs[0]["token_ids"], 1.0)
    assert not mx.allclose(mx.array(recs[0]["logprobs"]), ref1, atol=1e-3).item()


def test_greedy_is_argmax_and_stores_t1_logprobs(qwen):
    model, tok = qwen
    recs = generate_rollouts(model, tok, make_tasks(2), k=2, batch_size=4, progress=False,
                             sampling=SamplingConfig(temperature=0, max_tokens=10))
    by_task = {}
    for r in recs:
        assert r["logprob_temperature"] == 1.0
        ref = teacher_forced(model, r["prompt_token_ids"], r["token_ids"], 1.0)
        assert mx.allclose(mx.array(r["logprobs"]), ref, atol=2e-5).item()
        by_task.setdefault(r["task_id"], []).append(r["token_ids"])
    for samples in by_task.values():
        assert samples[0] == samples[1]  # greedy: every sample identical


def test_same_seed_same_samples_whatever_batch_size_or_order(qwen):
    model, tok = qwen
    tasks = make_tasks(5)
    sc = SamplingConfig(temperature=1.0, max_tokens=16)

    def run(ts, bs, seed=7):
        recs = generate_rollouts(model, tok, ts, k=3, sampling=sc, seed=seed, batch_size=bs, progress=False)
        return {(r["task_id"], r["sample"]): r["token_ids"] for r in recs}

    a = run(tasks, 1)
    assert a == run(tasks, 4) == run(tasks[::-1], 16)
    # prefilling 8 prompts together (padded) or one at a time draws the same tokens
    pb8 = generate_rollouts(model, tok, tasks, k=3, sampling=sc, seed=7, batch_size=16, progress=False,
                            prefill_batch_size=8)
    assert {(r["task_id"], r["sample"]): r["token_ids"] for r in pb8} == a
    assert run(tasks[2:3], 2) == {key: v for key, v in a.items() if key[0] == "t2"}
    b = run(tasks, 4, seed=8)
    assert sum(a[key] != b[key] for key in a) >= len(a) - 1  # another seed: other samples
    # distinct sample indices of one task draw distinct streams
    assert len({tuple(a[("t0", s)]) for s in range(3)}) == 3


def test_shared_prompt_prefix_draws_the_same_samples(qwen):
    """The K samples of a prompt prefilled once draw the tokens they draw prefilled alone,
    with behaviour log-probs equal up to float32 rounding, and the saved prefill is counted."""
    model, tok = qwen
    tasks = make_tasks(4)
    sc = SamplingConfig(temperature=1.0, max_tokens=12)
    runs = {}
    for share in (False, True):
        st: dict = {}
        recs = generate_rollouts(model, tok, tasks, k=4, sampling=sc, seed=11, batch_size=16, progress=False,
                                 share_prefix=share, stats=st)
        runs[share] = (recs, st)
    (a, sa), (b, sb) = runs[False], runs[True]
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]
    assert max(abs(x - y) for r, q in zip(a, b) for x, y in zip(r["logprobs"], q["logprobs"])) < 1e-4
    assert sa["prefill_saved_tokens"] == 0
    assert sb["prefill_saved_tokens"] == sum(3 * (len(r["prompt_token_ids"]) - 1) for r in b if r["sample"] == 0)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.2, top_k=5)])
def test_batch_sampler_draws_the_same_tokens_as_per_sequence_samplers(qwen, monkeypatch, sampling):
    """The shared BatchSampler (one draw per step for the batch) gives token for token what one
    SequenceSampler per sequence gives: the speed-up changes nothing about the samples."""
    model, tok = qwen
    sc = SamplingConfig(max_tokens=20, **sampling)

    def run(bs):
        recs = generate_rollouts(model, tok, make_tasks(4), k=3, sampling=sc, seed=11, batch_size=bs, progress=False)
        return {(r["task_id"], r["sample"]): (r["token_ids"], r["logprobs"]) for r in recs}

    batched = run(5)
    monkeypatch.setenv("MLX_SSP_PER_SEQUENCE_SAMPLER", "1")
    for per_seq in (run(5), run(2)):
        assert {key: v[0] for key, v in per_seq.items()} == {key: v[0] for key, v in batched.items()}
        for key, (_, lps) in per_seq.items():  # log-probs: same up to float32 rounding of the batch shape
            assert mx.allclose(mx.array(lps), mx.array(batched[key][1]), atol=1e-5).item()


def test_batch_sampler_needs_the_calling_batch_uids():
    """Called from anywhere without a matching ``uids`` list (an incompatible mlx-lm), it refuses
    with the fallback named instead of mis-assigning noise rows."""
    from mlx_ssp.sampling import BatchSampler

    bs = BatchSampler(1.0)
    bs.add(0, 123)
    with pytest.raises(RuntimeError, match="MLX_SSP_PER_SEQUENCE_SAMPLER"):
        bs(mx.zeros((1, 8)))

    class FakeBatch:  # stands in for mlx-lm's GenerationBatch calling from its _step
        uids = [0, 1]

        def _step(self, lp):
            return bs(lp)

    with pytest.raises(RuntimeError, match="uid 1 was never registered"):
        FakeBatch()._step(mx.zeros((2, 8)))
    bs.add(1, 456)
    a = FakeBatch()._step(mx.zeros((2, 8))).tolist()
    assert bs.n_live == 2
    bs.drop(0)
    assert bs.n_live == 1
    assert len(a) == 2


@pytest.mark.parametrize("per_sequence", [False, True])
def test_without_logprobs_the_same_tokens_are_drawn(qwen, monkeypatch, per_sequence):
    """``logprobs=False`` (eval, probes) draws the very tokens of a run that keeps them, with top-p
    on, on both sampling paths; its records carry no log-probs."""
    if per_sequence:
        monkeypatch.setenv("MLX_SSP_PER_SEQUENCE_SAMPLER", "1")
    model, tok = qwen
    sc = SamplingConfig(temperature=0.9, top_p=0.9, max_tokens=12)
    kw = dict(k=3, sampling=sc, seed=4, batch_size=8, progress=False)
    with_lp = generate_rollouts(model, tok, make_tasks(3), **kw)
    without = generate_rollouts(model, tok, make_tasks(3), logprobs=False, **kw)
    assert [r["token_ids"] for r in without] == [r["token_ids"] for r in with_lp]
    assert [r["completion"] for r in without] == [r["completion"] for r in with_lp]
    assert all(len(r["logprobs"]) == len(r["token_ids"]) for r in with_lp)
    assert all(r["logprobs"] == [] for r in without)


def test_records_ordered_and_complete(qwen):
    model, tok = qwen
    tasks = make_tasks(3)
    recs = generate_rollouts(model, tok, tasks, k=2, batch_size=3, progress=False,
                             sampling=SamplingConfig(max_tokens=8))
    assert [(r["task_id"], r["sample"]) for r in recs] == [(t.id, s) for t in tasks for s in range(2)]
    keys = {"task_id", "domain", "sample", "prompt", "prompt_token_ids", "completion", "token_ids", "logprobs",
            "finish_reason", "reward", "reason", "latency_s"}
    for r in recs:
        assert keys <= set(r)
        assert r["finish_reason"] in ("stop", "length")
        assert r["reward"] in (0.0, 1.0) and r["reason"]
        assert r["num_tokens"] <= 8


def test_eos_ends_sequence_and_is_kept_in_tokens(qwen):
    model, tok = qwen
    tasks = make_tasks(1)
    sc = SamplingConfig(temperature=1.0, max_tokens=20)
    base = generate_rollouts(model, tok, tasks, k=1, sampling=sc, seed=5, progress=False)[0]
    eos = base["token_ids"][5]
    first = base["token_ids"].index(eos)
    old = set(tok.eos_token_ids)
    tok.eos_token_ids = old | {eos}
    try:
        r = generate_rollouts(model, tok, tasks, k=1, sampling=sc, seed=5, progress=False)[0]
    finally:
        tok.eos_token_ids = old
    assert r["finish_reason"] == "stop"
    assert r["token_ids"] == base["token_ids"][: first + 1]
    assert r["completion"] == tok.decode(base["token_ids"][:first])


def test_stop_string_cuts_completion(qwen):
    model, tok = qwen
    tasks = make_tasks(1)
    sc = SamplingConfig(temperature=1.0, max_tokens=30)
    base = generate_rollouts(model, tok, tasks, k=1, sampling=sc, seed=11, progress=False)[0]
    text = base["completion"]
    assert len(text) > 12
    stop = text[8:12]
    r = generate_rollouts(model, tok, tasks, k=1, seed=11, progress=False,
                          sampling=sc.model_copy(update={"stop": [stop]}))[0]
    assert r["finish_reason"] == "stop" and r["stop"] == stop
    assert r["completion"] == text[: text.index(stop)]
    assert stop not in r["completion"]
    n = r["num_tokens"]
    assert n < base["num_tokens"] and r["token_ids"] == base["token_ids"][:n]  # same stream, cut early
    assert len(r["logprobs"]) == n


def test_prompt_longer_than_context_is_skipped_with_warning(qwen):
    model, tok = qwen
    tasks = make_tasks(4)  # prompt lengths grow with the index
    from mlx_ssp.tasks import render_prompt

    lens = [len(render_prompt(tok, t)) for t in tasks]
    ctx = lens[1] + 3
    stats = {}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        recs = generate_rollouts(model, tok, tasks, k=2, progress=False, max_context=ctx, stats=stats,
                                 sampling=SamplingConfig(max_tokens=50))
    assert stats["skipped"] == [t.id for t, n in zip(tasks, lens) if n >= ctx]
    assert stats["skipped"] and any("skipped" in str(x.message) for x in w)
    for r in recs:
        assert len(r["prompt_token_ids"]) + r["num_tokens"] <= ctx


def test_bad_input_fails_before_generation(qwen):
    model, tok = qwen
    sc = SamplingConfig(max_tokens=4)
    with pytest.raises(UserError, match="k must be"):
        generate_rollouts(model, tok, make_tasks(1), k=0, sampling=sc, progress=False)
    with pytest.raises(UserError, match="empty"):
        generate_rollouts(model, tok, [], k=1, sampling=sc, progress=False)
    bad = Task(id="b", domain="d", prompt="hi", answer="1", verifier="no_such_verifier")
    with pytest.raises(UserError, match="unknown verifier"):
        generate_rollouts(model, tok, [bad], k=1, sampling=sc, progress=False)


def test_train_mode_restored(qwen):
    model, tok = qwen
    model.train()
    try:
        generate_rollouts(model, tok, make_tasks(1), k=1, sampling=SamplingConfig(max_tokens=3), progress=False)
        assert model.training
    finally:
        model.eval()


def test_parallel_verifier_runs_beside_generation(qwen):
    """Verifiers registered parallel=True (the code sandbox) run on worker threads; the records
    still come back complete, in order, with the same rewards as inline verification."""
    import threading
    import time

    from mlx_ssp.verify import PARALLEL, VERIFIERS, VerifyResult, register

    threads = set()

    @register("_test_slow_parallel", parallel=True)
    def slow(completion, task):
        threads.add(threading.current_thread().name)
        time.sleep(0.01)
        ok = len(completion) % 2 == 0
        return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer")

    try:
        model, tok = qwen
        tasks = [t.model_copy(update={"verifier": "_test_slow_parallel"}) for t in make_tasks(4)]
        sc = SamplingConfig(max_tokens=6)
        stats = {}
        recs = generate_rollouts(model, tok, tasks, k=3, sampling=sc, seed=1, progress=False, stats=stats)
        assert [(r["task_id"], r["sample"]) for r in recs] == [(t.id, s) for t in tasks for s in range(3)]
        assert all(r["reward"] == float(len(r["completion"]) % 2 == 0) for r in recs)
        assert any(name.startswith("verify") for name in threads)
        assert stats["verify_s"] >= 12 * 0.01
        inline = generate_rollouts(model, tok, tasks, k=3, sampling=sc, seed=1, progress=False, verify_workers=1)
        assert [r["reward"] for r in inline] == [r["reward"] for r in recs]
    finally:
        VERIFIERS.pop("_test_slow_parallel", None)
        PARALLEL.discard("_test_slow_parallel")


def test_sequence_sampler_draws_from_tempered_softmax():
    """Gumbel-max with chunked, keyed noise samples softmax(logprobs / T); top-k truncates."""
    import numpy as np

    from mlx_ssp.sampling import SequenceSampler

    x = mx.array([[0.0, -0.5, -1.0, -3.0]])
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    T = 0.7
    want = np.array(mx.softmax(x / T, axis=-1)[0])
    n = 3000
    draws = [SequenceSampler(i, T)(x).item() for i in range(n)]  # token 0 of n streams
    freq = np.bincount(draws, minlength=4) / n
    assert np.abs(freq - want).max() < 0.03, (freq, want)
    s = SequenceSampler(123, T)
    later = [s(x).item() for _ in range(n)]  # tokens 0..n-1 of one stream (many noise chunks)
    assert np.abs(np.bincount(later, minlength=4) / n - want).max() < 0.03
    assert {SequenceSampler(i, T, top_k=2)(x).item() for i in range(300)} == {0, 1}
    assert SequenceSampler(5, 0.0)(x).item() == 0


def test_top_p_filter_keeps_exactly_the_tokens_mlx_lm_keeps():
    """The NumPy-sorted nucleus filter returns mlx-lm's array bit for bit: peaked and flat rows,
    ties, rows already truncated (-inf), several thresholds, float16, one row and a batch."""
    from mlx_lm.sample_utils import apply_top_p

    from mlx_ssp.sampling import top_p_filter

    rng = mx.random.key(3)
    k1, k2 = mx.random.split(rng)
    peaked = mx.random.normal((4, 2000), key=k1) * 4.0
    flat = mx.random.normal((4, 2000), key=k2) * 0.3
    ties = mx.array([[0.0, 0.0, -1.0, -1.0, -1.0, -2.0, -9.0, -9.0]])
    cut = mx.where(mx.arange(2000) % 3 == 0, -float("inf"), peaked[:2])
    for x in (peaked, flat, peaked[:1], cut):
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        for p in (0.1, 0.9, 0.95, 0.999):
            want = apply_top_p(x, p)
            assert mx.array_equal(top_p_filter(x, p), want, equal_nan=True).item(), p
            assert (want > -float("inf")).sum().item() >= x.shape[0]  # the filter keeps a token per row
    ties = ties - mx.logsumexp(ties, axis=-1, keepdims=True)
    for p in (0.2, 0.5, 0.7, 0.9):
        assert mx.array_equal(top_p_filter(ties, p), apply_top_p(ties, p)).item(), p
    half = (peaked - mx.logsumexp(peaked, axis=-1, keepdims=True)).astype(mx.float16)
    assert mx.array_equal(top_p_filter(half, 0.9), apply_top_p(half, 0.9)).item()


def test_both_sampling_paths_behind_one_interface(monkeypatch):
    """The engine drives either sampler through the same calls; the environment picks the path."""
    from mlx_ssp.sampling import (
        SAMPLING_PATHS,
        BatchSampler,
        PerSequenceSampling,
        SequenceSampler,
        SharedSampling,
        sampling_path,
    )

    for cls in SAMPLING_PATHS.values():
        path = cls(0.7, 0.9, 0, 0.0)
        for name in ("generator_sampler", "insert_samplers", "register", "release", "step_logprobs"):
            assert hasattr(path, name), (cls, name)
    shared, per_seq = SharedSampling(1.0), PerSequenceSampling(1.0)
    assert isinstance(shared.generator_sampler, BatchSampler) and shared.insert_samplers([1, 2]) is None
    assert per_seq.generator_sampler is None and all(isinstance(s, SequenceSampler) for s in per_seq.insert_samplers([1, 2]))
    shared.register(7, 123)
    assert shared.generator_sampler.n_live == 1
    shared.release(7)
    assert shared.generator_sampler.n_live == 0
    monkeypatch.delenv("MLX_SSP_PER_SEQUENCE_SAMPLER", raising=False)
    assert isinstance(sampling_path(1.0), SharedSampling)
    monkeypatch.setenv("MLX_SSP_PER_SEQUENCE_SAMPLER", "1")
    assert isinstance(sampling_path(1.0), PerSequenceSampling)


def test_one_request_from_a_stage_section():
    """rollout and eval sections give the engine the same request fields (eval: default verify workers)."""
    from mlx_ssp.eval import EvalConfig
    from mlx_ssp.rollout import RolloutConfig, RolloutRequest, stage_settings

    r = stage_settings(RolloutConfig(seed=None, batch_size=3, verify_workers=2, system="s"))
    assert r["seed"] == 0 and r["batch_size"] == 3 and r["verify_workers"] == 2 and r["system"] == "s"
    e = stage_settings(EvalConfig(seed=5))
    assert e["seed"] == 5 and "verify_workers" not in e
    req = RolloutRequest(tasks=make_tasks(1), k=2, **e)
    assert req.verify_workers == 4 and req.replace(k=1).k == 1 and req.k == 2
    # prefill batch: automatic (8; episodes: 1 on the CPU these tests run on), capped by the batch; a key that
    # holds its default stays out of the dump, so runs made before it keep their fingerprints
    assert req.prefill_batch() == 8 and req.prefill_batch(episodes=True) == (1 if mx.default_device() == mx.cpu else 8)
    assert req.replace(prefill_batch_size=8, batch_size=3).prefill_batch() == 3
    assert "prefill_batch_size" not in RolloutConfig().model_dump() and "prefill_batch_size" not in EvalConfig().model_dump()
    assert stage_settings(RolloutConfig(prefill_batch_size=4))["prefill_batch_size"] == 4
    with pytest.raises(ValueError, match="prefill_batch_size"):
        RolloutConfig(prefill_batch_size=0)
    with pytest.raises(UserError, match="k must be"):
        req.replace(k=0).check()
    with pytest.raises(UserError, match="no tasks"):
        req.replace(tasks=[]).check()
