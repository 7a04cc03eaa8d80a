"""Curriculum SFT stage 2 (VibeThinker-3B section 2.1.2): the hard-subset rule, and a
specialist trained in two stages on a tiny float32 Qwen3 with the fake probe of test_sft."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp.errors import UserError
from mlx_ssp.sft import curriculum as C
from test_sft import _run, base, fake_probe, make_cfg, write_probe  # noqa: F401  (base: the fixture)


def test_hard_subset_drops_short_then_unknown_then_easy():
    lengths = [10, 3, 10, 10, 10, 12]
    rates = [0.8, 1.0, None, 0.5, 0.75, 1.0]
    keep, dropped = C.hard_subset(lengths, rates, min_tokens=5, min_error_rate=0.75)
    assert keep == [0, 4, 5]  # 0.75 itself is hard: only rates *below* the threshold are easy
    assert dropped == {"short": 1, "no_reference": 1, "easy": 1}
    assert C.hard_subset(lengths, rates, min_tokens=0, min_error_rate=0.0)[0] == [0, 1, 3, 4, 5]


def test_records_meet_their_reference_rollouts():
    rolls = [{"prompt": "What is 1 + 1?", "reward": r} for r in (1.0, 0.0, 0.0, 0.5)] + \
            [{"prompt": [{"role": "user", "content": "Q2"}], "reward": 1.0}] + \
            [{"kind": "episode", "task_id": "e1", "reward": 0.0}]
    rates = C.error_rates(rolls)
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 1 + 1?"},
                         {"role": "assistant", "content": "2"}]}
    assert rates[C.record_key(chat)] == 0.75  # a partial reward counts as an error; the system message is ignored
    assert rates[C.record_key({"messages": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "x"}]})] == 0.0
    assert rates[C.record_key({"token_ids": [1, 2], "mask": [0, 1], "task_id": "e1"})] == 1.0
    assert C.record_key({"messages": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "2"}]}) not in rates
    assert C.stage2_iters(C.CurriculumConfig(), 5, 2) == 5 and C.stage2_iters(C.CurriculumConfig(iters=3), 5, 2) == 3


def _data(root: Path) -> tuple[Path, list[dict]]:
    """Short and long answers to easy and hard questions."""
    d = root / "data"
    d.mkdir(parents=True)
    recs = []
    for i in range(8):
        long = i % 2 == 0
        ans = ("step " * 12 + f"so {i}") if long else f"{i}"
        recs.append({"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": ans}]})
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:2]))
    return d, recs


def _reference(root: Path, hard: set[int]) -> Path:
    p = root / "rollouts.jsonl"
    rows = [{"prompt": f"Q{i}?", "reward": 0.0 if i in hard else 1.0, "sample": s} for i in range(8) for s in range(4)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _lora_b(ckpt: Path) -> np.ndarray:
    import mlx.core as mx

    w = mx.load(str(ckpt / "adapters.safetensors"))
    return np.concatenate([np.array(v).ravel() for k, v in sorted(w.items()) if k.endswith("lora_b")])


def test_two_stage_specialist_trains_on_the_hard_subset_from_stage_1(tmp_path, base):
    data, recs = _data(tmp_path)
    ref = _reference(tmp_path, hard={0, 1, 2, 5})  # hard and long: 0 and 2
    # stage 1 runs 4x longer than stage 2, so a stage 2 started from stage 1's adapter stays near it
    # (Adam moves each weight by about the learning rate per step, whatever the gradient's scale)
    cfg = make_cfg(tmp_path, data, write_probe(tmp_path), iters=8, save_every=4, learning_rate=2e-3,
                   curriculum={"min_tokens": 20, "min_error_rate": 0.75, "reference": str(ref), "iters": 2})
    summary = _run(cfg, base)
    ddir = tmp_path / "sft" / "math"
    subset = [json.loads(x) for x in (ddir / "stage2" / "train.jsonl").read_text().splitlines()]
    assert subset == [recs[0], recs[2]]
    res = json.loads((ddir / "result.json").read_text())
    cur = res["curriculum"]
    assert cur["kept"] == 2 and cur["dropped"] == {"short": 4, "no_reference": 0, "easy": 2}
    assert cur["iters"] == 2 and cur["from_checkpoint"] == "step_0000008"
    # the specialist is stage 2's pick, fused from a stage 2 checkpoint
    curve2 = [json.loads(x) for x in (ddir / "stage2" / "probe_curve.jsonl").read_text().splitlines()]
    chosen = [r for r in curve2 if r["chosen"]][0]
    assert summary["domains"]["math"]["chosen_step"] == chosen["step"] == res["chosen_step"]
    ck2 = ddir / "stage2" / "checkpoints" / f"step_{chosen['step']:07d}"
    assert (ddir / "adapters.safetensors").read_bytes() == (ck2 / "adapters.safetensors").read_bytes()
    # stage 2 continued from stage 1's last adapter, not from a fresh LoRA (whose B starts at zero)
    last1 = _lora_b(ddir / "checkpoints" / "step_0000008")
    first2 = _lora_b(ddir / "stage2" / "checkpoints" / "step_0000002")
    assert np.abs(last1).max() > 0 and np.linalg.norm(first2 - last1) < 0.5 * np.linalg.norm(last1)
    # a rerun finds the domain done
    mtime = (ddir / "adapters.safetensors").stat().st_mtime_ns
    _run(cfg, base)
    assert (ddir / "adapters.safetensors").stat().st_mtime_ns == mtime


def test_an_empty_hard_subset_keeps_stage_1(tmp_path, base):
    data, _ = _data(tmp_path)
    ref = _reference(tmp_path, hard=set())
    cfg = make_cfg(tmp_path, data, write_probe(tmp_path), iters=2, save_every=2,
                   curriculum={"min_tokens": 20, "reference": str(ref)})
    summary = _run(cfg, base)
    res = json.loads((tmp_path / "sft" / "math" / "result.json").read_text())
    assert "empty" in res["curriculum"]["skipped"] and res["curriculum"]["dropped"]["easy"] == 4
    assert summary["domains"]["math"]["chosen_step"] == 2
    with pytest.raises(UserError, match="curriculum.reference"):
        _run(make_cfg(tmp_path / "b", data, write_probe(tmp_path), iters=2, save_every=2, curriculum={}), base)


def test_adding_a_curriculum_to_a_finished_domain_runs_stage_2(tmp_path, base):
    data, recs = _data(tmp_path)
    ref = _reference(tmp_path, hard={0, 2})
    one = make_cfg(tmp_path, data, write_probe(tmp_path), iters=2, save_every=2)
    _run(one, base)
    ddir = tmp_path / "sft" / "math"
    assert "curriculum" not in json.loads((ddir / "result.json").read_text())
    two = make_cfg(tmp_path, data, write_probe(tmp_path), iters=2, save_every=2,
                   curriculum={"min_tokens": 20, "reference": str(ref), "iters": 1})
    _run(two, base)
    res = json.loads((ddir / "result.json").read_text())
    assert res["curriculum"]["kept"] == 2 and (ddir / "stage2" / "checkpoints").is_dir()
    _run(one, base)  # and removing it again: stage 1's pick is the specialist once more
    assert "curriculum" not in json.loads((ddir / "result.json").read_text())
