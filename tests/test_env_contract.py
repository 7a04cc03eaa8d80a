"""A user environment under the contract of mlx_ssp.agents.env: a class in a file the test writes,
two tools, ground truth over two turns. It exports as episode tasks, its gold episodes verify to 1,
a wrong argument and an extra state-changing call fail, private and unoffered names never run, a
tool that raises returns its message, reward() scores tasks without ground truth, and it rolls
out, trains one SFT step and one RL step on a tiny model like BFCL's episodes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

import mlx_ssp  # noqa: F401
from mlx_ssp.agents.calls import Call, parse_ground_truth
from mlx_ssp.agents.env import load_class, resolve_ref, tool_schemas
from mlx_ssp.agents.environment import Environment, class_world
from mlx_ssp.agents.episode import Episode
from mlx_ssp.agents.gold import gold_messages
from mlx_ssp.cli import main
from mlx_ssp.errors import UserError
from mlx_ssp.tasks.build import export_source
from mlx_ssp.verify import verify

ENV = '''
from typing import Literal, Optional


class Shelf:
    """A shelf of labelled jars."""

    def reset(self, config):
        self.jars = dict(config.get("jars", {}))
        self.log = []

    def put(self, label: str, count: int, unit: Literal["g", "kg"] = "g") -> dict:
        """Put a jar on the shelf.

        Args:
            label: the jar's label.
            count: how much it holds.
            unit: grams or kilograms.
        """
        if count < 0:
            raise ValueError("count must be >= 0")
        self.jars[label] = f"{count}{unit}"
        self.log.append(label)
        return {"stored": label}

    def look(self, label: str, note: Optional[str] = None) -> str:
        """What a jar holds.

        Args:
            label: the jar's label.
            note: ignored.
        """
        return self.jars.get(label, "no such jar")

    def _burn(self):
        open(__file__ + ".burnt", "w").write("x")

    def reward(self) -> float:
        return 1.0 if self.jars.get("tea") == "2kg" else 0.0
'''

ROWS = [
    {"id": "s1", "environment": "envs/shelf.py:Shelf", "config": {"jars": {"salt": "5g"}},
     "turns": ["Put 2 kg of tea on the shelf.", "How much salt is there?"],
     "ground_truth": [["put(label='tea', count=2, unit='kg')"], ["look(label='salt')"]], "domain": "shelf"},
    {"id": "s2", "environment": "envs/shelf.py:Shelf", "config": {},
     "turns": ["Put 3 g of rice there.", "Nothing else, thanks."],
     "ground_truth": [["put(label='rice', count=3)"], []], "domain": "shelf"},
]


@pytest.fixture
def env_dir(tmp_path) -> Path:
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "shelf.py").write_text(ENV)
    return tmp_path


def _episodes(env_dir: Path, rows=ROWS, name="episodes.jsonl") -> Path:
    p = env_dir / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _tasks(env_dir: Path, rows=ROWS):
    return export_source(f"episodes:{_episodes(env_dir, rows)}", split="train", size=len(rows))


def test_tool_schemas_come_from_signatures_and_docstrings(env_dir):
    cls = load_class(resolve_ref("envs/shelf.py:Shelf", env_dir))
    by_name = {t["function"]["name"]: t["function"] for t in tool_schemas(cls)}
    assert set(by_name) == {"put", "look"}  # not reset, reward or _burn
    put = by_name["put"]
    assert put["description"] == "Put a jar on the shelf."
    assert put["parameters"]["required"] == ["label", "count"]
    assert put["parameters"]["properties"]["unit"] == {"type": "string", "enum": ["g", "kg"], "description": "grams or kilograms.", "default": "g"}
    assert put["parameters"]["properties"]["count"] == {"type": "integer", "description": "how much it holds."}
    assert by_name["look"]["parameters"]["required"] == ["label"]  # Optional[...] = None is optional


def test_export_gold_verifies_to_one_through_the_cli(env_dir, tmp_path):
    src = _episodes(env_dir)
    gold = tmp_path / "gold.jsonl"
    r = CliRunner().invoke(main, ["tasks", "export", f"episodes:{src}", "-o", str(gold), "--gold"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in gold.read_text().splitlines()]
    assert [x["task"]["id"] for x in lines] and all(x["task"]["verifier"] == "episode" for x in lines)
    tool_msgs = [m["content"] for m in lines[0]["messages"] if m["role"] == "tool"]
    assert tool_msgs == ['{"stored": "tea"}', "5g"]  # real results from the environment
    out = tmp_path / "scored.jsonl"
    r = CliRunner().invoke(main, ["verify", str(gold), "-o", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["reward"] for x in out.read_text().splitlines()] == [1.0, 1.0]


def _with_calls(task, turns_calls: list[list[str]]) -> list[dict]:
    msgs = [dict(m) for m in task.messages()]
    for t, calls in enumerate(turns_calls):
        if t:
            msgs += task.metadata["episode"]["user_turns"][t]
        cs = [parse_ground_truth(c) for c in calls]
        if cs:
            msgs.append({"role": "assistant", "content": "", "tool_calls": [c.as_openai() for c in cs]})
        msgs.append({"role": "assistant", "content": "Done."})
    return msgs


def test_wrong_argument_extra_state_change_private_and_unoffered_names_fail(env_dir):
    t = next(t for t in _tasks(env_dir) if t.id.endswith("s1"))
    ok = verify(_with_calls(t, [["put(label='tea', count=2, unit='kg')"], ["look(label='salt')"]]), t)
    assert ok.reward == 1.0, ok.detail
    wrong = verify(_with_calls(t, [["put(label='tea', count=2, unit='g')"], ["look(label='salt')"]]), t)
    assert wrong.reward == 0.0 and "state" in wrong.extra["turns"][0]["reason"]
    extra = verify(_with_calls(t, [["put(label='tea', count=2, unit='kg')"],
                                   ["look(label='salt')", "put(label='x', count=1)"]]), t)
    assert extra.reward == 0.0 and extra.extra["turns"][1]["reason"].startswith("state")
    burnt = Path(str(env_dir / "envs" / "shelf.py") + ".burnt")
    with Environment(class_world(t.metadata["episode"]["environment"], {})) as env:
        r = env.execute([Call("_burn", {}), Call("reset", {"config": {}}), Call("reward", {}),
                         Call("__init__", {})], env.method_names())
        assert all(x.startswith("Error during execution: no function named") for x in r), r
        assert env.execute([Call("look", {"label": "salt"})], {"put"})[0].endswith("is not available in this turn")
        # a tool that raises: its message is the result text, as BFCL does
        assert env.execute([Call("put", {"label": "a", "count": -1})], env.method_names()) == \
            ["Error during execution: count must be >= 0"]
    assert not burnt.exists()


def test_reward_scores_an_episode_without_ground_truth(env_dir):
    rows = [{k: v for k, v in r.items() if k != "ground_truth"} for r in ROWS]
    t = next(t for t in _tasks(env_dir, rows) if t.id.endswith("s1"))
    assert "ground_truth" not in t.metadata["episode"]
    good = verify(_with_calls(t, [["put(label='tea', count=2, unit='kg')"], []]), t)
    bad = verify(_with_calls(t, [["put(label='tea', count=2)"], []]), t)
    assert (good.reward, bad.reward) == (1.0, 0.0)
    with pytest.raises(UserError, match="no ground truth"):
        gold_messages(t)


@pytest.mark.parametrize("row,needle", [
    ({"id": "x", "environment": "envs/shelf.py:Shelf"}, "'turns' is required"),
    ({"id": "x", "environment": "envs/nope.py:Shelf", "turns": ["a"]}, "no file"),
    ({"id": "x", "environment": "envs/shelf.py:Nope", "turns": ["a"]}, "has no class Nope"),
    ({"id": "x", "environment": "envs/shelf.py:Shelf", "turns": ["a"], "ground_truth": [["put("]]}, "'ground_truth'"),
    ({"id": "x", "environment": "envs/shelf.py:Shelf", "turns": ["a"], "ground_truth": [[], []]}, "per turn"),
    ({"id": "x", "environment": "envs/shelf.py:Shelf", "turns": ["a"], "colour": 1}, "unknown key"),
])
def test_a_bad_line_names_the_file_the_line_and_the_key(env_dir, row, needle):
    p = _episodes(env_dir, [ROWS[0], row], "bad.jsonl")
    with pytest.raises(UserError, match=needle) as e:
        export_source(f"episodes:{p}", split="train", size=1)
    assert f"{p}:2" in str(e.value)


def _scripted_parse(self, text):
    """Samples 0-2 call each turn's ground truth in their first message, then end the turn; sample 3
    never calls (reward 0 on s1)."""
    if self.sample == 3 or self.steps:
        return []
    return [parse_ground_truth(c) for c in self.task.metadata["episode"]["ground_truth"][self.turn]]


def test_rollout_sft_and_rl_on_a_user_environment(env_dir, tiny_qwen3, tmp_path, monkeypatch):
    from mlx_ssp.agents.engine import run_episodes
    from mlx_ssp.agents.episode import replay
    from mlx_ssp.models import load_model
    from mlx_ssp.rl.config import RLConfig
    from mlx_ssp.rl.policy import setup_model
    from mlx_ssp.rl.trainer import train
    from mlx_ssp.rollout.config import SamplingConfig
    from mlx_ssp.rollout.request import RolloutRequest
    from mlx_ssp.sft.config import SFTConfig
    from mlx_ssp.sft.stage import run_sft

    monkeypatch.setattr(Episode, "parse_calls", _scripted_parse)
    tasks = _tasks(env_dir)
    for t in tasks:
        t.metadata["tools"] = []  # a tiny tokenizer: keep the prompt short
    model, tok, _ = load_model(str(tiny_qwen3))
    req = RolloutRequest(tasks=tasks, k=4, sampling=SamplingConfig(temperature=1.0, max_tokens=6), seed=1,
                         batch_size=8, progress=False)
    recs = sorted((r for g in run_episodes(model, tok, req) for r in g), key=lambda r: (r["task_id"], r["sample"]))
    assert [r["reward"] for r in recs if r["task_id"].endswith("s1")] == [1.0, 1.0, 1.0, 0.0]
    for r in recs:  # the model-token mask: tool results and user turns are not the model's
        assert len(r["model_mask"]) == len(r["token_ids"]) == len(r["logprobs"]) and 0 < sum(r["model_mask"]) < len(r["model_mask"])
        assert any(m["role"] == "tool" for m in r["messages"]) == (r["sample"] != 3)

    # one SFT step on the gold episodes (token records with the mask)
    gold = []
    for t in tasks:
        prompt, ids, mask = replay(tok, t, gold_messages(t))
        gold.append({"token_ids": prompt + ids, "mask": [0] * len(prompt) + mask, "task_id": t.id})
    data = tmp_path / "gold.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in gold))
    probe = tmp_path / "probe.jsonl"
    probe.write_text(json.dumps({"id": "p0", "domain": "shelf", "prompt": "hi", "answer": "x", "verifier": "exact"}) + "\n")
    cfg = SFTConfig(domains={"shelf": {"data": str(data), "probe_tasks": str(probe)}}, out_dir=str(tmp_path / "sft"),
                    lora={"rank": 4, "num_layers": -1, "scale": 10.0}, learning_rate=1e-2, iters=1, batch_size=1,
                    max_seq_length=2048, save_every=1, report_every=1, val_batches=0, seed=1,
                    probe={"k": 1, "sampling": {"temperature": 0.0, "max_tokens": 1}, "progress": False})
    summary = run_sft(cfg, None, model_and_tokenizer=load_model(str(tiny_qwen3)),
                      probe_fn=lambda *a: {"pass@1": 0.0, "pass@k": 0.0})
    assert Path(summary["domains"]["shelf"]["specialist"], "config.json").is_file()

    # one RL step: the LoRA weights change, nothing frozen does
    rl = RLConfig(steps=1, batch_size=2, group_size=4, sampling={"temperature": 1.0, "max_tokens": 6},
                  learning_rate=2e-2, progress=False, checkpoint_every=100, micro_batch_size=8)
    model, tok, _ = load_model(str(tiny_qwen3))
    setup_model(model, rl)
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    s = train(model, tok, tasks, rl, tmp_path / "rl", seed=3)
    assert not s["last"]["skipped"]
    after = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    changed = {k for k in after if not np.array_equal(after[k], before[k])}
    assert changed and changed <= trainable


LOCK = {"type": "function", "function": {
    "name": "lockDoors", "description": "Locks or unlocks the doors.",
    "parameters": {"type": "object", "required": ["unlock", "door"], "properties": {
        "unlock": {"type": "boolean"}, "door": {"type": "string", "enum": ["driver", "passenger", "rear_left"]},
        "speed": {"type": "number", "default": 1.5}, "tags": {"type": "array", "items": {"type": "string"}}}}}}


def test_compact_signature_lines():
    from mlx_ssp.agents.render import signature_line

    line = "lockDoors(unlock:bool, door:driver|passenger|rear_left, speed:float=1.5, tags?:list[str])"
    assert signature_line(LOCK) == line
    assert signature_line(LOCK, describe=2) == line + " - Locks or..."
    assert signature_line(LOCK, describe=9) == line + " - Locks or unlocks the doors."


def test_compact_rendering_round_trips_on_a_user_environment_and_on_bfcl(env_dir):
    """Compact tasks: the tools are signature lines in the system message (none for the template);
    gold calls are written in python syntax, parse back to the ground truth's calls, and verify to 1."""
    from mlx_ssp.agents.calls import calls_from_message, parse_assistant_text

    tasks = export_source(f"episodes:{_episodes(env_dir)}", split="train", size=2, params={"render": "compact"})
    t = next(t for t in tasks if t.id.endswith("s1"))
    system = t.prompt[0]["content"]
    assert t.metadata["tools"] == [] and t.metadata["episode"]["render"] == "compact"
    assert "put(label:str, count:int, unit:g|kg=g)" in system and "look(label:str, note?:str)" in system
    gold = gold_messages(t)
    first = next(m for m in gold if m["role"] == "assistant")
    assert first["content"] == "put(label='tea', count=2, unit='kg')"
    assert verify(gold, t).reward == 1.0
    for bt in export_source("bfcl_multi_turn:base", params={"render": "compact", "tools": "used"})[:25]:
        msgs = gold_messages(bt)
        for m in msgs:
            if m["role"] == "assistant" and m.get("tool_calls"):
                assert parse_assistant_text(m["content"]) == calls_from_message({"role": "assistant", "tool_calls": m["tool_calls"]})
        assert verify(msgs, bt).reward == 1.0, bt.id


