"""A model's message -> :class:`Call` data: a function name and literal arguments, never code.

Algorithm (:func:`parse_assistant_text`), on the text after the last ``</think>``:
1. Is it a call attempt? Yes when it holds a ``<tool_call>`` tag, or its stripped form (the body of a
   whole-message ```` ``` ```` fence, if it is one) starts with ``[`` or ``{``, or starts with a name
   directly followed by ``(`` (``f(...)``, ``a.b(...)``). ``name (`` with a space is a call attempt
   only if it parses: "Sure (I can help)" is prose. Anything else is a final answer: ``[]``.
2. ``<tool_call>`` blocks and JSON call objects go through :func:`mlx_ssp.verify.toolcall.parse_calls`
   (bounded JSON, Qwen3/Hermes and OpenAI shapes).
3. BFCL's python syntax (``[f(a=1, b='x'), g()]``, ``f(a=1)``, one call per line, ``f(), g()``) goes
   through ``ast.parse``; each call's function must be a name or a dotted name and each argument a
   literal (``ast.literal_eval`` on the argument node alone). A name, attribute, call, lambda,
   subscript, comprehension or f-string inside an argument is a :class:`CallSyntaxError`; nothing is
   evaluated.
4. A call attempt that yields no call is a :class:`CallSyntaxError`: its message is what the model is
   shown as the tool's error.

Bounds (a policy under RL writes whatever is slow to parse): a call attempt longer than
:data:`MAX_TEXT_CHARS` and more than :data:`MAX_CALLS` calls in one message are errors; the parser's
own nesting limit (SyntaxError), RecursionError and MemoryError become CallSyntaxError; values are
checked to be JSON-like literals by an iterative walk with a depth cap.

Deviations from BFCL's decoder: BFCL wraps any text in ``[...]`` and ``eval``s the calls later; we
parse only literal arguments, accept JSON/Hermes calls in the same message type, accept tuples (as
``ast`` literals) but reject sets, bytes and complex numbers (not JSON-like).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from mlx_ssp.text.toolcalls import Malformed, parse_calls

#: A call attempt longer than this (after ``</think>``) is an error, not parsed.
MAX_TEXT_CHARS = 64 * 1024
#: More calls than this in one assistant message is an error (each one runs against the backends).
MAX_CALLS = 256
#: Argument values nested deeper than this are not JSON-like data.
MAX_VALUE_DEPTH = 64

_THINK_END = "</think>"
_TAG = "<tool_call>"
_CALL_START_RE = re.compile(r"[A-Za-z_][\w.]*\(")  # name( : a call attempt
_LOOSE_START_RE = re.compile(r"[A-Za-z_]\w*\s+\(")  # name ( : a call only if it parses
_FENCE = "```"
_LITERAL_TYPES = (str, int, float, bool, type(None))


class CallSyntaxError(ValueError):
    """The text tried to call and failed; the message is shown to the model as the tool's error."""


def _check_value(value: Any, where: str) -> None:
    """Raise unless ``value`` is JSON-like data (str/int/float/bool/None/list/tuple/dict with str
    keys), walked iteratively so depth is bounded without recursion."""
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if d > MAX_VALUE_DEPTH:
            raise CallSyntaxError(f"{where}: value nested deeper than {MAX_VALUE_DEPTH} levels")
        if isinstance(v, float) and not math.isfinite(v):
            raise CallSyntaxError(f"{where}: {v} is not a JSON number")
        if isinstance(v, _LITERAL_TYPES):
            continue
        if isinstance(v, (list, tuple)):
            stack.extend((x, d + 1) for x in v)
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise CallSyntaxError(f"{where}: dictionary keys must be strings, got {type(k).__name__}")
                stack.append((x, d + 1))
        else:
            raise CallSyntaxError(f"{where}: {type(v).__name__} is not a JSON-like value")


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)


