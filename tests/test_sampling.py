"""The sampler's exact CPU shortcuts: nucleus thresholds from the top of each row (mlx-lm's
``apply_top_p`` masks bit for bit), keyed Gumbel noise at chosen columns (``mx.random.gumbel``'s
bits), and the draw that uses both (the tokens of the whole-row draw)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_p

import mlx_ssp  # noqa: F401
from mlx_ssp import keyed_noise, nucleus, row_logsumexp
from mlx_ssp.sampling import (BatchSampler, _gumbel_max, _gumbel_rows, nucleus_draw, tempered_logsumexp,
                              top_p_filter)

V = 49152  # the demo model's vocabulary: rows whose tail really is long


def normalise(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def lm_like(n: int, seed: int, vocab: int = V, slope: float = 1.1, noise: float = 2.0) -> mx.array:
    """Rows shaped like a language model's: Zipf-like log-probs over shuffled ranks, plus noise."""
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(vocab) + 1 for _ in range(n)])
    x = -slope * np.log(ranks) * rng.uniform(1.0, 3.0, (n, 1)) + rng.normal(0, noise, (n, vocab))
    return normalise(mx.array(x.astype(np.float32)))


def rows_under_test() -> dict[str, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(3))
    peaked = mx.random.normal((3, V), key=k1) * 4.0
    ties = mx.array([[0.0, 0.0, -1.0, -1.0, -1.0, -2.0, -9.0, -9.0]])
    one_hot = mx.where(mx.arange(V) == 17, 0.0, -30.0)[None]
    return {
        "peaked": normalise(peaked),
        "flat": normalise(mx.random.normal((3, V), key=k2) * 0.3),  # every token a candidate
        "lm_like": lm_like(6, 0),
        "steep": lm_like(3, 1, slope=4.0, noise=0.5),
        "one_row": lm_like(1, 2),
        "ties": normalise(ties),
        "truncated": mx.where(mx.arange(V) % 3 == 0, -float("inf"), normalise(peaked[:2])),
        "one_hot": normalise(one_hot),
        "float16": lm_like(3, 3).astype(mx.float16),
    }


@pytest.mark.parametrize("name", list(rows_under_test()))
def test_top_p_filter_keeps_exactly_what_mlx_lm_keeps(name):
    x = rows_under_test()[name]
    for p in (0.1, 0.5, 0.9, 0.95, 0.999):
        want = apply_top_p(x, p)
        assert mx.array_equal(top_p_filter(x, p), want, equal_nan=True).item(), (name, p)
        assert ((want > -float("inf")).sum(axis=-1) >= 1).all().item()


def test_the_shortcut_and_the_full_sort_both_run_and_agree():
    """Normalised rows take the shortcut; rows it cannot vouch for (sum of candidates < 0.5: not
    normalised; NaN) take the full sort, and still give mlx-lm's mask."""
    x = lm_like(4, 5)
    thr, cols = nucleus.thresholds(np.array(x), 0.9)
    assert all(c is not None for c in cols)
    assert max(len(c) for c in cols) < V  # only the top of the row was sorted
    shifted = x - 3.0  # total mass e^-3 < 0.5: the candidates cannot vouch for the row total
    _, cols = nucleus.thresholds(np.array(shifted), 0.9)
    assert all(c is None for c in cols)
    assert mx.array_equal(top_p_filter(shifted, 0.9), apply_top_p(shifted, 0.9)).item()
    with_nan = mx.where(mx.arange(V) == 5, float("nan"), x[:2])
    _, cols = nucleus.thresholds(np.array(with_nan), 0.9)
    assert cols == [None, None]
    # per row: the shortcut on normalised rows next to a row that needs the full sort
    mixed = mx.concatenate([x[:2], shifted[:1]])
    _, cols = nucleus.thresholds(np.array(mixed), 0.9)
    assert [c is None for c in cols] == [False, False, True]
    assert mx.array_equal(top_p_filter(mixed, 0.9), apply_top_p(mixed, 0.9)).item()


def test_mlx_exp_of_a_subset_equals_the_full_rows():
    """The shortcut takes MLX's exp of the candidates alone: each element must come out as it does
    inside the whole row (no vector-width tail handled differently)."""
    x = lm_like(2, 7)
    full = np.array(mx.exp(x)).view(np.uint32)
    rng = np.random.default_rng(0)
    for n in (1, 3, 7, 8, 9, 31, 1000):
        cols = np.sort(rng.choice(V, n, replace=False))
        sub = np.array(mx.exp(mx.array(np.array(x)[1, cols]))).view(np.uint32)
        assert np.array_equal(sub, full[1, cols]), n


