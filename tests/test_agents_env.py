"""The model-free core of multi-turn episodes: call parsing, the per-episode environment over BFCL's backends and the
multi-turn checker (mlx_ssp.agents.calls / backends / checker)."""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import pytest

pytest.importorskip("bfcl_eval")

from mlx_ssp.agents.environment import CallLimits, Environment, bfcl_world  # noqa: E402
from mlx_ssp.agents.bfcl.backends import BACKENDS, function_docs  # noqa: E402
from mlx_ssp.agents.calls import (  # noqa: E402
    Call,
    CallSyntaxError,
    calls_from_message,
    parse_assistant_text,
    parse_ground_truth,
)
from mlx_ssp.agents.checker import EpisodeSpec, score_episode  # noqa: E402
from mlx_ssp.errors import UserError  # noqa: E402


def _data() -> Path:
    import bfcl_eval

    return Path(bfcl_eval.__file__).parent / "data"


def _load(category: str) -> list[tuple[dict, list[list[str]]]]:
    d = _data()
    entries = [json.loads(x) for x in open(d / f"BFCL_v4_multi_turn_{category}.json", encoding="utf-8")]
    gts = {g["id"]: g["ground_truth"] for g in map(json.loads, open(d / "possible_answer" / f"BFCL_v4_multi_turn_{category}.json"))}
    return [(e, gts[e["id"]]) for e in entries]


_CACHE: dict[str, list] = {}


def entries(category: str = "base") -> list[tuple[dict, list[list[str]]]]:
    if category not in _CACHE:
        _CACHE[category] = _load(category)
    return _CACHE[category]


def entry(eid: str) -> tuple[dict, list[list[str]]]:
    cat = eid.rsplit("_", 1)[0].removeprefix("multi_turn_")
    return next(x for x in entries(cat) if x[0]["id"] == eid)


def spec_of(e: dict, gt: list[list[str]], long_context: bool = False) -> EpisodeSpec:
    return EpisodeSpec(bfcl_world(e["initial_config"], e["involved_classes"], long_context), gt)


def gt_turns(gt: list[list[str]]) -> list[list[list[Call]]]:
    """The ground truth as model output: one assistant step per turn."""
    return [[[parse_ground_truth(s) for s in turn]] for turn in gt]


# ---------------------------------------------------------------- ground-truth replay


@pytest.mark.parametrize("category", ["base", "miss_param", "miss_func", "long_context"])
def test_ground_truth_replay_scores_one_on_every_turn_and_leaves_the_task_unchanged(category):
    """Replaying BFCL's possible answers through our environment passes every turn of every entry
    (our backends, seeds and response/state checks agree with BFCL's ground truth), and no run
    writes into the task's initial_config (deep copy in)."""
    failed = []
    for e, gt in entries(category):
        before = json.dumps(e["initial_config"], sort_keys=True)
        v = score_episode(spec_of(e, gt, category == "long_context"), gt_turns(gt))
        if v.reward != 1.0 or v.partial != 1.0 or not all(t.passed for t in v.turns):
            failed.append((e["id"], v.reason))
        assert len(v.turns) == len(gt)
        assert json.dumps(e["initial_config"], sort_keys=True) == before, e["id"]
    assert failed == [], failed[:5]


def test_replay_is_deterministic_and_does_not_touch_the_global_rng():
    """Seeded ids (booking ids, order ids) are the same in two environments, and the global random
    module's state is untouched by running the backends."""
    e, gt = entry("multi_turn_base_180")  # books a flight: the GT cancels the random booking id 3426812
    state = random.getstate()
    runs = []
    for _ in range(2):
        env = Environment(bfcl_world(e["initial_config"], e["involved_classes"]))
        runs.append([env.execute([parse_ground_truth(s) for s in turn], env.method_names()) for turn in gt])
    assert runs[0] == runs[1]
    assert "3426812" in json.dumps(runs[0][1])
    assert random.getstate() == state


def test_step_limit_and_missing_turns_fail_those_turns_only():
    e, gt = entry("multi_turn_base_0")
    v = score_episode(spec_of(e, gt), gt_turns(gt), step_limit_hit={1})
    assert [t.passed for t in v.turns] == [True, False, True, True]
    assert v.turns[1].reason == "step limit" and v.reward == 0.0 and v.partial == 0.75
    assert v.reason.startswith("turn 1: step limit")
    short = score_episode(spec_of(e, gt), gt_turns(gt)[:2])
    assert [t.passed for t in short.turns] == [True, True, False, False]
    assert short.turns[2].reason == "not reached"  # an episode cut short fails the turns it never saw
    with pytest.raises(UserError):
        score_episode(spec_of(e, gt), gt_turns(gt) + [[]])
    assert json.loads(json.dumps(v.to_json()))["turns"][1]["reason"] == "step limit"


