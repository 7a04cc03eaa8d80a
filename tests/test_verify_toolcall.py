"""toolcall verifier on the real BFCL v4 possible answers."""

from __future__ import annotations

import json
import random

import pytest

from mlx_ssp.verify import verify
from mlx_ssp.verify.toolcall import parse_calls

pytest.importorskip("bfcl_eval")


def _resolve(v, rng):
    """A concrete value from a possible answer (nested dicts hold allowed-value lists too)."""
    if isinstance(v, dict):
        out = {}
        for k, opts in v.items():
            if not isinstance(opts, list):
                out[k] = opts
                continue
            vals = [o for o in opts if o != ""]
            if vals:
                out[k] = _resolve(rng.choice(vals), rng)
        return out
    if isinstance(v, list):
        return [_resolve(x, rng) for x in v]
    return v


def _render(ground_truth, rng, style):
    calls = []
    for entry in ground_truth:
        (name, params), = entry.items()
        args = {}
        for k, opts in params.items():
            vals = [o for o in opts if o != ""]
            if vals:
                args[k] = _resolve(rng.choice(vals), rng)
        calls.append({"name": name, "arguments": args})
    rng.shuffle(calls)  # parallel calls in any order
    if style == "qwen":
        return "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)
    return "```json\n" + json.dumps(calls) + "\n```"


def _corrupt(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1000
    if isinstance(v, str):
        return v + " zzz wrong"
    if isinstance(v, list):
        return v + ["zzz_extra"]
    if isinstance(v, dict):
        return {**v, "zzz_unexpected": 1}
    return "zzz"


@pytest.mark.parametrize("category", ["simple", "multiple", "parallel"])
def test_bfcl_possible_answers_score_one_and_a_wrong_argument_zero(category):
    from mlx_ssp.tasks.build import export_source

    tasks = export_source(f"bfcl:{category}")
    assert len(tasks) >= 190
    rng = random.Random(0)
    bad, wrong_ok = [], 0
    for t in tasks:
        for style in ("qwen", "json"):
            text = _render(t.answer, rng, style)
            r = verify(text, t)
            if r.reward != 1.0:
                bad.append((t.id, text, r))
        # corrupt one required argument of one call
        text = _render(t.answer, rng, "qwen")
        parsed = parse_calls(text)
        target = next(((i, k) for i, (_, a) in enumerate(parsed) for k in a), None)
        if target is None:
            continue
        i, k = target
        parsed[i][1][k] = _corrupt(parsed[i][1][k])
        text = "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in parsed)
        r = verify(text, t)
        if r.reward != 0.0:
            bad.append((t.id, "corrupted", text, r))
        else:
            wrong_ok += 1
    assert not bad, bad[:5]
    assert wrong_ok >= 190


def test_parse_formats_and_failures():
    from mlx_ssp.tasks import Task

    t = Task(
        id="x", domain="d", prompt="p", verifier="toolcall",
        answer=[{"math.hypot": {"x": [4], "y": [5], "z": ["", 0]}}],
        metadata={"functions": [{"name": "math.hypot", "parameters": {"properties": {"x": {"type": "integer"}, "y": {"type": "integer"}, "z": {"type": "integer"}}}}]},
    )
    assert verify('<tool_call>{"name": "math.hypot", "arguments": {"x": 4, "y": 5}}</tool_call>', t).reward == 1.0
    assert verify('{"name": "math_hypot", "arguments": "{\\"x\\": 4, \\"y\\": 5, \\"z\\": 0}"}', t).reward == 1.0
    assert verify('<think>{"name": "nope"}</think>{"function": {"name": "math.hypot", "parameters": {"x": 4, "y": 5}}}', t).reward == 1.0
    assert verify('<tool_call>{"name": "math.hypot", "arguments": {"x": 4}}</tool_call>', t).reason == "missing_argument"
    assert verify('<tool_call>{"name": "math.hypot", "arguments": {"x": 4, "y": 5, "w": 1}}</tool_call>', t).reason == "unexpected_argument"
    assert verify('<tool_call>{"name": "math.hypot", "arguments": {"x": 4.0, "y": 5}}</tool_call>', t).reason == "wrong_argument"
    assert verify('<tool_call>{"name": "math.hypot", "arguments": {"x": true, "y": 5}}</tool_call>', t).reason == "wrong_argument"
    assert verify('<tool_call>{"name": "other", "arguments": {"x": 4, "y": 5}}</tool_call>', t).reason == "wrong_function"
    assert verify('<tool_call>{"name": "math.hypot", "arguments": {"x": 4</tool_call>', t).reason == "malformed_tool_call"
    assert verify("I don't know", t).reason == "no_tool_call"
    two = '<tool_call>{"name": "math.hypot", "arguments": {"x": 4, "y": 5}}</tool_call>' * 2
    assert verify(two, t).reason == "wrong_call_count"
