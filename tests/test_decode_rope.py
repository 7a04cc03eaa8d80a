"""The compiled rope of decoding steps (mlx_ssp.decode_rope): MLX's own rope bit for bit, swapped
in for a generation pass and back out, and rollouts that draw the same tokens and log-probs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_ssp  # noqa: F401  (loads OpenBLAS before mlx)
from mlx_ssp import decode_rope
from mlx_ssp.rollout import SamplingConfig, decoder, generate_rollouts
from mlx_ssp.rollout.request import RolloutRequest
from mlx_ssp.tasks import Task


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a).view(np.uint32)


@pytest.mark.parametrize("config", [(64, False, 100000.0, 1.0), (16, False, 10000.0, 1.0),
                                    (32, True, 10000.0, 0.5), (8, False, 500000.0, 1.0)])
@pytest.mark.parametrize("rows,heads", [(4, 9), (3, 3), (1, 2)])
def test_compiled_rope_gives_mlx_rope_bits(config, rows, heads):
    dims, traditional, base, scale = config
    rng = np.random.default_rng(rows * 7 + heads)
    f = decode_rope.compiled_rope(config)
    for head_dim in {dims, dims + 8}:  # dims below the head size: the rest passes through
        x = mx.array(rng.normal(0, 3, (rows, heads, 1, head_dim)).astype(np.float32))
        for lo, hi in ((-40, 300), (4000, 9000), (60000, 200000)):
            offset = mx.array(rng.integers(lo, hi, rows).astype(np.int32))
            want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
            assert np.array_equal(_bits(f(x, offset)), _bits(want))
    assert decode_rope.exact_here(config)


def test_decode_rope_computes_only_decoding_steps_compiled():
    rope = nn.RoPE(16, base=10000.0)
    wrapped = decode_rope.DecodeRoPE(rope)
    x = mx.array(np.random.default_rng(0).normal(size=(2, 3, 5, 16)).astype(np.float32))
    # prefill (5 positions, integer offset) and a decoding step (array offset) both equal the original
    assert np.array_equal(_bits(wrapped(x, offset=7)), _bits(rope(x, offset=7)))
    step = x[:, :, :1]
    offset = mx.array([3, 11], dtype=mx.int32)
    assert np.array_equal(_bits(wrapped(step, offset=offset)), _bits(rope(step, offset=offset)))


def test_installed_swaps_every_rope_and_puts_the_originals_back(tiny_qwen3):
    from mlx_lm import load

    model, _ = load(str(tiny_qwen3))
    before = [layer.self_attn.rope for layer in model.layers]
    assert all(type(r) is nn.RoPE for r in before)
    with decode_rope.installed(model) as n:
        assert n == len(model.layers)
        assert all(isinstance(layer.self_attn.rope, decode_rope.DecodeRoPE) for layer in model.layers)
    assert all(layer.self_attn.rope is r for layer, r in zip(model.layers, before))


def test_installed_leaves_the_model_alone_where_it_is_not_exact(tiny_qwen3, monkeypatch):
    from mlx_lm import load

    model, _ = load(str(tiny_qwen3))
    monkeypatch.setattr(decode_rope, "exact_here", lambda config: False)
    with decode_rope.installed(model) as n:
        assert n == 0
        assert all(type(layer.self_attn.rope) is nn.RoPE for layer in model.layers)


def test_a_decoder_installs_the_rope_for_its_pass_only(tiny_qwen3):
    from mlx_lm import load

    model, tok = load(str(tiny_qwen3))
    task = Task(id="t0", domain="math", prompt="What is 1 + 2?", answer="3", verifier="exact")
    req = RolloutRequest(tasks=[task], k=2, sampling=SamplingConfig(max_tokens=4), progress=False)
    dec = decoder.Decoder(model, tok, req, total=2, unit="sample", desc="t")
    assert all(isinstance(layer.self_attn.rope, decode_rope.DecodeRoPE) for layer in model.layers)
    dec.close({})
    assert all(type(layer.self_attn.rope) is nn.RoPE for layer in model.layers)


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_rollouts_draw_the_same_tokens_and_logprobs_as_mlx_rope(request, fixture, monkeypatch):
    """Prompts of different lengths (left padding: negative offsets at first), rows finishing at
    different steps (the batch shrinks), a temperature that is not 1."""
    from mlx_lm import load

    model, tok = load(str(request.getfixturevalue(fixture)))
    tasks = [Task(id=f"t{i}", domain="math", prompt="What is " + " + ".join(["2"] * (i + 1)) + "?",
                  answer="2", verifier="exact") for i in range(3)]
    kw = dict(k=3, sampling=SamplingConfig(temperature=0.8, max_tokens=24), seed=11, batch_size=4, progress=False)
    compiled = generate_rollouts(model, tok, tasks, **kw)
    monkeypatch.setattr(decode_rope, "exact_here", lambda config: False)  # MLX's rope throughout
    plain = generate_rollouts(model, tok, tasks, **kw)
    assert [r["token_ids"] for r in compiled] == [r["token_ids"] for r in plain]
    assert [r["logprobs"] for r in compiled] == [r["logprobs"] for r in plain]
    assert len({len(r["token_ids"]) for r in plain}) > 1 or any(r["finish_reason"] == "length" for r in plain)