def test_from_task_metadata_round_trip_and_errors():
    e, gt = entry("multi_turn_base_0")
    md = {"initial_config": e["initial_config"], "involved_classes": e["involved_classes"], "ground_truth": gt, "long_context": False}
    s = EpisodeSpec.from_task_metadata(md)
    assert s.ground_truth == gt and s.world == bfcl_world(e["initial_config"], e["involved_classes"])
    for bad in ({**md, "involved_classes": ["WebSearchAPI"]}, {**md, "ground_truth": "x"}, {"initial_config": {}}):
        with pytest.raises(UserError):
            EpisodeSpec.from_task_metadata(bad)


# ---------------------------------------------------------------- the checks fail for the right reason


def _with_turn(gt: list[list[str]], t: int, calls: list[str]) -> list[list[list[Call]]]:
    turns = gt_turns(gt)
    turns[t] = [[parse_ground_truth(s) for s in calls]]
    return turns


def test_dropped_read_only_call_fails_response_and_dropped_mkdir_fails_state():
    e, gt = entry("multi_turn_base_0")
    # turn 1 = cd(folder='temp'), grep(...): grep changes nothing, its result is missing
    assert any(s.startswith("grep(") for s in gt[1])
    v = score_episode(spec_of(e, gt), _with_turn(gt, 1, [s for s in gt[1] if not s.startswith("grep(")]))
    t1 = v.turns[1]
    assert not t1.passed and t1.state_ok and not t1.response_ok and t1.reason.startswith("response:")
    assert v.turns[0].passed and v.reward == 0.0
    # turn 0 = cd, mkdir(dir_name='temp'), mv: without mkdir the file is not moved into temp
    v = score_episode(spec_of(e, gt), _with_turn(gt, 0, [s for s in gt[0] if not s.startswith("mkdir(")]))
    t0 = v.turns[0]
    assert not t0.passed and not t0.state_ok and t0.reason.startswith("state: GorillaFileSystem.root")


def test_wrong_argument_fails():
    e, gt = entry("multi_turn_base_0")
    # (pattern='budget' would match the same line: the response check compares results, not arguments)
    wrong = [s.replace("pattern='budget analysis'", "pattern='revenue'") for s in gt[1]]
    assert wrong != gt[1]
    v = score_episode(spec_of(e, gt), _with_turn(gt, 1, wrong))
    assert not v.turns[1].passed and not v.turns[1].response_ok
    wrong0 = [s.replace("dir_name='temp'", "dir_name='tmp'") for s in gt[0]]
    v = score_episode(spec_of(e, gt), _with_turn(gt, 0, wrong0))
    assert not v.turns[0].passed and not v.turns[0].state_ok


def test_extra_state_changing_call_fails_state_and_extra_read_only_call_passes():
    e, gt = entry("multi_turn_base_0")
    v = score_episode(spec_of(e, gt), _with_turn(gt, 1, gt[1] + ["touch(file_name='extra.txt')"]))
    assert not v.turns[1].passed and not v.turns[1].state_ok and v.turns[1].response_ok
    v = score_episode(spec_of(e, gt), _with_turn(gt, 1, ["ls(a=True)"] + gt[1] + ["pwd()"]))
    assert v.turns[1].passed  # the response check is a sub-multiset: extra reads are fine


def test_result_of_an_earlier_turn_counts_for_the_response_check():
    """BFCL's rule: the ground truth's results of a turn may come from the model's earlier turns."""
    e, gt = entry("multi_turn_base_0")
    turns = gt_turns(gt)
    grep = [c for c in turns[1][0] if c.name == "grep"]
    turns[0] = [turns[0][0], [Call("cd", {"folder": "temp"})] + grep, [Call("cd", {"folder": ".."})]]
    turns[1] = [[c for c in turns[1][0] if c.name != "grep"]]
    v = score_episode(spec_of(e, gt), turns)
    assert v.turns[1].passed, v.turns[1].reason


