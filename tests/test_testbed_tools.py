"""The tool testbed: four deterministic toy backends under the environment contract that share tool
names, a seeded episode generator whose gold episodes verify to 1 at every level, chained arguments
that only an earlier tool result holds, irrelevance turns at the configured rate, disjoint splits
with a held-out part of the space, short compact prompts, and variants for corpora: other call
orders that still pass and unreliable calls that fail."""

from __future__ import annotations

import copy
import json
import re
from collections import Counter

import pytest

import mlx_ssp  # noqa: F401  (OpenBLAS before mlx.core)
from mlx_ssp.agents.calls import Call
from mlx_ssp.agents.env import format_value, tool_functions, tool_schemas
from mlx_ssp.agents.environment import Environment, class_world
from mlx_ssp.agents.gold import gold_messages
from mlx_ssp.config import validate
from mlx_ssp.errors import UserError
from mlx_ssp.tasks.build import build_split, export_source
from mlx_ssp.tasks.config import TasksConfig
from mlx_ssp.testbed.tools import episodes as E
from mlx_ssp.testbed.tools import intents
from mlx_ssp.testbed.tools import space as S
from mlx_ssp.testbed.tools import variants as V
from mlx_ssp.testbed.tools.envs import CLASSES
from mlx_ssp.testbed.tools.source import split_episodes
from mlx_ssp.verify import verify


def _replay(ep: S.Episode, calls=None) -> tuple[list[list[str]], dict]:
    """Run the calls (default: the ground truth) on a fresh instance: result texts per turn, final state."""
    env = CLASSES[ep.backend]()
    env.reset(copy.deepcopy(ep.config))
    results = []
    for turn in ep.calls if calls is None else calls:
        results.append([format_value(getattr(env, c.name)(**c.arguments)) for c in turn])
    return results, copy.deepcopy(vars(env))


def _messages(task, calls) -> list[dict]:
    """A conversation that makes ``calls`` (per turn, in one message) and ends each turn."""
    msgs = [dict(m) for m in task.messages()]
    for t, turn in enumerate(calls):
        if t:
            msgs += task.metadata["episode"]["user_turns"][t]
        if turn:
            msgs.append({"role": "assistant", "content": "", "tool_calls": [c.as_openai() for c in turn]})
        msgs.append({"role": "assistant", "content": "Done."})
    return msgs


def _split(backend: str, split: str, size: int, seed: int = 7, **params):
    """A split's tasks from the source, and the episodes behind them by task id."""
    tasks = export_source(f"testbed_tools:{backend}", split=split, size=size, seed=seed, params=params or None)
    sizes = {"train": 0, "probe": 0, "eval": 0, split: size}
    domain = f"tt_{backend}"  # the source's default domain name
    cfg = validate(TasksConfig, {"seed": seed, "domains": {domain: {"source": f"testbed_tools:{backend}",
                                                                     "params": params, "sizes": sizes}}})
    dcfg = cfg.domains[domain]
    eps = {f"{domain}-{e.id}": e for e in split_episodes(backend, params, dcfg.sizes, seed, domain, split)}
    assert set(eps) == {t.id for t in tasks}
    return tasks, eps


@pytest.mark.parametrize("backend", S.BACKENDS)
def test_backends_are_deterministic_and_report_short_errors(backend):
    eps = E.episodes(backend, "train", 30, 1)
    for ep in eps:
        assert _replay(ep) == _replay(ep)  # same config, same calls: same results and state
        env = CLASSES[backend]()
        config = copy.deepcopy(ep.config)
        env.reset(config)
        before = copy.deepcopy(vars(env))
        next(iter(config.values())).clear()  # reset copies its config: the caller's dict is not the state
        assert vars(env) == before
    # through a real environment (worker process): a bad call's short message is its result text
    bad = {"kv": Call("get", {"key": "zzz"}), "ctr": Call("clear", {"name": "zzz"}),
           "files": Call("cat", {"name": "zzz"}),
           "bank": Call("transfer", {"src": "ann", "dst": "ann", "amount": 1})}[backend]
    with Environment(class_world(eps[0].environment, {"accounts": {"ann": 5}})) as env:
        (text,) = env.execute([bad], env.method_names())
    assert text.startswith("Error during execution: ") and len(text) < 60, text


def test_backends_follow_the_contract_and_share_tool_names():
    tools = {b: set(tool_functions(cls)) for b, cls in CLASSES.items()}
    assert all(3 <= len(t) <= 5 for t in tools.values()), tools
    by_name = Counter(name for t in tools.values() for name in t)
    assert by_name["get"] == 2  # KeyValue and Counters: interference by design
    for cls in CLASSES.values():
        for schema in tool_schemas(cls):
            fn = schema["function"]
            params = fn["parameters"]["properties"].values()
            assert fn["description"] and all(p.get("description") and p.get("type") for p in params)
    # every confusable tool named for the variants exists in the other backend
    for spec in intents.SPECS.values():
        for tool, (other, name) in spec.confusable.items():
            assert tool in tools[spec.name] and name in tools[other] and name not in tools[spec.name] - {"get"}


