"""Tool calls in model text: every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block
after the last ``</think>``, or, if there is none, the first JSON value (optionally in a code fence)
that is a call object or a list of them. A call object is ``{"name", "arguments"}`` (``parameters``
accepted as an alias; ``arguments`` may be a JSON string, OpenAI style; ``{"function": {...}}``
wrappers are unwrapped). The work is bounded as the ``toolcall`` verifier's docstring describes
(:mod:`mlx_ssp.verify.toolcall`), and charged to :mod:`mlx_ssp.text.work`."""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_ssp.text.region import answer_region
from mlx_ssp.text.work import charge, find

_OPEN_TAG, _CLOSE_TAG = "<tool_call>", "</tool_call>"
#: JSON nested deeper than this is a malformed call (BFCL arguments nest a few levels).
MAX_JSON_DEPTH = 32
#: Bracket-scan steps allowed per character of text when searching for the first JSON call.
_SCAN_BUDGET_PER_CHAR = 4
_CANDIDATE_RE = re.compile(r'(?=\[|\{\s*+")')  # a list, or an object that is not empty: what can hold a call
_STRUCT_RE = re.compile(r'["\[\]{}]')
_STRING_TAIL_RE = re.compile(r'(?:[^"\\]++|\\.)*+"', re.DOTALL)  # the rest of a JSON string, closing quote included
_CLOSER = {"[": "]", "{": "}"}


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


def _tag_blocks(text: str) -> list[str]:
    """Bodies of ``<tool_call>...</tool_call>`` blocks, stripped; an unclosed last block runs to the
    end of the text."""
    blocks = []
    i = find(text, _OPEN_TAG)
    while i >= 0:
        start = i + len(_OPEN_TAG)
        end = find(text, _CLOSE_TAG, start)
        blocks.append(text[start:end if end >= 0 else len(text)].strip())
        charge(len(blocks[-1]))
        if end < 0:
            break
        i = find(text, _OPEN_TAG, end + len(_CLOSE_TAG))
    return blocks


class _Scanner:
    """Extents of JSON values by their brackets and strings, without decoding. ``end(p)`` is where
    the value opened at ``p`` closes (None: it never closes, or a bracket closes the wrong kind).
    Bracket ends are memoised by position: from a bracket outside any string the scan is the same
    whoever started it, so a later scan jumps over a bracket already closed."""

    def __init__(self, text: str):
        self.text = text
        self.memo: dict[int, tuple[int, int] | None] = {}  # open bracket -> (end, depth) or None
        self.budget = _SCAN_BUDGET_PER_CHAR * len(text) + 1000

    def end(self, p: int) -> int | None:
        text, memo = self.text, self.memo
        if p in memo:
            known = memo[p]
            return None if known is None else known[0]
        stack: list[list[int]] = []  # [open position, depth below it]
        i = p
        while True:
            self.budget -= 1
            if self.budget < 0:
                raise Malformed("the JSON in the completion is too convoluted to search")
            m = _STRUCT_RE.search(text, i)
            if m is None:
                charge(len(text) - i)
                break
            c, j = m.group(), m.start()
            charge(j + 1 - i)
            if c == '"':
                s = _STRING_TAIL_RE.match(text, j + 1)
                if s is None:
                    charge(len(text) - j)
                    break
                charge(s.end() - j)
                i = s.end()
                continue
            if c in _CLOSER:
                known = memo.get(j, False)
                if known is None:
                    break
                if known:
                    if len(stack) + known[1] > MAX_JSON_DEPTH:
                        raise Malformed(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
                    stack[-1][1] = max(stack[-1][1], known[1])
                    i = known[0]
                    continue
                stack.append([j, 0])
                if len(stack) > MAX_JSON_DEPTH:
                    raise Malformed(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
                i = j + 1
                continue
            o, below = stack.pop()
            if _CLOSER[text[o]] != c:
                stack.append([o, below])
                break
            memo[o] = (j + 1, below + 1)
            if not stack:
                return j + 1
            stack[-1][1] = max(stack[-1][1], below + 1)
            i = j + 1
        for o, _ in stack:  # every bracket still open here fails from its own start too
            memo[o] = None
        return None


def _loads(body: str, what: str) -> Any:
    """``json.loads`` of a ``<tool_call>`` body, with its nesting checked first."""
    charge(3 * len(body))  # the bracket counts and the decoding
    if body[:1] in _CLOSER and body.count("[") + body.count("{") > MAX_JSON_DEPTH:
        _Scanner(body).end(0)  # raises Malformed when nested too deep; json reports any other error
    try:
        return json.loads(body)
    except ValueError as e:  # JSONDecodeError, or an integer too long to convert
        raise Malformed(f"{what} is not valid JSON ({getattr(e, 'msg', e)})") from None


def _calls_in(obj: Any) -> list[tuple[str, dict]] | None:
    """``obj`` as a call or a list of calls, else None (raises Malformed on broken arguments)."""
    objs = obj if isinstance(obj, list) else [obj]
    found = [_as_call(o) for o in objs]
    return found if objs and all(c is not None for c in found) else None  # type: ignore[return-value]


def _nested_calls(obj: Any) -> list[tuple[str, dict]] | None:
    """The first container strictly inside ``obj``, in text order, that is a call or a list of
    calls: what decoding at each position inside ``obj``'s text would find."""
    stack = [iter(obj.values() if isinstance(obj, dict) else obj)]
    while stack:
        child = next(stack[-1], stack)
        if child is stack:
            stack.pop()
            continue
        if isinstance(child, (dict, list)):
            calls = _calls_in(child)
            if calls is not None:
                return calls
            stack.append(iter(child.values() if isinstance(child, dict) else child))
    return None


def _first_json_calls(text: str) -> list[tuple[str, dict]]:
    """The first JSON value in ``text`` that is a call or a list of calls (see the module docstring
    for how the search is bounded)."""
    scan = _Scanner(text)
    covered = -1  # candidates before this position lie inside a value already searched
    charge(len(text))  # the candidates, in one pass
    for m in _CANDIDATE_RE.finditer(text):
        p = m.start()
        if p < covered:
            continue
        end = scan.end(p)
        if end is None or find(text, "{", p, end) < 0:  # unclosed, or a list with no object inside
            continue
        charge(end - p)  # the decoding
        try:
            obj = json.loads(text[p:end])
        except ValueError:
            continue
        calls = _calls_in(obj)
        if calls is None:
            calls = _nested_calls(obj)
        if calls is not None:
            return calls
        covered = end
    return []


def parse_calls(completion: str) -> list[tuple[str, dict]]:
    """The tool calls in ``completion`` as ``(name, arguments)``; raises Malformed on broken JSON."""
    text = answer_region(completion or "")
    blocks = _tag_blocks(text) if _OPEN_TAG in text else []
    calls: list[tuple[str, dict]] = []
    if blocks:
        for b in blocks:
            obj = _loads(b, "<tool_call> body")
            objs = obj if isinstance(obj, list) else [obj]
            for o in objs:
                c = _as_call(o)
                if c is None:
                    raise Malformed("<tool_call> body is not a {name, arguments} object")
                calls.append(c)
        return calls
    return _first_json_calls(text)