def test_irrelevance_turn_passes_without_state_change_and_fails_with_one():
    e, gt = entry("multi_turn_base_180")
    assert gt[3] == [] and gt[4] == []
    ok = score_episode(spec_of(e, gt), gt_turns(gt))
    assert ok.turns[3].irrelevance and ok.turns[3].passed and ok.reward == 1.0
    read = "get_flight_cost(travel_from='LAX', travel_to='JFK', travel_date='2026-10-12', travel_class='business')"
    v = score_episode(spec_of(e, gt), _with_turn(gt, 3, [read]))
    assert v.turns[3].passed and v.reward == 1.0
    v = score_episode(spec_of(e, gt), _with_turn(gt, 3, ["set_budget_limit(access_token='abc123xyz', budget_limit=1.0)"]))
    t3 = v.turns[3]
    assert t3.irrelevance and not t3.passed and not t3.state_ok and "TravelAPI.budget_limit" in t3.reason


# ---------------------------------------------------------------- isolation of the K samples


def test_two_environments_of_one_task_share_nothing():
    e, _ = entry("multi_turn_base_0")
    cfg = copy.deepcopy(e["initial_config"])
    a = Environment(bfcl_world(e["initial_config"], e["involved_classes"]))
    b = Environment(bfcl_world(e["initial_config"], e["involved_classes"]))
    before = b.state()
    r = a.execute([Call("mkdir", {"dir_name": "new_dir"}), Call("post_tweet", {"content": "hi"})], a.method_names())
    assert not any(x.startswith("Error") for x in r), r
    assert a.state_difference(b).startswith("GorillaFileSystem.root")
    assert b.state_difference(before) == "" and b.state_difference(Environment(bfcl_world(cfg, e["involved_classes"]))) == ""
    assert e["initial_config"] == cfg
    snap = a.state()
    a.execute([Call("touch", {"file_name": "later.txt"})], a.method_names())
    assert a.state_difference(snap) != ""  # state() is a copy, not a view


def test_message_backend_does_not_write_into_the_config():
    """MessageAPI's _load_scenario keeps the config's inbox list: the environment deep-copies in."""
    e = next(x for x, _ in entries() if "MessageAPI" in x["involved_classes"] and "MessageAPI" in x["initial_config"])
    cfg = copy.deepcopy(e["initial_config"])
    env = Environment(bfcl_world(e["initial_config"], e["involved_classes"]))
    r = env.execute([Call("send_message", {"receiver_id": "USR002", "message": "hello"})], env.method_names())
    assert '"sent_status": true' in r[0], r
    assert env.state()["MessageAPI"]["inbox"] != cfg["MessageAPI"]["inbox"]
    assert e["initial_config"] == cfg


# ---------------------------------------------------------------- hostile calls run nothing


def test_hostile_names_and_arguments_run_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x = tmp_path / "X"
    cmd = f"__import__('os').system('touch {x}')"
    e, _ = entry("multi_turn_base_0")  # GorillaFileSystem + TwitterAPI
    env = Environment(bfcl_world(e["initial_config"], e["involved_classes"]))
    fs_only = {n for n in env.method_names() if n not in {"post_tweet", "authenticate_twitter", "comment"}}
    hostile = [
        Call("__import__", {"name": "os"}), Call("eval", {"source": cmd}), Call("exec", {"source": cmd}),
        Call("__class__", {}), Call("_load_scenario", {"scenario": {}}), Call("__init__", {}),
        Call("os.system", {"command": f"touch {x}"}), Call(cmd, {}),
        Call("post_tweet", {"content": cmd}),  # a TwitterAPI method, not offered in this turn
        Call("absolute_value", {"number": -1}),  # MathAPI is not involved
    ]
    results = env.execute(hostile, fs_only)
    assert all(r.startswith("Error during execution: ") for r in results), results
    # as plain data to real methods: stored as text, never run
    data = env.execute([Call("touch", {"file_name": "a.txt"}), Call("echo", {"content": cmd, "file_name": "a.txt"}),
                        Call("cat", {"file_name": "a.txt"})], fs_only)
    assert cmd in data[2]
    env.execute([Call("mkdir", {"dir_name": cmd})], fs_only)  # refused or stored as a name: data either way
    for text in (f"f(x={cmd})", f"ls(a=open('{x}', 'w'))", "[f(x=(lambda: 1)())]", f"[ls(a=True), {cmd}]",
                 f"ls(a=True)\nimport os", "ls(a=[i for i in range(3)])", "ls(a=f'{1}')", "ls(a=x[0])",
                 f"ls(a=True).__class__", f"getattr(ls, '__globals__')(a={cmd})", "ls(**{'a': 1})"):
        with pytest.raises(CallSyntaxError):
            parse_assistant_text(text)
    assert not x.exists() and not (tmp_path / "a.txt").exists()


