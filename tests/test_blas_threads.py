"""OpenBLAS's thread count around a block (mlx_ssp._blas.threads) and the decoder's one-thread pass
for a few rows: the count is set and restored, a user's OPENBLAS_NUM_THREADS is left alone, and
neither products nor sampled tokens change."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx)
from mlx_ssp import _blas
from mlx_ssp.rollout import SamplingConfig, decoder, generate_rollouts
from mlx_ssp.rollout.request import RolloutRequest
from mlx_ssp.tasks import Task

LIB = _blas._library()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"no OpenBLAS loaded by mlx_ssp ({_blas.status})")


def count() -> int:
    return int(LIB.openblas_get_num_threads())


@pytest.fixture(autouse=True)
def no_user_setting(monkeypatch):
    for k in _blas.USER_THREAD_ENVS:
        monkeypatch.delenv(k, raising=False)
    LIB.openblas_set_num_threads(2)  # a count other than the decoder's 1, so a missed restore shows
    yield
    assert _blas._depth == 0


def test_threads_sets_the_count_inside_and_restores_it():
    before = count()
    with _blas.threads(1) as was:
        assert was == before
        assert count() == 1
    assert count() == before


def test_threads_restores_the_count_after_an_error():
    before = count()
    with pytest.raises(RuntimeError):
        with _blas.threads(1):
            raise RuntimeError("boom")
    assert count() == before


@pytest.mark.parametrize("env", _blas.USER_THREAD_ENVS)
def test_a_user_setting_is_left_alone(monkeypatch, env):
    monkeypatch.setenv(env, "2")
    before = count()
    with _blas.threads(1) as was:
        assert was is None
        assert count() == before


def test_nested_blocks_ending_out_of_order_restore_the_first_count():
    before = count()
    outer, inner = _blas.threads(1), _blas.threads(1)
    assert outer.__enter__() == before
    assert inner.__enter__() == before  # the count saved by the first block, not the 1 it set
    outer.__exit__(None, None, None)  # the first one ends first
    assert count() == 1  # the other block still runs on one thread
    inner.__exit__(None, None, None)
    assert count() == before


def test_products_are_the_same_with_one_thread():
    # large enough that OpenBLAS splits it over its threads; a few rows, as in decoding
    k = mx.random.key(0)
    a, b = mx.random.normal((4, 1024), key=k), mx.random.normal((1024, 4096), key=mx.random.split(k)[0])
    full = a @ b
    mx.eval(full)
    with _blas.threads(1):
        one = a @ b
        mx.eval(one)
    assert mx.array_equal(full, one).item()


def _tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", domain="math", prompt=f"What is {i} + 2?", answer=str(i + 2), verifier="exact")
            for i in range(n)]


def test_decoder_uses_one_thread_for_a_few_rows_and_restores_after(tiny_qwen3):
    from mlx_lm import load

    model, tok = load(str(tiny_qwen3))
    before = count()
    req = RolloutRequest(tasks=_tasks(1), k=4, sampling=SamplingConfig(max_tokens=4), progress=False)
    dec = decoder.Decoder(model, tok, req, total=4, unit="sample", desc="t")
    assert count() == 1
    dec.close({})
    assert count() == before
    many = decoder.ONE_THREAD_ROWS + 1
    dec = decoder.Decoder(model, tok, req.replace(k=many), total=many, unit="sample", desc="t")
    assert count() == before  # more rows: OpenBLAS's own count
    dec.close({})


def test_one_thread_decoding_draws_the_same_tokens(tiny_qwen3, monkeypatch):
    from mlx_lm import load

    model, tok = load(str(tiny_qwen3))
    kw = dict(k=4, sampling=SamplingConfig(temperature=1.0, max_tokens=12), seed=5, batch_size=8, progress=False)
    one = generate_rollouts(model, tok, _tasks(2), **kw)
    monkeypatch.setattr(decoder, "ONE_THREAD_ROWS", 0)
    default = generate_rollouts(model, tok, _tasks(2), **kw)
    assert [r["token_ids"] for r in one] == [r["token_ids"] for r in default]
    assert [r["logprobs"] for r in one] == [r["logprobs"] for r in default]


def test_decoders_closing_out_of_order_restore_the_count(tiny_qwen3):
    from mlx_lm import load

    model, tok = load(str(tiny_qwen3))
    before = count()
    req = RolloutRequest(tasks=_tasks(1), k=4, sampling=SamplingConfig(max_tokens=4), progress=False)
    a = decoder.Decoder(model, tok, req, total=4, unit="sample", desc="a")
    b = decoder.Decoder(model, tok, req, total=4, unit="sample", desc="b")
    a.close({})
    assert count() == 1
    b.close({})
    assert count() == before


def test_a_failing_generator_close_still_restores_the_count(tiny_qwen3, monkeypatch):
    from mlx_lm import load

    model, tok = load(str(tiny_qwen3))
    before = count()
    req = RolloutRequest(tasks=_tasks(1), k=4, sampling=SamplingConfig(max_tokens=4), progress=False)
    dec = decoder.Decoder(model, tok, req, total=4, unit="sample", desc="t")
    assert count() == 1

    def boom():
        raise RuntimeError("close failed")

    monkeypatch.setattr(dec.gen, "close", boom)
    with pytest.raises(RuntimeError):
        dec.close({})
    assert count() == before


def test_a_failure_after_the_decoder_started_restores_the_count(tiny_qwen3, monkeypatch):
    from mlx_lm import load

    from mlx_ssp.rollout import engine

    model, tok = load(str(tiny_qwen3))
    before = count()

    def broken_scorer(*a, **k):
        raise RuntimeError("scorer failed")

    monkeypatch.setattr(engine, "Scorer", broken_scorer)
    with pytest.raises(RuntimeError, match="scorer failed"):
        generate_rollouts(model, tok, _tasks(1), k=2, sampling=SamplingConfig(max_tokens=4), progress=False)
    assert count() == before