@pytest.mark.parametrize("vocab", [1, 2, 3, 5, 16, 1001, 49152, 49153])
def test_gumbel_at_columns_equals_mlx_gumbel(vocab):
    rng = np.random.default_rng(vocab)
    for seed in (0, 1, 12345, 2**32 + 1, 2**63 + 5, 2**64 - 1):
        key = mx.random.key(seed)
        want = np.array(mx.random.gumbel((vocab,), key=key)).view(np.uint32)
        cols = np.arange(vocab) if vocab < 2000 else rng.choice(vocab, 3000, replace=False)
        keys = np.broadcast_to(np.array(key, dtype=np.uint32), (len(cols), 2))
        got = np.array(keyed_noise.gumbel_at(keys, cols, vocab)).view(np.uint32)
        assert np.array_equal(got, want[cols]), seed
    assert keyed_noise.exact_here()


def test_gumbel_at_columns_equals_the_batched_rows():
    """Against the sampler's vmapped rows, with a different key per row."""
    keys = np.random.default_rng(1).integers(0, 2**32, (6, 2), dtype=np.uint64).astype(np.uint32)
    want = np.array(_gumbel_rows(V)(mx.array(keys))).view(np.uint32)
    rows = np.repeat(np.arange(6), 50)
    cols = np.random.default_rng(2).integers(0, V, rows.size)
    got = np.array(keyed_noise.gumbel_at(keys[rows], cols, V)).view(np.uint32)
    assert np.array_equal(got, want[rows, cols])


@pytest.mark.parametrize("name", ["lm_like", "steep", "peaked", "float16", "ties", "one_hot", "truncated"])
def test_nucleus_draw_gives_the_whole_row_draws_tokens(name):
    x = rows_under_test()[name]
    rng = np.random.default_rng(4)
    for T in (0.5, 0.9, 1.0, 1.7):
        for p in (0.5, 0.95):
            for _ in range(4):
                keys = rng.integers(0, 2**32, (x.shape[0], 2), dtype=np.uint64).astype(np.uint32)
                want = _gumbel_max(apply_top_p(x, p), mx.array(keys), T)
                got = nucleus_draw(x, p, keys, T)
                assert got.dtype == want.dtype and mx.array_equal(got, want).item(), (name, T, p)


def test_nucleus_draw_leaves_rows_it_cannot_vouch_for_to_the_whole_row():
    x = lm_like(2, 8) - 3.0
    assert nucleus_draw(x, 0.9, np.zeros((2, 2), np.uint32), 0.9) is None


def test_batch_sampler_takes_the_kept_token_route_only_for_top_p_alone():
    assert BatchSampler(0.9, top_p=0.95).nucleus_only == 0.95
    assert BatchSampler(0.9).nucleus_only is None
    assert BatchSampler(0.9, top_p=0.95, top_k=20).nucleus_only is None
    assert BatchSampler(0.9, top_p=0.95, min_p=0.05).nucleus_only is None


def same_bits(a, b) -> bool:
    return np.array_equal(np.asarray(a, dtype=np.float32).view(np.uint32), np.asarray(b, dtype=np.float32).view(np.uint32))