def test_the_generator_is_pure_and_prefix_stable():
    a = E.episodes("kv", "eval", 20, 3)
    assert a == E.episodes("kv", "eval", 20, 3)
    assert E.episodes("kv", "eval", 40, 3)[:20] == a
    assert a != E.episodes("kv", "eval", 20, 4)
    assert [e.id for e in a][:2] == [f"kv-eval-L{a[0].level}-0000", f"kv-eval-L{a[1].level}-0001"]


def test_gold_episodes_verify_to_one_at_every_level():
    levels = Counter()
    for backend in S.BACKENDS:
        tasks, eps = _split(backend, "eval", 64)
        for task in tasks:
            assert task.metadata["level"] == eps[task.id].level and task.metadata["episode"]["render"] == "compact"
            res = verify(gold_messages(task), task)
            assert res.reward == 1.0, (task.id, res.detail)
            levels[(backend, task.metadata["level"])] += 1
    assert set(levels) == {(b, lv) for b in S.BACKENDS for lv in E.LEVELS}


def _word_in(value, text: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(str(value))}(?!\w)", text) is not None


def test_chained_arguments_come_only_from_an_earlier_tool_result():
    n = 0
    for backend in S.BACKENDS:
        for ep in E.episodes(backend, "train", 80, 2) + E.episodes(backend, "eval", 40, 2):
            assert (ep.chained is not None) == E.LEVELS[ep.level][1]
            if ep.chained is None:
                continue
            link = ep.chained
            value = ep.calls[link.turn][link.index].arguments[link.argument]
            results, _ = _replay(ep)
            assert link.source_turn < link.turn
            assert results[link.source_turn][link.source_index] == format_value(value)
            assert not any(_word_in(value, text) for text in ep.turns), (ep.id, value)
            n += 1
    assert n > 150


@pytest.mark.parametrize("rate", [0.0, 0.15, 0.3])
def test_irrelevance_turns_come_at_the_configured_rate(rate):
    turns = [c for b in S.BACKENDS for e in E.episodes(b, "train", 150, 5, irrelevance=rate) for c in e.calls]
    share = sum(not c for c in turns) / len(turns)
    assert abs(share - rate) < 0.03, share
    with pytest.raises(UserError, match="irrelevance"):
        E.episodes("kv", "train", 1, 5, irrelevance=0.5)


def _identity(task) -> str:
    ep = task.metadata["episode"]
    return json.dumps([[t[0]["content"] for t in ep["user_turns"]], ep["config"]], sort_keys=True)


def test_splits_are_disjoint_and_eval_is_held_out():
    cfg = validate(TasksConfig, {"seed": 3, "domains": {
        "a": {"source": "testbed_tools:files", "sizes": {"train": 200, "probe": 30, "eval": 60}},
        "b": {"source": "testbed_tools:files", "params": {"eval_space": "seen", "levels": [1, 2]},
              "sizes": {"train": 100, "probe": 0, "eval": 60}}}})
    splits = {s: build_split(cfg, s) for s in ("train", "probe", "eval")}
    ids = {s: {_identity(t) for t in ts} for s, ts in splits.items()}
    assert not (ids["train"] & ids["eval"]) and not (ids["train"] & ids["probe"]) and not (ids["probe"] & ids["eval"])
    assert {t.domain for t in splits["train"]} == {"a", "b"}  # a domain is one backend: no sub-domain
    assert {t.metadata["level"] for t in splits["train"] if t.domain == "b"} == {1, 2}
    held = sorted(S.HELD_OUT_NAMES)
    for t in splits["train"]:  # no held-out name anywhere in a train episode
        text = json.dumps([t.metadata["episode"]["config"], t.metadata["episode"]["user_turns"], t.answer])
        assert not any(_word_in(x, text) for x in held), t.id
    # the generator's spaces are disjoint by construction, whatever the seeds
    space = {s: E.episodes("files", "x", 150, 1, space=s) for s in S.SPACES}
    for s, eps in space.items():
        assert all(S.space_of(e) == s for e in eps)
        assert all(S.uses_held_out(e) == (s == "held_out") for e in eps)
    assert not any(any(int(f[-1]) == S.HELD_OUT_FORM for f in e.forms) for e in space["train"] + space["seen"])
    assert any(any(int(f[-1]) == S.HELD_OUT_FORM for f in e.forms) for e in space["held_out"])


def test_compact_first_prompts_are_short():
    for backend in S.BACKENDS:
        (task,) = export_source(f"testbed_tools:{backend}", split="eval", size=1, seed=1)
        system, user = task.prompt
        listing = system["content"].split("Tools:\n", 1)[1]
        assert len(listing) < 400 and task.metadata["tools"] == [], listing
        assert len(system["content"]) + len(user["content"]) < 600