@dataclass(frozen=True)
class Call:
    """One function call as data. ``positional`` holds BFCL ground truth's positional arguments
    (``sort('final_report.pdf')``) until :meth:`~mlx_ssp.agents.environment.Environment.bind` names them."""

    name: str
    arguments: dict = field(default_factory=dict)
    positional: tuple = ()

    def key(self) -> str:
        """Canonical form: equal keys = the same call (distinct strategies = distinct call sequences)."""
        k = self.name + _canon(self.arguments)
        return k + _canon(list(self.positional)) if self.positional else k

    def as_python(self) -> str:
        parts = [repr(v) for v in self.positional] + [f"{k}={v!r}" for k, v in self.arguments.items()]
        return f"{self.name}({', '.join(parts)})"

    def as_openai(self) -> dict:
        if self.positional:
            # OpenAI calls have only named arguments: the environment knows the names (Environment.bind)
            raise ValueError(f"{self.as_python()} has positional arguments: bind it to its signature first")
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}


def _make_call(name: Any, args: Any, positional: tuple = ()) -> Call:
    if not isinstance(name, str) or not name:
        raise CallSyntaxError("a call needs a function name (a string)")
    if not isinstance(args, dict):
        raise CallSyntaxError(f"arguments of {name} are not an object")
    _check_value(args, f"arguments of {name}")
    _check_value(list(positional), f"arguments of {name}")
    # tuples (python syntax) become lists, as a JSON round trip of the recorded message makes them:
    # the live episode and a later re-verification must run the same values
    return Call(name, _lists(dict(args)), tuple(_lists(list(positional))))


def _lists(v: Any) -> Any:
    """``v`` with every tuple made a list (depth is bounded by :func:`_check_value`)."""
    if isinstance(v, (list, tuple)):
        return [_lists(x) for x in v]
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return v


# ---------------------------------------------------------------- python syntax (ast, literals only)


def _func_name(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise CallSyntaxError("the function of a call must be a name")
    parts.append(node.id)
    return ".".join(reversed(parts))


def _literal(node: ast.expr, fname: str) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, OverflowError):
        raise CallSyntaxError(
            f"arguments of {fname} must be literal values (strings, numbers, booleans, None, lists, dicts); "
            f"got {type(node).__name__}"
        ) from None
    return value


def _call_from_node(node: ast.expr) -> Call:
    if not isinstance(node, ast.Call):
        raise CallSyntaxError(f"expected a function call, got {type(node).__name__}")
    name = _func_name(node.func)
    positional = []
    for a in node.args:
        if isinstance(a, ast.Starred):
            raise CallSyntaxError(f"*arguments are not allowed in a call to {name}")
        positional.append(_literal(a, name))
    kwargs: dict = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise CallSyntaxError(f"**arguments are not allowed in a call to {name}")
        if kw.arg in kwargs:
            raise CallSyntaxError(f"argument {kw.arg} given twice in a call to {name}")
        kwargs[kw.arg] = _literal(kw.value, name)
    return _make_call(name, kwargs, tuple(positional))


def _parse_python(text: str) -> list[Call]:
    """Calls written in python syntax: a list/tuple of calls, or call statements (one per line)."""
    try:
        tree = ast.parse(text, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        msg = getattr(e, "msg", None) or type(e).__name__
        raise CallSyntaxError(f"could not parse the function call(s): {msg}") from None
    nodes: list[ast.expr] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            raise CallSyntaxError(f"expected function calls, got a {type(stmt).__name__} statement")
        v = stmt.value
        nodes.extend(v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v])
        if len(nodes) > MAX_CALLS:
            raise CallSyntaxError(f"more than {MAX_CALLS} calls in one message")
    return [_call_from_node(n) for n in nodes]


# ---------------------------------------------------------------- JSON / Hermes (verify.toolcall)


def _parse_json(text: str) -> list[Call]:
    try:
        found = parse_calls(text)
    except Malformed as e:
        raise CallSyntaxError(str(e)) from None
    except (RecursionError, MemoryError):
        raise CallSyntaxError("the JSON call is nested too deeply") from None
    if len(found) > MAX_CALLS:
        raise CallSyntaxError(f"more than {MAX_CALLS} calls in one message")
    return [_make_call(n, a) for n, a in found]


