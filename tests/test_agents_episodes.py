"""Episodes end to end on a tiny model: the engine (batched = one at a time, fresh state per sample,
KV-cache reuse), the records, verification of finished episodes, the rollout stage's resume, and
the chat-template deltas. A scripted policy (the ground truth's calls as the "parsed" calls) makes
the tool path run on a random model; the tokens are still the model's own samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_ssp.agents.calls import parse_ground_truth
from mlx_ssp.agents.episode import Deltas, Episode
from mlx_ssp.cli import main
from mlx_ssp.rollout.config import SamplingConfig
from mlx_ssp.rollout.request import RolloutRequest
from mlx_ssp.tasks import write_tasks
from mlx_ssp.tasks.build import export_source
from mlx_ssp.verify import verify

IDS = ("multi_turn_base_0", "multi_turn_base_1", "multi_turn_base_180")  # file system x2, irrelevance turn


@pytest.fixture(scope="module")
def tasks():
    """Three base entries; no tool schemas in the prompt (they would be ~10k tokens of BPE for a tiny model)."""
    ts = [t for t in export_source("bfcl_multi_turn:base") if t.metadata["bfcl_id"] in IDS]
    for t in ts:
        t.metadata["tools"] = []
    assert len(ts) == 3
    return ts


@pytest.fixture
def scripted(monkeypatch):
    """The first message of each turn "calls" that turn's ground truth; the next one ends the turn."""
    def parse_calls(self, text):
        gt = self.task.metadata["episode"]["ground_truth"][self.turn]
        return [parse_ground_truth(c) for c in gt] if self.steps == 0 else []

    monkeypatch.setattr(Episode, "parse_calls", parse_calls)


def _run(model_tok, tasks, *, batch_size, k=2, reuse_cache=True, seed=5, stats=None):
    from mlx_ssp.agents.engine import run_episodes

    model, tok = model_tok
    req = RolloutRequest(tasks=tasks, k=k, sampling=SamplingConfig(temperature=1.0, max_tokens=6), seed=seed,
                         batch_size=batch_size, progress=False)
    recs = [r for g in run_episodes(model, tok, req, stats=stats, reuse_cache=reuse_cache) for r in g]
    return sorted(recs, key=lambda r: (r["task_id"], r["sample"]))


@pytest.fixture(scope="module")
def model_tok(tiny_qwen3):
    import mlx_lm

    return mlx_lm.load(str(tiny_qwen3))


def test_scripted_ground_truth_scores_one_and_batched_equals_one_at_a_time(model_tok, tasks, scripted):
    st_b, st_1 = {}, {}
    batched = _run(model_tok, tasks, batch_size=6, stats=st_b)
    single = _run(model_tok, tasks, batch_size=1, stats=st_1)
    assert len(batched) == 6
    # K samples of one task each ran in a fresh world: a shared one would fail the second sample's
    # mkdir/mv (already done) and its response check
    assert [r["reward"] for r in batched] == [1.0] * 6, [r["detail"] for r in batched]
    assert all(all(t["passed"] for t in r["turns"]) for r in batched)
    for a, b in zip(batched, single):
        assert a["token_ids"] == b["token_ids"] and a["messages"] == b["messages"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    assert st_b["gen_tokens"] == st_1["gen_tokens"] == sum(r["num_tokens"] for r in batched)
    # two samples of one task differ (their own noise streams)
    assert batched[0]["token_ids"] != batched[1]["token_ids"]


def test_episode_record_layout(model_tok, tasks, scripted):
    tok = model_tok[1]
    (rec,) = [r for r in _run(model_tok, tasks[:1], batch_size=2, k=1)]
    ids, mask, lps = rec["token_ids"], rec["model_mask"], rec["logprobs"]
    assert len(ids) == len(mask) == len(lps) and rec["num_tokens"] == sum(mask)
    assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m) and all(lp < 0 for lp, m in zip(lps, mask) if m)
    # the user turns and the tool results are in the conversation's ids, outside the model's mask
    text_not_model = tok.decode([t for t, m in zip(ids, mask) if not m])
    ep = tasks[0].metadata["episode"]
    for turn in ep["user_turns"][1:]:
        assert turn[0]["content"] in text_not_model
    tool_msgs = [m for m in rec["messages"] if m["role"] == "tool"]
    assert tool_msgs and all(m["content"] in text_not_model for m in tool_msgs)
    assert [m["role"] for m in rec["messages"]].count("user") == len(ep["user_turns"])
    assert rec["finish_reason"] == "done" and rec["kind"] == "episode"