@pytest.mark.parametrize("vocab", [1, 7, 512, 1000, V])
def test_row_logsumexp_equals_mlx_logsumexp(vocab):
    """Bit for bit, on real-looking rows at several temperatures, with -inf entries, an all -inf
    row and a +inf one, row lengths on and off the block size."""
    x = np.array(lm_like(5, vocab, vocab=vocab))
    x[1, ::7] = -np.inf
    x[2] = -np.inf
    x[3, vocab // 2] = np.inf
    for T in (0.3, 0.9, 1.0, 1.6):
        scaled = np.array(mx.array(x) * (1.0 / T))
        want = np.array(mx.logsumexp(mx.array(scaled), axis=-1))
        assert same_bits(row_logsumexp.logsumexp_rows(scaled), want), T
    assert row_logsumexp.exact_here()


def test_row_logsumexp_skips_most_terms_of_a_long_row():
    """The point of it: most of a 49k-token row is never exponentiated (and the result is exact)."""
    x = np.array(lm_like(2, 11))
    assert (row_logsumexp.candidates(x).sum(axis=-1) < V / 2).all()


def test_tempered_logsumexp_is_mlx_s_expression():
    x = lm_like(4, 12)
    for T in (0.7, 0.9, 1.3):
        want = mx.logsumexp(x * (1.0 / T), axis=-1, keepdims=True)
        got = tempered_logsumexp(x, T)
        assert got.shape == want.shape and same_bits(got, want), T
    with_nan = mx.where(mx.arange(V) == 3, float("nan"), x)  # MLX's own op then
    want = mx.logsumexp(with_nan * (1.0 / 0.9), axis=-1, keepdims=True)
    assert mx.array_equal(tempered_logsumexp(with_nan, 0.9), want, equal_nan=True).item()
    half = x.astype(mx.float16)
    assert mx.array_equal(tempered_logsumexp(half, 0.9), mx.logsumexp(half * (1.0 / 0.9), axis=-1, keepdims=True)).item()


class _Generator:
    """Calls the batch sampler as mlx-lm's generator does (the sampler reads ``uids`` from its caller)."""

    def __init__(self, sampler, uids):
        self.sampler, self.uids = sampler, uids

    def step(self, logprobs):
        return self.sampler(logprobs)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_tempered_log_probs_read_the_rows_only_after_the_top_p_draw_did(top_p, monkeypatch):
    """T != 1 without a top-p draw: MLX's lazy logsumexp (reading the rows would wait for the forward
    pass); after the top-p draw read them, the NumPy sum. The log-probs are MLX's expression either way."""
    calls = []
    real = row_logsumexp.logsumexp_rows
    monkeypatch.setattr(row_logsumexp, "logsumexp_rows", lambda x: calls.append(1) or real(x))
    T, x = 0.7, lm_like(3, 21)
    s = BatchSampler(T, top_p=top_p)
    for u in range(3):
        s.add(u, stream=u)
    tokens = _Generator(s, [0, 1, 2]).step(x)
    got = [s.behaviour_logprob(u) for u in range(3)]
    want = (mx.take_along_axis(x, tokens[:, None], axis=-1) / T
            - mx.logsumexp(x * (1.0 / T), axis=-1, keepdims=True))[:, 0]
    assert got == want.tolist()
    assert bool(calls) == (top_p < 1.0 and row_logsumexp.exact_here())


def test_noise_self_check_covers_shifted_positions(monkeypatch):
    """exact_here compares columns gathered at other positions too: a stand-in whose value depends on
    the lane an element is computed in (equal to MLX on the whole row) is caught."""
    monkeypatch.setattr(keyed_noise, "_EXACT", {})
    assert keyed_noise.exact_here()
    real = keyed_noise.gumbel_at

    def lane_dependent(keys, cols, vocab_size):
        g = real(keys, cols, vocab_size)
        moved = mx.array((np.arange(len(cols)) % 8) != (np.asarray(cols) % 8))
        return mx.where(moved, g * (1 + 2.0**-20), g)

    monkeypatch.setattr(keyed_noise, "gumbel_at", lane_dependent)
    monkeypatch.setattr(keyed_noise, "_EXACT", {})
    assert not keyed_noise.exact_here()


def test_exp_self_check_covers_shifted_positions_and_falls_back(monkeypatch):
    """nucleus.exp_exact_here: an exp whose scalar tail rounds differently from its vector lanes
    (the whole row still MLX's) fails the check, and every row then takes the full sort."""
    x = np.array(lm_like(3, 31))
    monkeypatch.setattr(nucleus, "_EXP_EXACT", {})
    assert nucleus.exp_exact_here()
    thr, cols = nucleus.thresholds(x, 0.9)
    assert all(c is not None for c in cols)
    real = nucleus._mlx_exp

    def tail_differs(values):
        out = real(values)
        tail = len(out) - len(out) % 8
        out[tail:] = np.nextafter(out[tail:], np.float32(np.inf))
        return out

    monkeypatch.setattr(nucleus, "_mlx_exp", tail_differs)
    monkeypatch.setattr(nucleus, "_EXP_EXACT", {})
    assert not nucleus.exp_exact_here()
    monkeypatch.setattr(nucleus, "_mlx_exp", real)  # the fallback is mlx-lm's arithmetic
    thr_full, cols = nucleus.thresholds(x, 0.9)
    assert all(c is None for c in cols) and np.array_equal(thr_full, thr)
