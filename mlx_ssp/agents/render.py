"""How an episode task shows its tools: ``native`` (the JSON schemas, through the chat template's own
``tools`` support or a system message) or ``compact`` (one signature line per tool, for small models).

Compact rendering, a task-source parameter (``render: compact``) for any environment: a short system
header, then one line per tool, ``lockDoors(unlock:bool, door:driver|passenger|rear_left|rear_right)``:
types shortened (``str``, ``int``, ``float``, ``bool``, ``list[str]``, ``dict``), enums inlined as
``a|b``, defaults shown (``unit:g|kg=g``), an optional parameter without a default marked ``?``
(``note?:str``), and the description cut to ``describe`` words after `` - `` (0: none). Calls are
asked for in the python call syntax the parser already reads (``put(label='tea', count=2)``, one per
line), and gold episodes of compact tasks write them so.

What it changes against BFCL's semantics: parameter descriptions and response schemas are not shown,
function descriptions are cut, the call format is python rather than JSON, and results are cut for
the model at ``max_result_chars`` (the checker compares uncut results, as always). Scores on compact
tasks are not BFCL leaderboard scores.
"""

from __future__ import annotations

import json
from typing import Any

from mlx_ssp.errors import UserError

RENDERS = ("native", "compact")
_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "array": "list", "object": "dict",
          "dict": "dict", "float": "float", "tuple": "list", "any": "any"}

COMPACT_HEADER = (
    "You help the user over several turns by calling tools. Call a tool by writing the call on its own "
    "line, e.g. {example}, several calls one per line; you will see their results. When the request is done, "
    "reply in plain text without a call. If no tool can do it, say so instead of calling.\nTools:"
)


#: the task-source params every episode source takes for rendering
PARAMS = ("render", "describe", "max_result_chars")


def check_params(kind: str, params: dict) -> None:
    """``render`` one of :data:`RENDERS`, ``describe`` an int >= 0, ``max_result_chars`` an int >= 1."""
    if params.get("render", "native") not in RENDERS:
        raise UserError(f"source '{kind}': params.render must be one of {', '.join(RENDERS)}")
    for key, low in (("describe", 0), ("max_result_chars", 1)):
        v = params.get(key, low)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise UserError(f"source '{kind}': params.{key} must be an integer >= {low} (got {v!r})")


def apply(prompt_messages: list[dict], tools: list[dict], params: dict) -> tuple[list[dict] | None, list[dict]]:
    """A task's (prompt messages, template tools) under ``params.render``: native leaves both as they
    are (None: the prompt unchanged); compact puts the tools in the system message and gives the
    template none."""
    if params.get("render", "native") != "compact":
        return None, tools
    preamble = next((m["content"] for m in prompt_messages if m.get("role") == "system"), None)
    rest = [m for m in prompt_messages if m.get("role") != "system"]
    system = compact_system(tools, int(params.get("describe", 0)), preamble)
    return [{"role": "system", "content": system}, *rest], []


def _type(schema: dict) -> str:
    if "enum" in schema:
        return "|".join(str(v) for v in schema["enum"])
    t = schema.get("type")
    name = _TYPES.get(t, str(t) if t else "any")
    items = schema.get("items")
    if name == "list" and isinstance(items, dict) and items.get("type"):
        return f"list[{_type(items)}]"
    return name


def _default(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def signature_line(tool: dict, describe: int = 0) -> str:
    """One tool (an OpenAI-style schema, ``{"type": "function", "function": {...}}`` or the function
    object itself) as one compact line."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    parts = []
    for name, schema in props.items():
        schema = schema if isinstance(schema, dict) else {}
        if name in required:
            parts.append(f"{name}:{_type(schema)}")
        elif "default" in schema and schema["default"] is not None:
            parts.append(f"{name}:{_type(schema)}={_default(schema['default'])}")
        else:
            parts.append(f"{name}?:{_type(schema)}")
    line = f"{fn['name']}({', '.join(parts)})"
    words = (fn.get("description") or "").split()
    if describe > 0 and words:
        line += " - " + " ".join(words[:describe]) + ("..." if len(words) > describe else "")
    return line


def _example(tools: list[dict]) -> str:
    """A call of the first tool, its required parameters filled with placeholders of their type."""
    if not tools:
        return "name(arg='value')"
    fn = tools[0].get("function", tools[0])
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    args = []
    for name in params.get("required") or []:
        schema = props.get(name) or {}
        if "enum" in schema:
            args.append(f"{name}={schema['enum'][0]!r}")
        else:
            args.append(f"{name}=" + {"integer": "1", "number": "1.5", "boolean": "True", "array": "[]",
                                      "object": "{}"}.get(schema.get("type"), "'...'"))
    return f"{fn['name']}({', '.join(args)})"


def compact_system(tools: list[dict], describe: int = 0, preamble: str | None = None) -> str:
    """The system prompt of a compact task: ``preamble`` (the episode's own system text), the header
    and one signature line per tool."""
    head = COMPACT_HEADER.format(example=_example(tools))
    lines = [signature_line(t, describe) for t in tools]
    return "\n".join(([preamble, ""] if preamble else []) + [head, *lines])


def compact_listing(tools: list[dict], describe: int = 0) -> str:
    """Signature lines of tools brought in mid-episode (BFCL's held-back functions)."""
    return "New tools you can call:\n" + "\n".join(signature_line(t, describe) for t in tools)