def test_argument_size_limit_runs_nothing():
    e, _ = entry("multi_turn_base_0")
    env = Environment(bfcl_world(e["initial_config"], e["involved_classes"]), limits=CallLimits(max_argument_chars=100))
    before = env.state()
    r = env.execute([Call("touch", {"file_name": "y" * 200})], env.method_names())
    assert r[0].startswith("Error during execution: ") and "longer than 100" in r[0]
    assert env.state_difference(before) == ""


def test_bad_arguments_are_error_texts_and_bind_names_positionals():
    e, _ = entry("multi_turn_base_0")
    env = Environment(bfcl_world(e["initial_config"], e["involved_classes"]))
    r = env.execute([Call("ls", {"nope": 1}), Call("cd", {}), Call("cd", {"folder": 1, "x": 2})], env.method_names())
    assert all(x.startswith("Error during execution: ") for x in r), r
    c = env.bind(parse_ground_truth("sort('final_report.pdf')"))
    assert c == Call("sort", {"file_name": "final_report.pdf"})
    assert c.as_openai() == {"type": "function", "function": {"name": "sort", "arguments": {"file_name": "final_report.pdf"}}}
    with pytest.raises(ValueError):
        parse_ground_truth("sort('final_report.pdf')").as_openai()


# ---------------------------------------------------------------- limits


def test_a_call_that_holds_the_interpreter_lock_is_stopped_at_its_time_limit():
    # 10**(10**8) is one big-integer computation that never releases the GIL (minutes of CPU): a
    # thread's join timeout could not fire; the worker process is killed instead
    env = Environment(bfcl_world({}, ["MathAPI"]), limits=CallLimits(timeout_s=1.0))
    other = Environment(bfcl_world({}, ["MathAPI"]), limits=CallLimits(timeout_s=1.0))
    pid = env._worker.pid
    cpu0 = time.process_time()
    r = env.execute([Call("power", {"base": 10, "exponent": 10**8}), Call("add", {"a": 1, "b": 2})], env.method_names())
    assert time.process_time() - cpu0 < 10  # this process only waited: the work ran (and died) elsewhere
    assert "power did not finish within 1s" in r[0] and "the environment was stopped" in r[0]
    assert r[1].startswith("Error during execution: the environment is unusable")
    assert env.broken and not env._worker.alive and not _pid_running(pid)
    assert other.execute([Call("add", {"a": 1, "b": 2})], other.method_names()) == ['{"result": 3}']
    other.close()


def test_process_wide_state_a_call_changes_stays_in_its_episode():
    import mpmath

    dps = mpmath.mp.dps
    with Environment(bfcl_world({}, ["MathAPI"])) as env:
        r = env.execute([Call("logarithm", {"value": 2, "base": 10, "precision": 400})], env.method_names())
        assert len(r[0]) > 400  # the high-precision result came back...
    assert mpmath.mp.dps == dps  # ...and this process's mpmath precision is untouched


def test_a_checker_run_with_a_call_over_its_limit_fails_that_turn_and_later_ones_with_the_reason():
    spec = EpisodeSpec(bfcl_world({}, ["MathAPI"]), [["add(a=1, b=2)"], ["add(a=2, b=3)"]])
    turns = [[[Call("power", {"base": 10, "exponent": 10**8})]], [[Call("add", {"a": 2, "b": 3})]]]
    v = score_episode(spec, turns, limits=CallLimits(timeout_s=1.0))
    assert [t.passed for t in v.turns] == [False, False]
    assert all("the model's environment was stopped" in t.reason and "power did not finish" in t.reason for t in v.turns)


def test_environment_workers_are_stopped_on_close():
    e, _ = entry("multi_turn_base_0")
    env = Environment(bfcl_world(e["initial_config"], e["involved_classes"]))
    pid = env._worker.pid
    assert _pid_running(pid)
    env.close()
    assert not _pid_running(pid)
    assert env.execute([Call("ls", {})], {"ls"})[0].startswith("Error during execution: ")