def test_alternative_orders_pass_and_unreliable_variants_fail():
    kinds, orders = Counter(), 0
    for backend in S.BACKENDS:
        tasks, eps = _split(backend, "train", 40, seed=11)
        for task in tasks[:14]:
            ep = eps[task.id]
            for alt in V.alternative_orders(ep, limit=1):
                assert alt.calls != ep.calls and alt.variant == "order1"
                assert [Counter(map(Call.key, t)) for t in alt.calls] == [Counter(map(Call.key, t)) for t in ep.calls]
                assert verify(_messages(task, alt.calls), task).reward == 1.0, alt.ground_truth()
                orders += 1
            for v in V.unreliable_variants(ep):
                res = verify(_messages(task, v.calls), task)
                assert res.reward < 1.0, (v.variant, v.ground_truth(), ep.ground_truth())
                kinds[v.variant] += 1
    assert orders >= 10 and set(kinds) == set(V.UNRELIABLE), (orders, kinds)


def test_an_order_that_changes_a_result_is_not_an_alternative(tmp_path):
    """``keys()`` after ``delete`` lists fewer keys than before it: that turn has no other order; two
    puts on different keys commute."""
    put = (Call("put", {"key": "x", "value": "red"}), Call("put", {"key": "y", "value": "blue"}))
    dependent = (Call("delete", {"key": "cat"}), Call("keys", {}))
    ep = S.Episode("kv-x", "kv", 2, {"data": {"cat": "red", "dog": "blue", "sun": "gold"}},
                   ("Put red under x and blue under y.", "Delete cat, then list the keys."), (put, dependent))
    (alt,) = V.alternative_orders(ep)
    assert alt.calls == (put[::-1], dependent)
    assert V.passes(ep, ep.calls) and not V.passes(ep, (put, dependent[::-1]))
    path = tmp_path / "kv.jsonl"
    path.write_text(json.dumps(ep.row()) + "\n")
    (task,) = export_source(f"episodes:{path}", params={"render": "compact"})
    assert verify(_messages(task, alt.calls), task).reward == 1.0
    assert verify(_messages(task, (put, dependent[::-1])), task).reward == 0.0


def test_a_variant_row_gives_its_conversation_with_real_results(tmp_path):
    """The corpus route: a variant's row is an ``episodes:`` row whose ground truth is the variant's
    calls; its gold conversation holds their real results (errors included), and it fails the
    original episode's check. The rows name their class by module, so they load from any directory."""
    pairs = ((e, V.unreliable(e, "foreign_tool")) for e in E.episodes("kv", "train", 50, 9))
    ep, v = next((e, v) for e, v in pairs if v and any(c.name == "rm" for t in v.calls for c in t))
    assert v.row()["id"] == f"{ep.id}.foreign_tool" and v.row()["ground_truth"] != ep.row()["ground_truth"]
    (tmp_path / "sub").mkdir()
    tasks = {}
    for x in (ep, v):  # one file each: a file's rows are deduplicated by turns and config, which they share
        path = tmp_path / "sub" / f"{x.variant}.jsonl"
        path.write_text(json.dumps(x.row()) + "\n")
        for t in export_source(f"episodes:{path}", params={"render": "compact"}):
            tasks[t.id.split("-", 1)[1]] = t
    assert tasks[ep.id].metadata["level"] == ep.level
    msgs = gold_messages(tasks[v.row()["id"]])
    assert any(m["role"] == "tool" and "no function named 'rm'" in m["content"] for m in msgs)
    assert verify(msgs, tasks[ep.id]).reward < 1.0 and verify(gold_messages(tasks[ep.id]), tasks[ep.id]).reward == 1.0


@pytest.mark.parametrize("params,needle", [
    ({"levels": [0, 2]}, "levels"), ({"levels": [3, 2]}, "levels"), ({"irrelevance": -0.1}, "irrelevance"),
    ({"eval_space": "train"}, "eval_space"), ({"colour": 1}, "unknown params"), ({"render": "fancy"}, "render"),
])
def test_bad_params_and_backends_are_one_line_errors(params, needle):
    with pytest.raises(UserError, match=needle):
        export_source("testbed_tools:kv", split="eval", size=1, params=params)
    with pytest.raises(UserError, match="unknown backend"):
        export_source("testbed_tools:shelf", split="eval", size=1)


def test_an_episodes_row_level_must_be_a_non_negative_integer(tmp_path):
    row = E.episodes("bank", "train", 1, 1)[0].row()
    for bad in (-1, "2", True):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({**row, "level": bad}) + "\n")
        with pytest.raises(UserError, match="'level' must be an integer"):
            export_source(f"episodes:{path}")
