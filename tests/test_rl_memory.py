"""The RL memory model (mlx_ssp.rl.memory) and `mlx_ssp doctor CONFIG`'s predicted peak."""

from __future__ import annotations

import json

import pytest

from mlx_ssp.rl import memory

QWEN3_06B = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                 tie_word_embeddings=True, torch_dtype="bfloat16")
RL = {"batch_size": 2, "group_size": 4, "sampling": {"temperature": 1.0, "max_tokens": 256}, "micro_batch_size": 16,
      "lora": {"rank": 16, "num_layers": -1}}
# a fixed log-prob chunk, so that the pieces' rows follow micro_batch_size (with the automatic one a
# larger vocabulary means smaller pieces, and less activation memory: a real effect, not monotonic),
# and the pieces at micro_batch_size itself, not the automatic choice (tested on its own below)
RL_CHUNK = {**RL, "chunk_size": 4096, "auto_micro_batch": False}

# Measured by scripts/bench_rl_memory.py (BENCHMARKS.md, "RL step memory"; float32, Linux CPU,
# 2026-12-01 21:11 UTC, the trainer's block layout): the held-out grid point of another shape than
# the rest (hidden 512, 4 layers); its model config, rl: section, prompt length and MLX peaks in MiB.
MEASURED = {
    "config": {"model_type": "qwen3", "hidden_size": 512, "num_hidden_layers": 4, "intermediate_size": 1536,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 16384,
               "tie_word_embeddings": True},
    "rl": {"batch_size": 1, "group_size": 2, "sampling": {"temperature": 1.0, "max_tokens": 4}, "micro_batch_size": 1,
           "lora": {"rank": 8, "num_layers": -1}, "optimizer": "adamw",
           "gen_fold_lora": False},  # measured before generation folded the adapters
    "prompt_tokens": 128, "peak_gen_mb": 91.7, "peak_train_mb": 115.6,
}


def test_folded_generation_adds_the_adapted_weights_once():
    """gen_fold_lora: generation holds a folded copy of every adapted linear layer; the update does not."""
    rl = {**MEASURED["rl"], "auto_micro_batch": False}
    on, off = (memory.predict(MEASURED["config"], {**rl, "gen_fold_lora": f}, prompt_tokens=128) for f in (True, False))
    c = MEASURED["config"]
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    linears = h * 8 * d + 2 * h * 4 * d + 8 * d * h + 3 * h * i  # q, k, v, o, gate, up, down
    assert on.gen_bytes - off.gen_bytes == pytest.approx(4 * c["num_hidden_layers"] * linears)
    assert on.train_bytes == off.train_bytes
    keys = {**rl, "lora": {"rank": 8, "num_layers": 2, "keys": ["self_attn.q_proj"]}}
    one, none = (memory.predict(c, {**keys, "gen_fold_lora": f}, prompt_tokens=128) for f in (True, False))
    assert one.gen_bytes - none.gen_bytes == pytest.approx(4 * 2 * h * 8 * d)
    # bf16 layers are not folded (the fold would round the update away): no copy
    bf16 = [memory.predict(c, {**rl, "gen_fold_lora": f}, prompt_tokens=128, dtype="bfloat16") for f in (True, False)]
    assert bf16[0].gen_bytes == bf16[1].gen_bytes


def _with(base: dict, path: str, value) -> dict:
    out = json.loads(json.dumps(base))
    *head, last = path.split(".")
    node = out
    for k in head:
        node = node[k]
    node[last] = value
    return out


def _peaks(config=QWEN3_06B, rl=RL, prompt_tokens=128, dtype="float32"):
    e = memory.predict(config, rl, prompt_tokens=prompt_tokens, dtype=dtype)
    return e.gen_bytes, e.train_bytes