def test_cache_reuse_cuts_prefill(model_tok, tasks, scripted):
    with_cache, without = {}, {}
    a = _run(model_tok, tasks[:2], batch_size=4, stats=with_cache)
    b = _run(model_tok, tasks[:2], batch_size=4, stats=without, reuse_cache=False)
    assert [r["reward"] for r in a] == [r["reward"] for r in b] == [1.0] * 4
    # without reuse every message re-prefills the whole conversation
    assert without["prompt_tokens"] > 2 * with_cache["prompt_tokens"]
    # with reuse each conversation token is prefilled once (the cache has seen each message's last sampled token)
    assert with_cache["prompt_tokens"] == sum(len(r["prompt_token_ids"]) + len(r["token_ids"]) - r["num_tokens"]
                                              for r in a)
    # and the model saw the recorded conversation: the tokens a full re-prefill gives
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]


def test_verify_replays_episode_lines(tasks):
    """An episode line in OpenAI format: the ground truth as tool_calls scores 1; tool messages are
    ignored (re-run); a dropped call fails; model text with a <tool_call> block is parsed."""
    t = tasks[0]
    ep = t.metadata["episode"]
    msgs = []
    for turn, calls in zip(ep["user_turns"], ep["ground_truth"]):
        msgs += turn
        from mlx_ssp.agents.environment import Environment, world_of

        env = Environment(world_of(ep))
        bound = [env.bind(parse_ground_truth(c)) for c in calls]
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in bound]})
        msgs.append({"role": "tool", "content": "lies: every call failed"})
        msgs.append({"role": "assistant", "content": "Done."})
    res = verify(msgs, t)
    assert res.reward == 1.0 and res.extra["partial"] == 1.0, res.detail
    assert verify(json.dumps(msgs), t).reward == 1.0
    dropped = [dict(m, tool_calls=[c for c in m["tool_calls"] if c["function"]["name"] != "mkdir"])
               if m.get("tool_calls") else m for m in msgs]
    bad = verify(dropped, t)
    assert bad.reward == 0.0 and bad.extra["partial"] < 1 and bad.extra["turns"][0]["reason"].startswith("state")
    as_text = [dict(m) for m in msgs]
    first = next(i for i, m in enumerate(as_text) if m.get("tool_calls"))
    calls = as_text[first].pop("tool_calls")
    as_text[first]["content"] = "".join(
        f'<tool_call>{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}</tool_call>' for c in calls)
    assert verify(as_text, t).reward == 1.0
    assert verify([{"role": "assistant", "content": "hi"}], t).reason == "malformed_episode"


def test_partial_reward_is_selectable(tasks):
    t = tasks[0].model_copy(deep=True)
    t.metadata["episode"]["reward"] = "partial"
    msgs = [m for turn in t.metadata["episode"]["user_turns"] for m in turn]  # no calls at all
    res = verify(msgs, t)
    assert res.reward == res.extra["partial"] == 0.0
    t.metadata["episode"]["reward"] = "best"
    from mlx_ssp.errors import UserError
    from mlx_ssp.tasks import check_tasks

    with pytest.raises(UserError, match="accuracy, partial"):
        check_tasks([t])


def test_rollout_stage_resumes_episodes_to_the_identical_file(tmp_path, tiny_qwen3, tasks):
    tf = tmp_path / "t.jsonl"
    write_tasks(tf, tasks[:2])
    args = ["rollout", "--no-progress", "--model", str(tiny_qwen3), "--tasks", str(tf), "--k", "2",
            "--max-tokens", "5", "--seed", "2"]
    full = tmp_path / "full.jsonl"
    res = CliRunner().invoke(main, [*args, "-o", str(full)])
    assert res.exit_code == 0, res.output
    raw = full.read_text().splitlines(keepends=True)
    assert len(raw) == 4 and all(json.loads(x)["kind"] == "episode" for x in raw)
    part = tmp_path / "part.jsonl"
    part.write_text("".join(raw[:1]) + raw[1][:40])  # killed mid-line after one episode
    (tmp_path / "part.meta.json").write_text((tmp_path / "full.meta.json").read_text())
    res = CliRunner().invoke(main, [*args, "--batch-size", "1", "-o", str(part)])
    assert res.exit_code == 0, res.output
    key = lambda r: (r["task_id"], r["sample"])  # noqa: E731
    got, ref = (sorted(map(json.loads, p.read_text().splitlines()), key=key) for p in (part, full))
    assert [key(r) for r in got] == [key(r) for r in ref]
    for a, b in zip(got, ref):  # the same episodes: tokens, messages, verdicts (timings aside)
        assert {k: v for k, v in a.items() if k not in ("latency_s", "verify_s", "logprobs")} == \
            {k: v for k, v in b.items() if k not in ("latency_s", "verify_s", "logprobs")}
        # log-probs from another batch shape: float32 rounding only
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)


