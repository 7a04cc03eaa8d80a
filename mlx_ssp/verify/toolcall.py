"""``toolcall`` verifier: parse function calls from a completion and check them against BFCL-style
possible answers.

Parsing (after dropping text before the last ``</think>``): every Qwen3/Hermes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block; if there is none, the first JSON
value in the text (optionally in a code fence) that is a call object or a list of call objects. A call
object is ``{"name", "arguments"}`` (``parameters`` accepted as an alias; ``arguments`` may be a JSON
string, OpenAI style; ``{"function": {...}}`` wrappers are unwrapped).

Checking (the task's ``answer`` is the BFCL ground truth: a list of ``{function_name: {param:
[allowed values]}}``, where ``""`` among the allowed values means "may be omitted"):
- the number of calls equals the number of expected calls; calls may come in any order (a perfect
  matching between calls and expected calls is searched);
- the function name matches (a ``.`` in the expected name may be written ``_``, as BFCL allows for
  models whose tool names cannot contain dots);
- no argument outside the expected parameters; every parameter without ``""`` is present;
- every value is one of the allowed values: strings compared case-insensitively ignoring spaces and
  ``,./-_*^`` (BFCL's standardisation), numbers numerically (an int is accepted for a float parameter,
  a float for an integer parameter is not; booleans are never numbers), lists element-wise in order,
  dicts key by key (nested allowed-value lists as in BFCL).

Deviation from BFCL's checker: our own implementation of the same rules (no import of its code, which
drags in its model handlers); parameter types come from ``metadata["functions"]`` when present.

Bounded work (a policy under RL writes whatever makes the verifier slow):
- only the last ``MAX_SCAN_CHARS`` characters after ``</think>`` are read (as in answer extraction);
- ``<tool_call>`` blocks are cut with ``str.find`` (no regex that can backtrack);
- JSON nested deeper than :data:`MAX_JSON_DEPTH` is a malformed call, checked by our own iterative
  bracket scan before ``json`` (whose recursive decoder would raise RecursionError);
- the search for the first JSON value tries only positions where a call can start (``[`` or
  ``{"``), finds each candidate's extent with one memoised bracket scan (a bracket already scanned
  is jumped over) and decodes only that slice (``json``'s error message costs time proportional to
  the position in the text it is given, so decoding at every position of the whole text is
  quadratic); a value that decodes but is not a call is searched for nested calls in its decoded
  tree instead of re-decoding every position inside it. The scan has a total budget of a few
  steps per character; past it the completion is a malformed call;
- calls are matched to expected calls through an index on (function name, argument, value) and an
  iterative augmenting-path search, so a task expecting thousands of calls is scored exactly, in
  time about linear in their number (it was quadratic, and recursive).

Parsing lives in :mod:`mlx_ssp.text.toolcalls` (the agents parse calls the same way). Each step
charges its work to :mod:`mlx_ssp.text.work`, where the tests bound it.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

from mlx_ssp.text.toolcalls import Malformed, parse_calls  # noqa: F401  (parse_calls: re-exported)
from mlx_ssp.text.work import charge
from mlx_ssp.verify import VerifyResult, register

_STD_RE = re.compile(r"[ ,./\-_*^]")
_SMALL_MATCH = 64  # up to this many (call, expected) pairs, matching tries them all without an index

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task


def _std(s: str) -> str:
    return _STD_RE.sub("", s).lower().replace("'", '"')


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def value_matches(value: Any, allowed: Any, ptype: str | None = None) -> bool:
    """``value`` (from the model) equals one allowed value ``allowed`` (from the ground truth)."""
    if isinstance(allowed, bool) or isinstance(value, bool):
        return isinstance(allowed, bool) and isinstance(value, bool) and allowed == value
    if _is_num(allowed):
        if not _is_num(value):
            return False
        if ptype == "integer" and isinstance(value, float):
            return False
        try:
            return float(value) == float(allowed)
        except OverflowError:  # an integer beyond float range: compare exactly
            return value == allowed
    if isinstance(allowed, str):
        return isinstance(value, str) and _std(value) == _std(allowed)
    if isinstance(allowed, list):
        return (
            isinstance(value, list)
            and len(value) == len(allowed)
            and all(value_matches(v, a) for v, a in zip(value, allowed))
        )
    if isinstance(allowed, dict):
        if not isinstance(value, dict) or set(value) - set(allowed):
            return False
        for k, opts in allowed.items():
            opts = opts if isinstance(opts, list) else [opts]
            if k not in value:
                if "" not in opts:
                    return False
            elif not any(value_matches(value[k], o) for o in opts if o != ""):
                return False
        return True
    return value == allowed


def _ptypes(task: "Task", fname: str) -> dict[str, str]:
    for f in task.metadata.get("functions") or []:
        if f.get("name") == fname:
            props = (f.get("parameters") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items()}
    return {}


def call_error(call: tuple[str, dict], expected: dict, task: "Task") -> str | None:
    """Why ``call`` does not satisfy one expected call (``{name: {param: allowed}}``); None if it does."""
    (ename, params), = expected.items()
    name, args = call
    if name != ename and name != ename.replace(".", "_"):
        return f"wrong_function: called {name}, expected {ename}"
    types = _ptypes(task, ename)
    for k in args:
        if k not in params:
            return f"unexpected_argument: {k}"
    for k, opts in params.items():
        opts = opts if isinstance(opts, list) else [opts]
        if k not in args:
            if "" not in opts:
                return f"missing_argument: {k}"
            continue
        if not any(value_matches(args[k], o, types.get(k)) for o in opts if o != ""):
            return f"wrong_argument: {k}={json.dumps(args[k])[:80]}"
    return None


def _value_key(v: Any, ptype: str | None = None) -> tuple:
    """A hashable key that two values share whenever :func:`value_matches` accepts them (the
    converse need not hold): the index that keeps matching near-linear."""
    if isinstance(v, bool):
        return ("b", v)
    if _is_num(v):
        try:
            return ("n", float(v))
        except OverflowError:
            return ("n", math.copysign(math.inf, v))
    if isinstance(v, str):
        return ("s", _std(v))
    if isinstance(v, list):
        return ("l", len(v))
    if isinstance(v, dict):
        return ("d",)
    return ("o", type(v).__name__)


def _candidates(calls: list, expected: list) -> list[list[int]]:
    """For each call, the expected calls it might satisfy (a superset, in order): same function
    name, and for every argument an allowed value with the same :func:`_value_key`."""
    by_name: dict[str, list[int]] = {}
    index: dict[tuple, set[int]] = {}
    for j, e in enumerate(expected):
        (ename, params), = e.items()
        for name in dict.fromkeys((ename, ename.replace(".", "_"))):
            by_name.setdefault(name, []).append(j)
            for k, opts in params.items():
                for o in opts if isinstance(opts, list) else [opts]:
                    if o != "":
                        index.setdefault((name, k, _value_key(o)), set()).add(j)
    out = []
    for name, args in calls:
        pool = by_name.get(name, [])
        if args and pool:
            sets = sorted((index.get((name, k, _value_key(v)), set()) for k, v in args.items()), key=len)
            pool = sorted(set(sets[0]).intersection(*sets[1:]))  # the index is per name already
        charge(1 + len(pool))
        out.append(pool)
    return out


def _keyed_candidates(calls: list, expected: list) -> tuple[list[str], dict[str, list[int]]]:
    """A key per call (identical calls share it) and the candidate list per key."""
    keys = [json.dumps(c, sort_keys=True, default=str) for c in calls]
    charge(sum(map(len, keys)))
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    lists = _candidates([calls[i] for i in first.values()], expected)
    return keys, dict(zip(first, lists))


def _match(calls: list, expected: list, task: "Task") -> tuple[bool, str]:
    """Perfect matching calls <-> expected (any order): Kuhn's augmenting paths, iterative, over the
    pairs the index leaves, each judged once per distinct call by :func:`call_error`. A free
    expected call is taken first, through a pointer per distinct call that only moves forward (an
    expected call, once matched, stays matched), so identical calls cost linear time."""
    if len(calls) * len(expected) <= _SMALL_MATCH:  # the usual few calls: every pair, no index
        keys = [str(i) for i in range(len(calls))]
        every = list(range(len(expected)))
        by_key = dict.fromkeys(keys, every)
    else:
        keys, by_key = _keyed_candidates(calls, expected)
    cands = [by_key[k] for k in keys]
    memo: dict[tuple, bool] = {}  # (call key, expected index) -> whether the call satisfies it
    pointer = dict.fromkeys(by_key, 0)

    def ok(i: int, j: int) -> bool:
        k = (keys[i], j)
        if k not in memo:
            charge(1)
            memo[k] = call_error(calls[i], expected[j], task) is None
        return memo[k]

    owner = [-1] * len(expected)
    for i in range(len(calls)):
        lst, p = cands[i], pointer[keys[i]]
        p0 = p
        while p < len(lst) and (owner[lst[p]] >= 0 or not ok(i, lst[p])):
            p += 1
        charge(1 + p - p0)
        pointer[keys[i]] = p
        if p < len(lst):
            owner[lst[p]] = i
            continue
        if not _augment(i, cands, ok, owner):
            # report the closest miss: the first error for this call against a same-named function
            charge(len(expected))
            errs = [e for e in (call_error(calls[i], e, task) for e in expected) if e is not None]
            same = [e for e in errs if not e.startswith("wrong_function")]
            return False, (same or errs or ["wrong_call"])[0]
    return True, ""


def _augment(start: int, cands: list[list[int]], ok, owner: list[int]) -> bool:
    """Find an augmenting path from call ``start`` (depth-first with an explicit stack) and flip it."""
    seen: set[int] = set()
    stack = [(start, iter(cands[start]))]
    via: list[int] = []  # via[d]: the expected call through which stack[d + 1] was reached
    steps = 0  # charged on the way out
    while stack:
        i, it = stack[-1]
        steps += 1
        for j in it:
            steps += 1
            if j in seen or not ok(i, j):
                continue
            seen.add(j)
            if owner[j] < 0:
                owner[j] = i
                for d in range(len(via) - 1, -1, -1):
                    owner[via[d]] = stack[d][0]
                charge(steps + len(via))
                return True
            via.append(j)
            stack.append((owner[j], iter(cands[owner[j]])))
            break
        else:
            stack.pop()
            if via:
                via.pop()
    charge(steps)
    return False


def _check(task: "Task") -> None:
    gt = task.answer
    if not isinstance(gt, list) or not gt:
        raise ValueError("'answer' must be a non-empty list of {function_name: {param: [allowed values]}}")
    for e in gt:
        if not isinstance(e, dict) or len(e) != 1 or not isinstance(next(iter(e.values())), dict):
            raise ValueError(f"expected call {e!r} is not {{function_name: {{param: [allowed values]}}}}")


@register("toolcall", check=_check)
def verify_toolcall(completion: str, task: "Task") -> VerifyResult:
    try:
        calls = parse_calls(completion)
    except Malformed as e:
        return VerifyResult(0.0, "malformed_tool_call", str(e))
    if not calls:
        return VerifyResult(0.0, "no_tool_call", "")
    expected = task.answer
    shown = ", ".join(n for n, _ in calls)[:200]
    if len(calls) != len(expected):
        return VerifyResult(0.0, "wrong_call_count", f"{len(calls)} calls ({shown}), expected {len(expected)}")
    ok, err = _match(calls, expected, task)
    if ok:
        return VerifyResult(1.0, "correct", shown)
    reason, _, detail = err.partition(": ")
    return VerifyResult(0.0, reason, detail)