def _pid_running(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is not running
        return f.read().split(") ")[-1][0] != "Z"


def test_huge_result_is_capped_with_a_marker():
    e, _ = entry("multi_turn_base_0")
    env = Environment(bfcl_world(e["initial_config"], e["involved_classes"]), limits=CallLimits(max_result_chars=100))
    env.execute([Call("touch", {"file_name": "big.txt"}), Call("echo", {"content": "z" * 5000, "file_name": "big.txt"})],
                env.method_names())
    shown = env.execute([Call("cat", {"file_name": "big.txt"})], env.method_names())[0]
    full = env.execute_full([Call("cat", {"file_name": "big.txt"})], env.method_names())[0]
    assert shown.startswith(full[:100]) and len(shown) < 200
    assert f"[{len(full) - 100} characters dropped]" in shown


# ---------------------------------------------------------------- parsing


def test_parse_hermes_blocks_after_think():
    text = ('<think>maybe ls(a=True) or <tool_call>{"name": "rm"}</tool_call></think>\n'
            '<tool_call>\n{"name": "ls", "arguments": {"a": true}}\n</tool_call>\n'
            '<tool_call>{"name": "cd", "arguments": "{\\"folder\\": \\"temp\\"}"}</tool_call>')
    assert parse_assistant_text(text) == [Call("ls", {"a": True}), Call("cd", {"folder": "temp"})]
    assert parse_assistant_text("<think>I will call ls(a=True)</think>The folder is empty.") == []
    with pytest.raises(CallSyntaxError):
        parse_assistant_text('<tool_call>{"name": "ls", "arguments": {"a": tru}}</tool_call>')


def test_parse_openai_messages():
    for args in ({"folder": "temp"}, '{"folder": "temp"}'):
        msg = {"role": "assistant", "content": "ignored ls()", "tool_calls": [
            {"type": "function", "function": {"name": "cd", "arguments": args}},
            {"id": "1", "type": "function", "function": {"name": "pwd", "arguments": ""}}]}
        assert calls_from_message(msg) == [Call("cd", {"folder": "temp"}), Call("pwd", {})]
    assert calls_from_message({"role": "assistant", "content": "cd(folder='x')"}) == [Call("cd", {"folder": "x"})]
    assert calls_from_message({"role": "assistant", "content": "All done."}) == []
    for bad in ({"tool_calls": [{"function": {"name": "cd", "arguments": "{nope"}}]},
                {"tool_calls": [{"function": {"arguments": {}}}]},
                {"tool_calls": [{"function": {"name": "cd", "arguments": [1]}}]},
                {"tool_calls": "cd"}, {"tool_calls": [{"function": {"name": "cd", "arguments": {"a": {1, 2}}}}]}):
        with pytest.raises(CallSyntaxError):
            calls_from_message(bad)


def test_parse_python_syntax_and_fences():
    assert parse_ground_truth("sort('final_report.pdf')") == Call("sort", {}, ("final_report.pdf",))
    got = parse_assistant_text("[mv('a.txt', destination='b'), ls(), cd(folder='x', n=-1.5, l=[1, {'k': None}])]")
    assert got == [Call("mv", {"destination": "b"}, ("a.txt",)), Call("ls", {}),
                   Call("cd", {"folder": "x", "n": -1.5, "l": [1, {"k": None}]})]
    fenced = "```python\n[cd(folder='temp'), ls(a=True)]\n```"
    assert parse_assistant_text(fenced) == [Call("cd", {"folder": "temp"}), Call("ls", {"a": True})]
    assert parse_assistant_text("cd(folder='a')\nls()") == [Call("cd", {"folder": "a"}), Call("ls", {})]
    assert parse_assistant_text('```json\n[{"name": "ls", "arguments": {"a": true}}]\n```') == [Call("ls", {"a": True})]
    for prose in ("The file was moved to temp.", "Sure (I can help with that).", "Done: I ran ls(a=True).", ""):
        assert parse_assistant_text(prose) == [], prose
    for attempt in ("[not a call", "{\"answer\": 5}", "ls(a=True", "[1, 2]"):
        with pytest.raises(CallSyntaxError):
            parse_assistant_text(attempt)


def test_call_key_and_python_form_are_canonical():
    a = parse_assistant_text("f(b=1, a='x')")[0]
    b = calls_from_message({"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": "x", "b": 1}'}}]})[0]
    assert a.key() == b.key() and a.key() != Call("f", {"a": "x", "b": 2}).key()
    assert Call("f", {}, ("x",)).key() != Call("f", {}).key()
    for s in ("sort('final_report.pdf')", "mv(source='a', destination=\"b's\")", "f(x=[1, 2.5, True, None])"):
        c = parse_ground_truth(s)
        assert parse_ground_truth(c.as_python()) == c


def test_deep_nesting_and_huge_text_fail_quickly():
    t0 = time.monotonic()
    cases = [
        "f(x=" + "[" * 100_000 + "]" * 100_000 + ")",
        "[" * 1_000_000,
        "ls(a='" + "x" * 100_000 + "')",
        "<tool_call>" + '{"name": "f", "arguments": {"a": ' + "[" * 50_000 + "]" * 50_000 + "}}</tool_call>",
        "f(x=" + "(" * 150 + "1" + ")" * 150 + ", y=" + "[" * 90 + "]" * 90 + ")",
        ", ".join(["f()"] * 1000),
    ]
    for text in cases:
        with pytest.raises(CallSyntaxError):
            parse_assistant_text(text)
    deep_args = '{"a": ' + "[" * 20_000 + "]" * 20_000 + "}"
    with pytest.raises(CallSyntaxError):
        calls_from_message({"tool_calls": [{"function": {"name": "f", "arguments": deep_args}}]})
    assert time.monotonic() - t0 < 5
    assert parse_assistant_text("x" * 200_000) == []  # a long final answer is no call


# ---------------------------------------------------------------- registry and docs


def test_backends_registry_and_docs():
    assert set(BACKENDS) == {"GorillaFileSystem", "MathAPI", "MessageAPI", "TwitterAPI", "TicketAPI",
                             "TradingBot", "TravelAPI", "VehicleControlAPI"}
    assert [b.class_name for b in BACKENDS.values() if b.stateless] == ["MathAPI"]
    assert len({b.short for b in BACKENDS.values()}) == 8
    for name in BACKENDS:
        docs = function_docs(name)
        env = Environment(bfcl_world({}, [name]))
        assert {d["name"] for d in docs} <= env.method_names(), name
        docs[0]["name"] = "changed"
        assert function_docs(name)[0]["name"] != "changed"  # a fresh copy each call
    with pytest.raises(UserError):
        Environment(bfcl_world({}, ["WebSearchAPI"]))


# ---------------------------------------------------------------- the zygote's protocol


def test_an_abandoned_control_request_does_not_shift_later_replies():
    """A request whose reply was never read (an interrupt between send and reply): the next request
    drops it by its id instead of taking it for its own (a reap's 0 taken as a pid would kill pid 0)."""
    from mlx_ssp.agents import worker

    with Environment(bfcl_world({}, ["MathAPI"])) as env:
        z = env._worker._zygote
        with z.lock:
            z.ctrl.sendall(worker._REQUEST.pack(b"reap", 10**9, 0))  # nobody reads its reply
            z.ctrl.sendall(worker._REQUEST.pack(b"junk", 10**9 + 1, 0))  # a malformed request
        with Environment(bfcl_world({}, ["MathAPI"])) as other:
            assert other._worker.pid > 0 and _pid_running(other._worker.pid)
            assert other.execute([Call("add", {"a": 1, "b": 2})], {"add"}) == ['{"result": 3}']
        assert z.usable()


def test_a_finalizer_run_while_the_lock_is_held_does_not_deadlock():
    env = Environment(bfcl_world({}, ["MathAPI"]))
    z, pid = env._worker._zygote, env._worker.pid
    with z.lock:  # as when a garbage collection runs a finalizer in the middle of a request
        env._worker._finalizer()
    z.reap()
    assert not _pid_running(pid)


def test_the_zygote_outlives_the_thread_that_started_it():
    import threading

    from mlx_ssp.agents import worker

    if worker._ZYGOTE:
        worker._ZYGOTE[0].close()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("env", Environment(bfcl_world({}, ["MathAPI"]))))
    t.start()
    t.join()
    time.sleep(0.5)  # a death signal tied to the thread would have fired by now
    env = box["env"]
    assert env.execute([Call("add", {"a": 2, "b": 2})], {"add"}) == ['{"result": 4}']
    env.close()


def test_a_non_finite_number_in_a_call_is_a_syntax_error():
    with pytest.raises(CallSyntaxError, match="not a JSON number"):
        parse_assistant_text('<tool_call>{"name": "add", "arguments": {"a": NaN, "b": 1}}</tool_call>')