def test_deltas_follow_the_models_own_template():
    """Qwen3's template: tool results go into one user block of <tool_response>s, then the generation prompt."""
    from transformers import AutoTokenizer

    d = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "qwen3"
    if not d.is_dir():
        pytest.skip("no Qwen3 tokenizer in ../shared/data")
    tok = AutoTokenizer.from_pretrained(str(d))
    text = Deltas(tok).text([{"role": "tool", "name": "ls", "content": "a.txt"},
                             {"role": "tool", "name": "cd", "content": "ok"}], ended_with="<|im_end|>")
    assert text.startswith("\n<|im_start|>user\n<tool_response>\na.txt\n</tool_response>")
    assert text.count("<|im_start|>user") == 1 and text.endswith("<|im_start|>assistant\n")
    # a message cut by max_tokens gets the template's end of message first
    assert Deltas(tok).text([{"role": "user", "content": "next"}], ended_with=None).startswith("<|im_end|>\n<|im_start|>user\nnext")


def _gt_messages(task, prose=""):
    from mlx_ssp.agents.environment import Environment, world_of

    ep = task.metadata["episode"]
    env = Environment(world_of(ep))
    msgs = []
    for turn, calls in zip(ep["user_turns"], ep["ground_truth"]):
        msgs += turn
        bound = [env.bind(parse_ground_truth(c)) for c in calls]
        msgs.append({"role": "assistant", "content": prose, "tool_calls": [c.as_openai() for c in bound]})
        msgs.append({"role": "assistant", "content": f"Done. {prose}"})
    return msgs


def test_verify_command_scores_episode_lines(tmp_path, tasks):
    t = tasks[0]
    lines = [{"task": t.model_dump(mode="json"), "messages": _gt_messages(t)},
             {"task": t.model_dump(mode="json"), "messages": [m for m in _gt_messages(t) if m["role"] != "assistant"]}]
    inp, out = tmp_path / "ep.jsonl", tmp_path / "scored.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(main, ["verify", str(inp), "-o", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    good, bad = map(json.loads, out.read_text().splitlines())
    assert good["reward"] == 1.0 and len(good["turns"]) == 4 and good["partial"] == 1.0
    assert bad["reward"] == 0.0 and bad["reason"] == "turn_failed" and not any(x["passed"] for x in bad["turns"])


def test_select_counts_distinct_call_sequences_not_wording(tasks):
    from mlx_ssp.select import SelectConfig, select_prompt, to_chat

    t = tasks[0]
    same_a, same_b = _gt_messages(t, "ok"), _gt_messages(t, "all done, here you go")
    other = _gt_messages(t)
    other.insert(len(t.metadata["episode"]["user_turns"][0]), {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "pwd", "arguments": {}}}]})  # a different strategy in turn 0
    recs = [{"task_id": t.id, "sample": i, "kind": "episode", "reward": 1.0, "finish_reason": "done",
             "messages": m, "completion": "", "prompt_token_ids": [1, 2], "token_ids": [3, 4], "model_mask": [1, 0]}
            for i, m in enumerate((same_a, same_b, other))]
    # near_duplicate 0: only identical call sequences are one strategy (one extra call among 10 is a
    # near-duplicate at the default 0.1 of the trigram distance)
    chosen, row = select_prompt(recs, SelectConfig(per_prompt=4, near_duplicate=0.0))
    assert row["n_correct"] == 3 and row["n_distinct_correct"] == 2
    assert sorted(r["sample"] for r in chosen) == [0, 2]
    ex = to_chat(chosen[0])  # the whole conversation is the example, the model's tokens masked in
    assert ex["messages"] == same_a and ex["token_ids"] == [1, 2, 3, 4] and ex["mask"] == [0, 0, 1, 0]
    assert ex["source"] == "sampled"


def test_eval_reports_pass_at_k_per_backend(tmp_path, tiny_qwen3, scripted):
    from mlx_ssp.tasks.build import export_source as export

    ts = [t for t in export("bfcl_multi_turn:base") if t.metadata["bfcl_id"] in ("multi_turn_base_1", "multi_turn_base_100")]
    for t in ts:
        t.metadata["tools"] = []
    tf, out = tmp_path / "t.jsonl", tmp_path / "eval.json"
    write_tasks(tf, ts)
    res = CliRunner().invoke(main, ["eval", "--model", str(tiny_qwen3), "--tasks", str(tf), "--k", "2", "--max-tokens", "4",
                                    "--no-progress", "-o", str(out)])
    assert res.exit_code == 0, res.output
    table = json.loads(out.read_text())["domains"]
    assert set(table) == {"bfcl_mt_base_file_system", "bfcl_mt_base_trading"}
    assert all(d["pass@1"] == d["pass@2"] == 1.0 for d in table.values())