# ---------------------------------------------------------------- robustness of the worker and the contract

ODD = '''
import os
import threading
from dataclasses import dataclass
from typing import Optional


@dataclass
class Jar:
    label: str
    grams: int


class Odd:
    def reset(self, config):
        self.jars = [Jar("salt", 5)]
        if config.get("lock"):
            self.lock = threading.Lock()
        if config.get("die"):
            os._exit(3)

    def add(self, label: str, grams: int) -> str:
        """Adds a jar:"""
        self.jars.append(Jar(label, grams))
        return "ok"

    def big(self, n: int) -> str:
        return "x" * n

    @staticmethod
    def twice(x: int) -> int:
        return 2 * x

    @classmethod
    def kind(cls, loud: bool = False) -> str:
        return cls.__name__.upper() if loud else cls.__name__

    def must(self, a: Optional[int]) -> str:
        return str(a)
'''


@pytest.fixture
def odd(tmp_path) -> str:
    (tmp_path / "odd.py").write_text(ODD)
    return resolve_ref("odd.py:Odd", tmp_path)


def test_schemas_of_static_class_and_optional_parameters(odd):
    by = {t["function"]["name"]: t["function"] for t in tool_schemas(load_class(odd))}
    assert by["twice"]["parameters"]["required"] == ["x"]  # a static method has no self to drop
    assert by["kind"]["parameters"]["properties"] == {"loud": {"type": "boolean", "default": False}}
    assert by["must"]["parameters"]["required"] == ["a"]  # Optional without a default must still be passed
    assert by["add"]["description"] == "Adds a jar:"  # a line ending in a colon is not a section
    with Environment(class_world(odd, {})) as env:
        assert env.execute([Call("twice", {"x": 4}), Call("kind", {"loud": True})], env.method_names()) == ["8", "ODD"]


