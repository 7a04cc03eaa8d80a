"""Multi-turn SFT on token records (whole episodes with a target mask): the loader's checks and
counts, the masked batches (which target positions carry weight), the masked loss against mlx-lm's
default_loss, and a gold episode training through the SFT stage (mlx-lm's train loop) on a tiny model."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_ssp.errors import UserError
from mlx_ssp.models import load_model
from mlx_ssp.sft import SFTConfig, load_sft_file, run_sft
from mlx_ssp.sft.batches import make_masked_iterate_batches, masked_batch
from mlx_ssp.sft.loss import masked_loss
from mlx_ssp.tasks.build import export_source


@pytest.fixture(scope="module")
def base(tiny_qwen3):
    model, tok, path = load_model(str(tiny_qwen3))
    return model, tok, Path(path)


@pytest.fixture(scope="module")
def gold(base):
    """Token records of gold episodes: 3 turns, each with tool calls and tool results (tools left
    out of the prompt: their schemas would be ~10k tokens of a tiny tokenizer's BPE)."""
    from mlx_ssp.agents.episode import replay
    from mlx_ssp.agents.gold import gold_messages

    _, tok, _ = base
    ts = [t for t in export_source("bfcl_multi_turn:base")
          if len(t.metadata["episode"]["ground_truth"]) == 3 and all(t.metadata["episode"]["ground_truth"])][:2]
    recs = []
    for t in ts:
        t.metadata["tools"] = []
        msgs = gold_messages(t)
        prompt, ids, mask = replay(tok, t, msgs)
        recs.append({"token_ids": prompt + ids, "mask": [0] * len(prompt) + mask, "messages": msgs,
                     "source": "gold", "task_id": t.id})
    return recs


def write_jsonl(path: Path, recs: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


def test_mask_covers_exactly_the_assistant_tokens_through_loader_and_batches(tmp_path, base, gold):
    """End to end through the loader and the batches: the targets that carry weight are exactly the
    record's mask-1 tokens (each assistant message's text + tool calls + end token), at the right
    positions, and nothing of the system prompt, user turns, tool results or padding."""
    from mlx_ssp.agents.episode import Deltas, assistant_text

    _, tok, _ = base
    rec = gold[0]
    msgs = rec["messages"]
    assert sum(m["role"] == "tool" for m in msgs) >= 3 and sum(m["role"] == "user" for m in msgs) == 3
    short = {"token_ids": rec["token_ids"][:300], "mask": [0] * 299 + [1]}  # a shorter record: padding in its row
    ds, stats = load_sft_file(write_jsonl(tmp_path / "t.jsonl", [rec, short]), tok, mask_prompt=True, max_seq_length=4096)
    assert stats["format"] == "tokens" and stats["records"] == 2 and stats["truncated"] == stats["dropped"] == 0
    assert stats["sources"] == {"gold": 1, "unknown": 1}
    it = make_masked_iterate_batches(seed=0)(ds, batch_size=2, max_seq_length=4096)
    tokens, weights = next(it)
    tokens, weights = np.array(tokens), np.array(weights)
    L = len(rec["token_ids"])
    assert tokens.shape == (2, 1 + 32 * -(-L // 32)) and weights.shape == (2, tokens.shape[1] - 1)
    rows = {len(r["token_ids"]): r for r in (rec, short)}
    for b in range(2):
        r = rows[L] if tokens[b, 300:].any() else rows[300]
        n = len(r["token_ids"])
        assert tokens[b, :n].tolist() == r["token_ids"] and not tokens[b, n:].any()  # right-padded with 0
        # target position t predicts token t+1: weighted exactly where the record's mask is 1
        weighted = {t + 1 for t in np.flatnonzero(weights[b])}
        assert weighted == {i for i, m in enumerate(r["mask"]) if m and i > 0}
    # the weighted runs, decoded, are the assistant messages, each with its end-of-message token
    b = 0 if tokens[0, 300:].any() else 1
    pos = np.flatnonzero(weights[b]) + 1
    runs = np.split(tokens[b, pos], np.flatnonzero(np.diff(pos) > 1) + 1)
    end_id, _ = Deltas(tok).end_of_message()
    want = [list(tok.encode(assistant_text(m), add_special_tokens=False)) + [end_id] for m in msgs if m["role"] == "assistant"]
    assert [r.tolist() for r in runs] == want and len(want) >= 6  # 3 turns x (calls, closing message)
    unweighted = tok.decode(tokens[b, 1:][~weights[b]].tolist())
    assert all(m["content"] in unweighted for m in msgs if m["role"] in ("system", "user", "tool"))


def test_masked_loss_equals_mlx_lm_default_loss_on_a_single_span(base):
    """A completions record (tokenized by mlx-lm: tokens + prompt offset) as a token record with
    mask 0 on the prompt, 1 on the answer: the masked loss equals mlx-lm's default_loss on mlx-lm's
    own batch, loss and token count."""
    from types import SimpleNamespace

    from mlx_lm.tuner.datasets import CacheDataset, create_dataset
    from mlx_lm.tuner.trainer import default_loss, iterate_batches

    model, tok, _ = base
    data = [{"prompt": "What is 12 + 30? Think it through.", "completion": "12 + 30 = 42, so the answer is 42."}] * 2
    ds = CacheDataset(create_dataset(data, tok, SimpleNamespace(mask_prompt=True)))
    ids, offset = ds[0]
    L = len(ids)
    assert 0 < offset < L
    item = (list(ids), [0] * offset + [1] * (L - offset))
    # batch width = the record's length: mlx-lm's mask then ends at the record's last token
    ref_batch = next(iterate_batches(ds, 2, L))
    want, want_n = default_loss(model, *ref_batch)
    got, got_n = masked_loss(model, *masked_batch([item, item], L))
    assert int(got_n) == int(want_n) == 2 * (L - offset)
    assert abs(float(got) - float(want)) < 1e-6
    # with room for padding, mlx-lm's mask also takes the first pad position after the record
    # (target token 0 after the end); ours stops at the record's last token
    _, wide_n = default_loss(model, *next(iterate_batches(ds, 2, 2048)))
    _, ours_n = masked_loss(model, *masked_batch([item, item], 2048))
    assert int(wide_n) == int(ours_n) + 2 and int(ours_n) == int(got_n)


def test_truncation_and_drop_counts(tmp_path, base):
    _, tok, _ = base
    recs = [
        {"token_ids": list(range(1, 11)), "mask": [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]},  # cut at 6: loses 3 targets
        {"token_ids": list(range(1, 11)), "mask": [0] * 7 + [1, 1, 1]},  # every target past the cut: dropped
        {"token_ids": list(range(1, 5)), "mask": [0, 1, 1, 1], "source": "sampled"},  # fits
    ]
    path = write_jsonl(tmp_path / "t.jsonl", recs)
    with pytest.warns(UserWarning) as w:
        ds, stats = load_sft_file(path, tok, mask_prompt=True, max_seq_length=6)
    assert len(w) == 1
    msg = str(w[0].message)
    assert "2 record(s) longer than max_seq_length=6 truncated" in msg and "6 target token(s) lost" in msg
    assert "1 record(s) dropped" in msg and "line 1" in msg
    assert stats["records"] == len(ds) == 2 and stats["truncated"] == 2 and stats["dropped"] == 1
    assert stats["target_tokens_lost"] == 6 and stats["target_tokens"] == 2 + 3 and stats["tokens"] == 6 + 4
    assert ds[0] == (list(range(1, 7)), [0, 0, 0, 1, 1, 0])
    with warnings.catch_warnings():  # nothing cut: no warning
        warnings.simplefilter("error")
        load_sft_file(path, tok, mask_prompt=True, max_seq_length=10)
    with pytest.raises(UserError, match="every record's targets lie past max_seq_length=3"):
        load_sft_file(write_jsonl(tmp_path / "u.jsonl", recs[1:2]), tok, mask_prompt=True, max_seq_length=3)


@pytest.mark.parametrize("line,needle", [
    ({"token_ids": [1, 2, 3], "mask": [0, 1]}, "'token_ids' has 3 entries but 'mask' has 2"),
    ({"token_ids": [1, 2, 3], "mask": [0, 2, 1]}, r"mask\[1\] = 2"),
    ({"token_ids": [1, 2.5, 3], "mask": [0, 1, 1]}, r"token_ids\[1\] = 2.5"),
    ({"token_ids": [1, True, 3], "mask": [0, 1, 1]}, r"token_ids\[1\] = True"),
    ({"token_ids": [1, 10 ** 9, 3], "mask": [0, 1, 1]}, "below the vocabulary size"),
    ({"token_ids": [1, 2, 3], "mask": [1, 0, 0]}, "no 1 after the first token"),
    ({"token_ids": [], "mask": []}, "non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "a 'chat' record in a 'tokens' file"),
])
def test_a_bad_record_names_file_and_line(tmp_path, base, line, needle):
    _, tok, _ = base
    good = {"token_ids": [1, 2, 3], "mask": [0, 1, 1]}
    path = write_jsonl(tmp_path / "t.jsonl", [good, "", line])  # line 2 blank: numbering is the file's
    with pytest.raises(UserError, match=needle) as e:
        load_sft_file(path, tok, mask_prompt=True, max_seq_length=64)
    assert f"{path}:3:" in str(e.value)


def test_a_gold_episode_trains_through_the_sft_stage(tmp_path, base, gold):
    """The SFT stage on token records: mlx-lm's train loop with the masked batches and loss; the
    loss on the gold episodes falls, the base model is the base again, the specialist is fused."""
    from mlx_ssp.sft.data import plan_domains
    from mlx_ssp.sft.stage import batching

    model, tok, _ = base
    data = write_jsonl(tmp_path / "train.jsonl", gold)
    probe = write_jsonl(tmp_path / "probe.jsonl", [{"id": "p0", "domain": "fs", "prompt": "hi", "answer": "x",
                                                      "verifier": "exact"}])
    cfg = SFTConfig(domains={"fs": {"data": str(data), "probe_tasks": str(probe)}}, out_dir=str(tmp_path / "sft"),
                    lora={"rank": 8, "num_layers": -1, "scale": 10.0}, learning_rate=1e-2, iters=12, batch_size=1,
                    max_seq_length=2048, save_every=12, report_every=3, val_batches=0, seed=1,
                    probe={"k": 1, "sampling": {"temperature": 0.0, "max_tokens": 1}, "progress": False})
    (plan,) = plan_domains(cfg, model, tok, {}, tmp_path)
    kw = batching(cfg, plan, 1)
    assert plan.stats["format"] == "tokens"
    t, w, index = next(kw["iterate_batches"](plan.train_set, 1, 2048))  # the target index, by default
    want = masked_loss(model, t, w, kind="logits")
    assert abs(float(kw["loss"](model, t, w, index)[0]) - float(want[0])) < 1e-5  # the chunked loss, by default
    losses = []

    class Spy:
        def on_train_loss_report(self, info):
            losses.append(info["train_loss"])

    summary = run_sft(cfg, None, model_and_tokenizer=base, callbacks=[Spy()],
                      probe_fn=lambda *a: {"pass@1": 0.0, "pass@k": 0.0})
    # measured: 6.64, 6.30, 5.74, 5.58 (each the mean of 3 steps)
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses
    assert Path(summary["domains"]["fs"]["specialist"], "config.json").is_file()
    res = json.loads((tmp_path / "sft" / "fs" / "result.json").read_text())
    assert res["data"]["format"] == "tokens" and res["data"]["target_tokens"] == sum(sum(r["mask"][1:]) for r in gold)


def _synthetic(n: int, seed: int) -> list[dict]:
    """Short token records of varied length, two target spans each (like two assistant turns)."""
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        L = int(rng.randint(12, 70))
        ids = rng.randint(1, 200, size=L).tolist()
        a, b = sorted(rng.choice(np.arange(2, L - 1), 2, replace=False).tolist())
        mask = [int(a <= j < a + 3 or b <= j < L) for j in range(L)]
        out.append({"token_ids": ids, "mask": mask, "source": "sampled", "task_id": f"t{i}"})
    return out


def test_batches_bucket_by_length_seeded_resumable_and_split_across_ranks(tmp_path, base):
    from types import SimpleNamespace

    _, tok, _ = base
    ds, _ = load_sft_file(write_jsonl(tmp_path / "t.jsonl", _synthetic(11, 0)), tok, mask_prompt=True, max_seq_length=64)
    lens = sorted(ds.itemlen(i) for i in range(len(ds)))

    def rows(batch):  # the record lengths in a batch (records are right-padded with 0; ids are >= 1)
        return sorted(int((np.array(batch[0])[b] != 0).sum()) for b in range(batch[0].shape[0]))

    def take(it, n):
        return [rows(next(it)) for _ in range(n)]

    it = make_masked_iterate_batches(seed=4)
    first = take(it(ds, 3, 64, loop=True), 9)
    # bucketing: the 3 batches of a pass are consecutive runs of the length order (the 11th record left out)
    assert sorted(first[:3]) == [lens[0:3], lens[3:6], lens[6:9]] and sorted(first[3:6]) == sorted(first[:3])
    assert first == take(make_masked_iterate_batches(seed=4)(ds, 3, 64, loop=True), 9)  # seeded
    assert first[4:] == take(make_masked_iterate_batches(seed=4, skip=4)(ds, 3, 64, loop=True), 5)  # resume
    assert first != take(make_masked_iterate_batches(seed=5)(ds, 3, 64, loop=True), 9)
    val = [rows(b) for b in it(ds, 3, 64)]  # validation: one pass, its own stream, skip not applied
    assert sorted(val) == sorted(first[:3]) and len(val) == 3
    # ranks: rank r of 2 takes every 2nd record of each batch of 4; together they make the batch
    halves = [take(it(ds, 4, 64, loop=True, comm_group=SimpleNamespace(rank=lambda r=r: r, size=lambda: 2)), 2)
              for r in (0, 1)]
    whole = take(it(ds, 4, 64, loop=True), 2)
    assert [sorted(a + b) for a, b in zip(*halves)] == whole


def test_token_data_resumes_to_the_same_adapter_with_masked_val_loss(tmp_path, base):
    """Kill mid-run, resume: the same adapters and losses (train and masked validation) as one run."""
    data = tmp_path / "d"
    data.mkdir()
    write_jsonl(data / "train.jsonl", _synthetic(8, 1))
    write_jsonl(data / "valid.jsonl", _synthetic(4, 2))
    probe = write_jsonl(tmp_path / "probe.jsonl", [{"id": "p0", "domain": "fs", "prompt": "hi", "answer": "x",
                                                      "verifier": "exact"}])

    def cfg(out):
        return SFTConfig(domains={"fs": {"data": str(data), "probe_tasks": str(probe)}}, out_dir=str(tmp_path / out),
                         lora={"rank": 2, "num_layers": -1, "scale": 10.0}, learning_rate=5e-3, iters=6, batch_size=2,
                         max_seq_length=48, save_every=2, report_every=1, val_batches=-1, seed=2,
                         probe={"k": 1, "sampling": {"temperature": 0.0, "max_tokens": 1}, "progress": False})

    def probe_fn(*a):
        return {"pass@1": 0.0, "pass@k": 0.0}

    class Kill(Exception):
        pass

    class KillAt3:
        def on_train_loss_report(self, info):
            if info["iteration"] == 3:
                raise Kill()

    with pytest.warns(UserWarning, match="truncated"):
        run_sft(cfg("a"), None, model_and_tokenizer=base, probe_fn=probe_fn)
        with pytest.raises(Kill):
            run_sft(cfg("b"), None, model_and_tokenizer=base, probe_fn=probe_fn, callbacks=[KillAt3()])
        run_sft(cfg("b"), None, model_and_tokenizer=base, probe_fn=probe_fn)
    for step in (2, 4, 6):
        wa = mx.load(str(tmp_path / "a" / "fs" / "checkpoints" / f"step_{step:07d}" / "adapters.safetensors"))
        wb = mx.load(str(tmp_path / "b" / "fs" / "checkpoints" / f"step_{step:07d}" / "adapters.safetensors"))
        for k in wa:
            np.testing.assert_allclose(np.array(wa[k]), np.array(wb[k]), rtol=0, atol=1e-6, err_msg=f"step {step} {k}")
    ca, cb = ([json.loads(x) for x in (tmp_path / d / "fs" / "probe_curve.jsonl").read_text().splitlines()] for d in "ab")
    assert [r["val_loss"] for r in ca] == pytest.approx([r["val_loss"] for r in cb], rel=1e-5)
    assert all(r["val_loss"] is not None and np.isfinite(r["val_loss"]) for r in ca)
    assert [r["loss"] for r in ca] == pytest.approx([r["loss"] for r in cb], rel=1e-5)
