"""mlx-lm's SFT data formats in `mlx_ssp sft`: completions ``{"prompt", "completion"}``, chat
``{"messages"}`` and ``{"text"}``, read through mlx-lm's own dataset classes, and TRL's conversational
prompt-completion (lists of messages), read as the chat it joins into. With ``mask_prompt``
the loss covers exactly the answer tokens (mlx-lm's ``default_loss`` mask over the stage's batches),
and one training step on a completions file moves the LoRA weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import iterate_batches

from mlx_ssp.models import load_model
from mlx_ssp.sft import SFTConfig, run_sft
from mlx_ssp.sft.data import load_sft_file

END = "<|im_end|>\n"  # what the tiny models' ChatML template writes after each message

COMPLETIONS = [{"prompt": f"What is {a} + {b}?", "completion": f"It is {a + b}."} for a in range(1, 5) for b in (2, 7)]
CHAT = [{"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": f"What is {a} + 1?"},
                      {"role": "assistant", "content": "Let me see."},
                      {"role": "user", "content": "Go on."},
                      {"role": "assistant", "content": f"So {a + 1}."}]} for a in range(4)]
TEXT = [{"text": f"{a} plus {a} makes {2 * a}."} for a in range(4)]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def base(tiny_qwen3):
    model, tok, path = load_model(str(tiny_qwen3))
    return model, tok, Path(path)


def _targets(ds, tokenizer, i: int) -> tuple[str, int]:
    """The text of the tokens mlx-lm's default_loss trains on for record i (a batch of one from its
    iterate_batches; the mask is `offset <= step <= length`, minus the first pad position it adds)."""
    batch, lengths = next(iterate_batches(_One(ds, i), 1, 4096))
    tokens = np.array(batch[0])
    steps = np.arange(1, tokens.shape[0])
    off, length = np.array(lengths[0])
    mask = (steps >= off) & (steps <= length) & (steps < length)
    return tokenizer.decode(tokens[1:][mask].tolist()), int(mask.sum())


class _One:  # one record of a dataset, as iterate_batches takes it
    def __init__(self, ds, i):
        self.ds, self.i = ds, i

    def __len__(self):
        return 1

    def __getitem__(self, _):
        return self.ds[self.i]

    def itemlen(self, _):
        return len(self.ds[self.i][0])


def test_mask_covers_exactly_the_completion(tmp_path, base):
    _, tok, _ = base
    ds, stats = load_sft_file(_write(tmp_path / "c.jsonl", COMPLETIONS), tok, mask_prompt=True, max_seq_length=512)
    assert stats["format"] == "completions" and stats["records"] == len(COMPLETIONS)
    for i, rec in enumerate(COMPLETIONS):
        text, n = _targets(ds, tok, i)
        assert text == rec["completion"] + END  # the answer and the template's end of turn, nothing of the prompt
        assert n == len(tok.encode(rec["completion"] + END, add_special_tokens=False))
    # without mask_prompt the same records train on every token after the first
    full, _ = load_sft_file(tmp_path / "c.jsonl", tok, mask_prompt=False, max_seq_length=512)
    text, n = _targets(full, tok, 0)
    assert COMPLETIONS[0]["prompt"] in text and text.endswith(COMPLETIONS[0]["completion"] + END)
    assert n == len(full[0][0]) - 1


def test_chat_mask_covers_the_last_assistant_turn_and_text_trains_on_all(tmp_path, base):
    _, tok, _ = base
    ds, stats = load_sft_file(_write(tmp_path / "chat.jsonl", CHAT), tok, mask_prompt=True, max_seq_length=512)
    assert stats["format"] == "chat"
    for i, rec in enumerate(CHAT):
        text, _ = _targets(ds, tok, i)
        assert text == rec["messages"][-1]["content"] + END  # earlier assistant turns are context, as in mlx-lm
    ds, stats = load_sft_file(_write(tmp_path / "text.jsonl", TEXT), tok, mask_prompt=False, max_seq_length=512)
    assert stats["format"] == "text"
    text, n = _targets(ds, tok, 1)
    assert text.startswith(TEXT[1]["text"][1:]) and n == len(ds[1][0]) - 1


def test_trl_conversational_prompt_completion_trains_as_chat(tmp_path, base):
    """TRL's conversational prompt-completion records join into one chat; the mask covers the
    completion's assistant message exactly; they mix with chat records in one file."""
    from mlx_ssp.errors import UserError

    _, tok, _ = base
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {a} + 2?"}],
             "completion": [{"role": "assistant", "content": f"It is {a + 2}."}]} for a in range(3)]
    ds, stats = load_sft_file(_write(tmp_path / "conv.jsonl", rows + CHAT[:1]), tok, mask_prompt=True, max_seq_length=512)
    assert stats["format"] == "chat" and stats["records"] == 4
    for i, rec in enumerate(rows):
        text, _ = _targets(ds, tok, i)
        assert text == rec["completion"][0]["content"] + END
    assert _targets(ds, tok, 3)[0] == CHAT[0]["messages"][-1]["content"] + END
    two = [{**rows[0], "completion": rows[0]["completion"] * 2}]
    with pytest.raises(UserError, match=r"conv2.jsonl:1: a conversational 'completion' must be a list of one assistant"):
        load_sft_file(_write(tmp_path / "conv2.jsonl", two), tok, mask_prompt=True, max_seq_length=512)
    mixed = rows[:1] + COMPLETIONS[:1]
    with pytest.raises(UserError, match=r"mixed.jsonl:2: a 'completions' record in a 'chat' file"):
        load_sft_file(_write(tmp_path / "mixed.jsonl", mixed), tok, mask_prompt=True, max_seq_length=512)