def _unfence(s: str) -> str:
    """The body of a message that is one ``` fence (language tag dropped), else ``s``."""
    if not (s.startswith(_FENCE) and s.endswith(_FENCE) and len(s) >= 2 * len(_FENCE)):
        return s
    body = s[len(_FENCE):-len(_FENCE)]
    nl = body.find("\n")
    if nl >= 0 and re.fullmatch(r"[\w+-]*", body[:nl].strip()):  # ```python / ```json / ```
        body = body[nl + 1:]
    return body.strip()


def parse_assistant_text(text: str) -> list[Call]:
    """Calls in one assistant message; ``[]`` = no call (a final answer). See the module docstring."""
    text = text or ""
    i = text.rfind(_THINK_END)
    region = text[i + len(_THINK_END):] if i >= 0 else text
    if _TAG in region:
        if len(region) > MAX_TEXT_CHARS:
            raise CallSyntaxError(f"the tool call text is longer than {MAX_TEXT_CHARS} characters")
        calls = _parse_json(region)
        if not calls:
            raise CallSyntaxError("<tool_call> holds no call")
        return calls
    s = _unfence(region.strip())
    if len(s) > MAX_TEXT_CHARS:  # only a call attempt is an error; a long final answer is fine
        if s[:1] in "[{" or _CALL_START_RE.match(s):
            raise CallSyntaxError(f"the tool call text is longer than {MAX_TEXT_CHARS} characters")
        return []
    if s[:1] == "{":
        calls = _parse_json(s)
        if not calls:
            raise CallSyntaxError('expected a {"name": ..., "arguments": {...}} call object')
        return calls
    if s[:1] == "[":
        try:
            return _parse_python(s)
        except CallSyntaxError as py_err:
            calls = _parse_json(s)  # a JSON list of call objects (true/null are not python)
            if calls:
                return calls
            raise py_err from None
    if _CALL_START_RE.match(s):
        return _parse_python(s)
    if _LOOSE_START_RE.match(s):
        try:
            return _parse_python(s)
        except CallSyntaxError:
            return []  # "Sure (I can help)": prose
    return []


def _arguments_of(name: str, raw: Any) -> dict:
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str):
        if len(raw) > MAX_TEXT_CHARS:
            raise CallSyntaxError(f"arguments of {name} are longer than {MAX_TEXT_CHARS} characters")
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            raise CallSyntaxError(f"arguments of {name} are not valid JSON") from None
    return raw


def calls_from_message(msg: dict) -> list[Call]:
    """Calls of an OpenAI-format assistant message: its ``tool_calls`` when present (content ignored
    then), else :func:`parse_assistant_text` of its content."""
    if not isinstance(msg, dict):
        raise CallSyntaxError("an assistant message must be an object")
    tcs = msg.get("tool_calls")
    if tcs:
        if not isinstance(tcs, list):
            raise CallSyntaxError("tool_calls must be a list")
        if len(tcs) > MAX_CALLS:
            raise CallSyntaxError(f"more than {MAX_CALLS} calls in one message")
        out = []
        for tc in tcs:
            if not isinstance(tc, dict) or tc.get("type", "function") != "function":
                raise CallSyntaxError('each tool call must be {"type": "function", "function": {...}}')
            fn = tc.get("function")
            if not isinstance(fn, dict):
                raise CallSyntaxError('a tool call needs a "function" object')
            name = fn.get("name")
            out.append(_make_call(name, _arguments_of(str(name), fn.get("arguments"))))
        return out
    content = msg.get("content")
    if content is None:
        return []
    if isinstance(content, list):  # content parts: the text ones, in order
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(content, str):
        raise CallSyntaxError("message content must be text")
    return parse_assistant_text(content)


def parse_ground_truth(call: str) -> Call:
    """One BFCL possible-answer string (``"mv(source='a', destination='b')"``) as a :class:`Call`."""
    calls = _parse_python(call.strip())
    if len(calls) != 1:
        raise CallSyntaxError(f"expected one ground-truth call, got {len(calls)} in {call[:80]!r}")
    return calls[0]
