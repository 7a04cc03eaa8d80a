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
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from mlx_ssp.verify import VerifyResult, register
from mlx_ssp.verify.extract import strip_thinking

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task

_TAG_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_STD_RE = re.compile(r"[ ,./\-_*^]")


class Malformed(ValueError):
    pass


def _as_call(obj: Any) -> tuple[str, dict] | None:
    if not isinstance(obj, dict):
        return None
    if "function" in obj and isinstance(obj["function"], dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise Malformed(f"arguments of {name} are not valid JSON") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise Malformed(f"arguments of {name} are not an object")
    return name, args


def parse_calls(completion: str) -> list[tuple[str, dict]]:
    """The tool calls in ``completion`` as ``(name, arguments)``; raises Malformed on broken JSON."""
    text = strip_thinking(completion or "")
    blocks = _TAG_RE.findall(text) if "<tool_call>" in text else []
    calls: list[tuple[str, dict]] = []
    if blocks:
        for b in blocks:
            try:
                obj = json.loads(b)
            except json.JSONDecodeError as e:
                raise Malformed(f"<tool_call> body is not valid JSON ({e.msg})") from None
            objs = obj if isinstance(obj, list) else [obj]
            for o in objs:
                c = _as_call(o)
                if c is None:
                    raise Malformed("<tool_call> body is not a {name, arguments} object")
                calls.append(c)
        return calls
    dec = json.JSONDecoder()
    for m in re.finditer(r"[\[{]", text):
        try:
            obj, _ = dec.raw_decode(text, m.start())
        except json.JSONDecodeError:
            continue
        objs = obj if isinstance(obj, list) else [obj]
        found = [_as_call(o) for o in objs]
        if objs and all(c is not None for c in found):
            return found  # type: ignore[return-value]
    return []


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
        return float(value) == float(allowed)
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


def _match(calls: list, expected: list, task: "Task") -> tuple[bool, str]:
    """Perfect matching calls <-> expected (any order), by augmenting paths."""
    errors = [[call_error(c, e, task) for e in expected] for c in calls]
    owner = [-1] * len(expected)

    def augment(i: int, seen: set[int]) -> bool:
        for j in range(len(expected)):
            if errors[i][j] is None and j not in seen:
                seen.add(j)
                if owner[j] < 0 or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(len(calls)):
        if not augment(i, set()):
            # report the closest miss: the first error for this call against a same-named function
            errs = [e for e in errors[i] if e is not None]
            same = [e for e in errs if not e.startswith("wrong_function")]
            return False, (same or errs or ["wrong_call"])[0]
    return True, ""


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