@pytest.mark.parametrize("prompt, error", [
    ([], "a conversational 'prompt' must be a non-empty list of messages"),
    ([{"content": "no role"}], "'prompt' message 0 needs 'role' and 'content'"),
    ([{"role": "user", "content": "hi"}, "hello"], "'prompt' message 1 needs 'role' and 'content'"),
])
def test_a_bad_conversational_prompt_names_the_prompt(tmp_path, base, prompt, error):
    """The record has no 'messages' key: the error names 'prompt', the key the user wrote."""
    from mlx_ssp.errors import UserError

    _, tok, _ = base
    good = {"prompt": [{"role": "user", "content": "What is 1 + 2?"}], "completion": [{"role": "assistant", "content": "3"}]}
    bad = {**good, "prompt": prompt}
    with pytest.raises(UserError, match=f"bad.jsonl:2: {error}") as e:
        load_sft_file(_write(tmp_path / "bad.jsonl", [good, bad]), tok, mask_prompt=True, max_seq_length=512)
    assert "'messages'" not in str(e.value)
    no_content = {**good, "completion": [{"role": "assistant"}]}
    with pytest.raises(UserError, match="nc.jsonl:1: 'completion' message 0 needs 'role' and 'content'"):
        load_sft_file(_write(tmp_path / "nc.jsonl", [no_content]), tok, mask_prompt=True, max_seq_length=512)


def _lora_b(adapter_dir: Path) -> np.ndarray:
    w = mx.load(str(adapter_dir / "adapters.safetensors"))
    return np.concatenate([np.array(v).ravel() for k, v in sorted(w.items()) if k.endswith("lora_b")])


def _no_probe(model, tokenizer, tasks, probe, seed):
    return {"pass@1": 0.0, "pass@k": 0.0}


@pytest.mark.parametrize("rows", [COMPLETIONS, TEXT], ids=["completions", "text"])
def test_one_step_on_the_file_moves_the_lora_weights(tmp_path, base, rows):
    data = _write(tmp_path / "train.jsonl", rows)
    probe = _write(tmp_path / "probe.jsonl", [{"id": "p0", "domain": "d", "prompt": "What is 1 + 2?",
                                               "answer": "3", "verifier": "exact"}])
    cfg = SFTConfig(domains={"d": {"data": str(data), "probe_tasks": str(probe)}}, out_dir=str(tmp_path / "sft"),
                    lora={"rank": 2, "num_layers": -1, "scale": 10.0}, learning_rate=5e-3, iters=1, batch_size=2,
                    max_seq_length=64, save_every=1, report_every=1, val_batches=0,
                    mask_prompt=rows is COMPLETIONS, probe={"k": 1, "progress": False}, seed=0)
    run_sft(cfg, None, model_and_tokenizer=base, probe_fn=_no_probe)
    ck = tmp_path / "sft" / "d" / "checkpoints" / f"step_{1:07d}"
    b = _lora_b(ck)
    assert b.size > 0 and np.all(np.isfinite(b)) and np.abs(b).max() > 0  # lora_b starts at zero
    (m,) = [json.loads(line) for line in (tmp_path / "sft" / "d" / "metrics.jsonl").read_text().splitlines()]
    assert m["step"] == 1 and np.isfinite(m["train_loss"])
    assert not any("lora_" in k for k, _ in tree_flatten(base[0].parameters()))  # the base model is restored