def test_param_and_lora_counts_match_mlx_lm():
    """The pure counts against an mlx-lm qwen3 model instance with LoRA attached as the loop does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen3 import Model, ModelArgs

    from mlx_ssp.rl.config import RLConfig
    from mlx_ssp.rl.policy import setup_model

    cfg = dict(QWEN3_06B, hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=300, rms_norm_eps=1e-6, rope_theta=1e4,
               max_position_embeddings=512)
    model = Model(ModelArgs.from_dict(cfg))
    shape = memory.shape_from_config(cfg)
    assert sum(v.size for _, v in tree_flatten(model.parameters())) == shape.params
    setup_model(model, RLConfig.model_validate({"lora": {"rank": 4, "num_layers": 2}}), 0)
    mx.eval(model.parameters())
    assert sum(v.size for _, v in tree_flatten(model.trainable_parameters())) == memory.lora_params(shape, 4, 2)


@pytest.mark.parametrize("path,small,large,phase", [
    ("rl.batch_size", 1, 4, "gen"), ("rl.group_size", 2, 8, "gen"), ("rl.sampling.max_tokens", 64, 512, "both"),
    ("prompt_tokens", 64, 1024, "both"), ("rl.lora.rank", 8, 128, "both"), ("rl.lora.num_layers", 2, 28, "both"),
    ("rl.micro_batch_size", 1, 8, "train"), ("config.vocab_size", 32000, 151936, "both"),
    ("config.hidden_size", 512, 2048, "both"), ("config.num_hidden_layers", 8, 36, "both"),
])
def test_each_size_term_grows_the_peak(path, small, large, phase):
    """Monotonic: a larger size never predicts less, and grows the phase that holds its term."""
    def peaks(v):
        where, _, key = path.partition(".")
        if where == "prompt_tokens":
            return _peaks(rl=RL_CHUNK, prompt_tokens=v)
        if where == "config":
            return _peaks(config=dict(QWEN3_06B, **{key: v}), rl=RL_CHUNK)
        return _peaks(rl=_with(RL_CHUNK, key, v))

    lo, hi = peaks(small), peaks(large)
    assert hi[0] >= lo[0] and hi[1] >= lo[1]
    grows = {"gen": [0], "train": [1], "both": [0, 1]}[phase]
    assert all(hi[i] > lo[i] for i in grows), (lo, hi)


def test_bf16_halves_the_weight_term_only():
    f32 = memory.predict(QWEN3_06B, RL, prompt_tokens=128, dtype="float32")
    b16 = memory.predict(QWEN3_06B, RL, prompt_tokens=128, dtype="bfloat16")
    assert b16.weights == f32.weights / 2 == memory.shape_from_config(QWEN3_06B).params * 2
    # LoRA arrays and the float32 log-prob chunk do not change with the base dtype
    lora_state = memory.fixed_bytes(QWEN3_06B, RL, phase="train", dtype="float32") - f32.weights
    assert memory.fixed_bytes(QWEN3_06B, RL, phase="train", dtype="bfloat16") - b16.weights == lora_state
    assert b16.train_terms["logprob_chunk"] == f32.train_terms["logprob_chunk"]
    assert b16.gen_terms["kv_cache"] == pytest.approx(f32.gen_terms["kv_cache"] / 2)
    assert b16.peak_bytes < f32.peak_bytes


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_elsewhere():
    assert memory.predict(QWEN3_06B, RL, device="cpu").dtype == "float32"
    assert memory.predict(QWEN3_06B, RL, device="gpu").dtype == "bfloat16"
    assert memory.predict(QWEN3_06B, _with(RL, "train_dtype", "float16"), device="cpu").dtype == "float16"


def test_reproduces_a_measured_point_within_the_stated_error():
    e = memory.predict(MEASURED["config"], MEASURED["rl"], prompt_tokens=MEASURED["prompt_tokens"], dtype="float32")
    assert abs(e.gen_bytes / 2**20 / MEASURED["peak_gen_mb"] - 1) <= memory.HELD_OUT_ERROR
    assert abs(e.train_bytes / 2**20 / MEASURED["peak_train_mb"] - 1) <= memory.HELD_OUT_ERROR


def test_refuses_configs_it_does_not_cover():
    with pytest.raises(ValueError, match="dense"):
        memory.shape_from_config(dict(QWEN3_06B, num_experts=8))
    with pytest.raises(ValueError, match="hidden_size"):
        memory.shape_from_config({"vocab_size": 10})


def _run_file(tmp_path, model, rl: dict) -> str:
    p = tmp_path / "run.yaml"
    p.write_text(json.dumps({"model": str(model), "rl": rl}))
    return str(p)


def test_doctor_prints_the_predicted_peak_and_warns_over_the_machine(tmp_path, tiny_qwen3, monkeypatch):
    from click.testing import CliRunner

    from mlx_ssp import doctor
    from mlx_ssp.cli import main

    monkeypatch.setattr(doctor, "matmul_gflops", lambda *a, **k: 1.0)  # the timing is test_cli's
    run = _run_file(tmp_path, tiny_qwen3, RL)
    r = CliRunner().invoke(main, ["doctor", run, "--prompt-tokens", "100"])
    assert r.exit_code == 0, r.output
    assert "rl memory (predicted)" in r.output and "100-token" in r.output
    cfg = json.loads((tiny_qwen3 / "config.json").read_text())
    want = memory.predict(cfg, RL, prompt_tokens=100, device="cpu").peak_bytes / 2**30
    assert f"{want:.1f} GiB peak" in r.output
    assert "more than this machine" not in r.output
    # a machine smaller than the prediction gets the warning, naming the keys to lower
    rows, advice = doctor.rl_memory(run, prompt_tokens=100, device="cpu", total_bytes=1 << 20)
    assert len(advice) == 1 and "rl.micro_batch_size" in advice[0]


def test_doctor_takes_the_largest_phase(tmp_path, tiny_qwen3):
    from mlx_ssp import doctor

    rl = dict(RL, phases=[{"name": "short"}, {"name": "long", "sampling": {"max_tokens": 2048}}])
    rows, _ = doctor.rl_memory(_run_file(tmp_path, tiny_qwen3, rl), device="cpu")
    assert "rl.phases.long" in rows[0][1]


def test_shared_prefixes_and_pieces_in_the_update_term():
    """The update holds one piece's suffixes (or the prefix's backward), not micro-batch x sequence:
    sharing lowers the predicted activations; a sliding-window model or LoRA dropout does not share."""
    rl = _with(RL_CHUNK, "sampling.max_tokens", 64)
    shared = memory.predict(QWEN3_06B, rl, prompt_tokens=1024, dtype="float32").train_terms["activations"]
    unshared = memory.predict(QWEN3_06B, _with(rl, "share_prefix", False), prompt_tokens=1024,
                              dtype="float32").train_terms["activations"]
    assert shared < unshared / 2
    window = memory.predict(dict(QWEN3_06B, sliding_window=512), rl, prompt_tokens=1024, dtype="float32")
    dropout = memory.predict(QWEN3_06B, _with(rl, "lora.dropout", 0.1), prompt_tokens=1024, dtype="float32")
    assert window.train_terms["activations"] == dropout.train_terms["activations"] == unshared


# SmolLM2-135M (the demo model): the shape where a group of 256-token completions in one piece
# more than doubles the step's peak (BENCHMARKS.md, "RL step at the demo model's real shape")
SMOLLM2 = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
               tie_word_embeddings=True, torch_dtype="bfloat16")


def test_auto_micro_batch_keeps_the_step_at_its_floor():
    """The automatic rows per piece (the default) never raise the step's peak above its floor, the
    larger of generation and a one-row update; they take more rows where generation's peak leaves room."""
    rl = {"batch_size": 1, "group_size": 4, "sampling": {"max_tokens": 256}}
    fixed = memory.predict(SMOLLM2, {**rl, "auto_micro_batch": False}, prompt_tokens=64, dtype="float32")
    one = memory.predict(SMOLLM2, {**rl, "micro_batch_size": 1}, prompt_tokens=64, dtype="float32")
    auto = memory.predict(SMOLLM2, rl, prompt_tokens=64, dtype="float32")
    assert memory.auto_micro_batch(SMOLLM2, rl, prompt_tokens=64, dtype="float32") == 1
    assert auto.peak_bytes == max(one.gen_bytes, one.train_bytes) < fixed.peak_bytes / 2
    # 16 prompts of 8 decoded together: generation's KV cache leaves room for larger pieces
    big = {"batch_size": 16, "group_size": 8, "gen_batch_size": 128, "sampling": {"max_tokens": 256}}
    rows = memory.auto_micro_batch(SMOLLM2, big, prompt_tokens=64, dtype="float32")
    est = memory.predict(SMOLLM2, big, prompt_tokens=64, dtype="float32")
    assert 1 < rows <= 16 and est.train_bytes <= est.gen_bytes
    assert memory.auto_micro_batch(SMOLLM2, {**big, "micro_batch_size": 2}, prompt_tokens=64, dtype="float32") == 2


def test_auto_micro_batch_leaves_earlier_runs_resolved_config_alone():
    """Unset, the new key is not in the resolved config (the pipeline's and the resume's
    fingerprints), and micro_batch_size still reads 16: runs made before it keep their fingerprints."""
    from mlx_ssp.rl.config import RLConfig

    from mlx_ssp.rl.trainer import config_record, fingerprint

    dump = RLConfig().model_dump(mode="json")
    assert "auto_micro_batch" not in dump and dump["micro_batch_size"] == 16
    # the resume's and the finished phases' fingerprint: the same keys as before the new one
    fp = fingerprint(config_record(RLConfig(), 0, ""))
    assert fp["rl.micro_batch_size"] == 16 and "rl.auto_micro_batch" not in fp
    assert fingerprint(config_record(RLConfig(auto_micro_batch=False), 0, "")) == fp
    assert RLConfig(auto_micro_batch=False).model_dump(mode="json")["auto_micro_batch"] is False