def test_a_non_json_default_is_refused_at_load(tmp_path):
    (tmp_path / "bad.py").write_text("class Bad:\n    def reset(self, c): pass\n    def f(self, s: set = frozenset()): pass\n")
    with pytest.raises(UserError, match="not JSON"):
        tool_schemas(load_class(resolve_ref("bad.py:Bad", tmp_path)))


def test_state_holding_the_environments_own_classes_is_compared_and_an_unpicklable_one_is_a_reason(odd):
    from mlx_ssp.agents.checker import EpisodeSpec, score_episode

    spec = EpisodeSpec(class_world(odd, {}), [["add(label='tea', grams=2)"]])
    assert score_episode(spec, [[[parse_ground_truth("add(label='tea', grams=2)")]]]).reward == 1.0
    assert score_episode(spec, [[[parse_ground_truth("add(label='tea', grams=3)")]]]).reward == 0.0
    locked = EpisodeSpec(class_world(odd, {"lock": True}), [["add(label='tea', grams=2)"]])
    v = score_episode(locked, [[[parse_ground_truth("add(label='tea', grams=2)")]]])
    assert v.reward == 0.0 and "could not be sent back" in v.turns[0].reason


def test_a_worker_that_dies_while_building_is_a_one_line_error(odd):
    with pytest.raises(UserError, match="could not be built"):
        Environment(class_world(odd, {"die": True}))


def test_a_huge_result_comes_back_cut_with_its_digest(odd):
    from mlx_ssp.agents.environment import CallLimits

    with Environment(class_world(odd, {}), limits=CallLimits(max_full_result_chars=1000)) as env:
        a, b, c = env.execute_full([Call("big", {"n": 5_000_000}), Call("big", {"n": 5_000_000}),
                                    Call("big", {"n": 5_000_001})], env.method_names())
    assert len(a) < 1100 and "4999000 more characters, sha256" in a
    assert a == b and a != c  # still compared exactly


def test_call_limits_of_a_task_are_checked():
    from mlx_ssp.agents.environment import limits_of

    assert limits_of({"call_timeout_s": 2}).timeout_s == 2.0
    for bad in ({"call_timeout_s": float("inf")}, {"call_timeout_s": 0}, {"call_timeout_s": float("nan")},
                {"call_timeout_s": True}, {"max_result_chars": 0}):
        with pytest.raises(UserError):
            limits_of(bad)