def test_first_prompt_uses_the_templates_tools_or_the_system_prompt(tiny_qwen3):
    """Qwen3's template renders the offered tools itself; a template without tools (the tiny
    model's ChatML, like SmolLM2's) gets the schemas and the call format in the system message."""
    from transformers import AutoTokenizer

    from mlx_ssp.tasks import render_prompt

    (t,) = [t for t in export_source("bfcl_multi_turn:base") if t.metadata["bfcl_id"] == "multi_turn_base_0"]
    plain = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    text = plain.decode(render_prompt(plain, t))
    assert "You can call these functions" in text and '"name": "mkdir"' in text and "<tool_call>" in text
    d = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "qwen3"
    if not d.is_dir():
        pytest.skip("no Qwen3 tokenizer in ../shared/data")
    q = AutoTokenizer.from_pretrained(str(d))
    text = q.decode(render_prompt(q, t))
    assert "<tools>" in text and '"name": "mkdir"' in text and "You can call these functions" not in text


def test_gold_episodes_of_every_base_entry_pass():
    """The ground truth played through the environment verifies to 1 everywhere (this also caught a
    backend keeping a call's argument list and a later call mutating the recorded message)."""
    from mlx_ssp.agents.gold import gold_messages

    ts = export_source("bfcl_multi_turn:base")
    failed = [t.id for t in ts if verify(gold_messages(t), t).reward != 1.0]
    assert not failed


def test_replay_mask_covers_exactly_the_assistant_tokens(tiny_qwen3):
    """A 3-turn gold episode with tool results: the mask is 1 on each assistant message's tokens and
    its end-of-message token, 0 on the system prompt, user turns and tool results."""
    import mlx_lm

    from mlx_ssp.agents.episode import Deltas, assistant_text, replay
    from mlx_ssp.agents.gold import gold_messages

    _, tok = mlx_lm.load(str(tiny_qwen3))
    (t,) = [t for t in export_source("bfcl_multi_turn:base") if len(t.metadata["episode"]["ground_truth"]) == 3
            and all(t.metadata["episode"]["ground_truth"])][:1]
    t.metadata["tools"] = []
    msgs = gold_messages(t)
    assert sum(m["role"] == "tool" for m in msgs) >= 3
    prompt, ids, mask = replay(tok, t, msgs)
    assert prompt == __import__("mlx_ssp.tasks", fromlist=["render_prompt"]).render_prompt(tok, t)
    end_id, end_text = Deltas(tok).end_of_message()
    assert end_text == "<|im_end|>"
    # the masked runs, in order, are exactly the assistant messages (each with its end token)
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    want = [list(tok.encode(assistant_text(m), add_special_tokens=False)) + [end_id] for m in msgs if m["role"] == "assistant"]
    assert runs == want
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert all(m["content"] in unmasked for m in msgs[2:] if m["role"] in ("user", "tool"))


def test_select_with_gold_writes_masked_conversations(tmp_path, tiny_qwen3, tasks):
    """`select --gold`: a task whose sampled episodes all failed still gets its gold episode as SFT data,
    in the multi-turn format (whole conversation ids, the model's mask, the source)."""
    tf, ro, out = tmp_path / "t.jsonl", tmp_path / "r.jsonl", tmp_path / "sel"
    write_tasks(tf, tasks[:2])
    failed = [{"task_id": t.id, "domain": t.domain, "sample": s, "kind": "episode", "prompt": t.prompt,
               "completion": "", "reward": 0.0, "finish_reason": "done", "messages": t.messages()}
              for t in tasks[:2] for s in range(2)]
    ro.write_text("".join(json.dumps(r) + "\n" for r in failed))
    res = CliRunner().invoke(main, ["select", str(ro), "-o", str(out), "--gold", "--tasks", str(tf), "--model", str(tiny_qwen3)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for f in sorted(out.glob("*/*.jsonl")) for x in f.read_text().splitlines()]
    assert rows and all(r["source"] == "gold" for r in rows)
    for r in rows:
        assert len(r["token_ids"]) == len(r["mask"]) and 0 < sum(r["mask"]) < len(r["mask"])
    res = CliRunner().invoke(main, ["select", str(ro), "-o", str(tmp_path / "s2"), "--gold"])
    assert res.exit_code == 2 and "--tasks" in res.output


def test_step_limit_ends_the_episode_and_fails_that_turn(model_tok, tasks, monkeypatch):
    """A model that calls on every message: at `max_steps` attempts in a turn the episode ends
    (BFCL's force-quit), and re-verification flags the same turn."""
    from mlx_ssp.agents.calls import Call

    monkeypatch.setattr(Episode, "parse_calls", lambda self, text: [Call("pwd", {})])
    t = tasks[0].model_copy(deep=True)
    t.metadata["episode"]["max_steps"] = 3
    (rec, _) = _run(model_tok, [t], batch_size=2)
    assert rec["finish_reason"] == "step_limit" and rec["num_messages"] == 3
    assert rec["turns"][0]["reason"].startswith("step limit") and rec["reward"] == 0.0
    assert verify(rec["messages"], t).extra["turns"][0]["reason"].startswith("step limit")


def test_a_turn_never_reached_fails_even_with_empty_ground_truth():
    """An episode cut before its last turn (a step or context limit) must not pass that turn as
    irrelevance: the base entry whose last ground truth is empty, its gold conversation cut before
    the last user message, scores below 1."""
    from mlx_ssp.agents.gold import gold_messages

    (t,) = [t for t in export_source("bfcl_multi_turn:base") if not t.metadata["episode"]["ground_truth"][-1]][:1]
    msgs = gold_messages(t)
    assert verify(msgs, t).reward == 1.0
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    cut = verify(msgs[:last_user], t)
    assert cut.reward == 0.0 and cut.extra["turns"][-1]["reason"] == "not reached"


def test_python_tuples_run_as_the_saved_record_will():
    """A call written in python syntax with a tuple argument: the live message (tool_calls built from
    the parsed call) and its JSON round trip (the saved record) re-execute to the same verdict."""
    from mlx_ssp.agents.calls import parse_assistant_text

    (t,) = [t for t in export_source("bfcl_multi_turn:base") if t.metadata["bfcl_id"] == "multi_turn_base_147"]
    (c,) = parse_assistant_text("post_tweet(content='hi', tags=('#a',), mentions=())")
    assert c.arguments["tags"] == ["#a"] and c.arguments["mentions"] == []
    msgs = [m for m in t.messages()] + [{"role": "assistant", "content": "", "tool_calls": [c.as_openai()]}]
    live = verify(msgs, t)
    saved = verify(json.loads(json.dumps(msgs)), t)
    assert live.extra["turns"] == saved.extra["turns"] and live.reward == saved.reward


def test_strategy_keeps_turn_boundaries():
    """The same call in turn 0 or in turn 1 is two strategies (a turn without calls keeps its place)."""
    from mlx_ssp.select import strategy_text

    ls = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": {}}}]}
    say = {"role": "assistant", "content": "ok"}
    u0, u1 = {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
    early = {"kind": "episode", "messages": [u0, ls, say, u1, say]}
    late = {"kind": "episode", "messages": [u0, say, u1, ls, say]}
    assert strategy_text(early) != strategy_text(late)
    assert strategy_text(early) == strategy_text({"kind": "episode", "messages": [u0, say, ls, u1, say]})


def test_a_call_over_its_time_limit_ends_that_episode_and_the_batch_goes_on(model_tok, tasks, monkeypatch):
    """Sample 0 calls MathAPI.power(10, 10**8), which holds the interpreter lock for minutes: its
    worker is killed at the task's call_timeout_s, the episode ends (call_timeout) and fails with the
    reason; sample 1 of the same batch plays the ground truth and passes."""
    from mlx_ssp.agents.calls import Call

    def parse_calls(self, text):
        if self.sample == 0:
            return [Call("power", {"base": 10, "exponent": 10**8})]
        gt = self.task.metadata["episode"]["ground_truth"][self.turn]
        return [parse_ground_truth(c) for c in gt] if self.steps == 0 else []

    monkeypatch.setattr(Episode, "parse_calls", parse_calls)
    t = tasks[0].model_copy(deep=True)
    ep = t.metadata["episode"]
    ep["involved_classes"] = [*ep["involved_classes"], "MathAPI"]
    ep.pop("offered", None), ep.pop("held_out", None)
    ep["call_timeout_s"] = 1.0
    hostile, fine = _run(model_tok, [t], batch_size=2)
    assert hostile["finish_reason"] == "call_timeout" and hostile["reward"] == 0.0
    assert "power did not finish within 1s" in hostile["messages"][-1]["content"]
    assert "the model's environment was stopped" in hostile["turns"][0]["reason"]
    assert fine["finish_reason"] == "done" and fine["reward"] == 1.0, fine["detail"]
