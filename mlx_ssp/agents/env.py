"""The environment contract: any Python class is a multi-turn tool environment.

A class named ``path/to/file.py:Class`` (relative to the task file) or ``package.module:Class``:

- constructed with no arguments; ``reset(self, config: dict)`` sets its state from the task's
  ``config``;
- its **tools** are its public methods other than ``reset`` and ``reward``; a name starting with
  ``_`` is never callable. A tool's JSON schema comes from its signature (type hints ``str``, ``int``,
  ``float``, ``bool``, ``list[...]``, ``dict``, ``Literal[...]`` as an enum, ``Optional[...]``;
  a default makes a parameter optional) and its docstring (the first paragraph is the description;
  a Google-style ``Args:`` block gives the parameters' descriptions);
- a tool's return value is the result shown to the model (a ``str`` as is, anything else as JSON,
  ``str()`` when it is not JSON-serialisable); an exception's message is returned as the tool's
  error text, as in BFCL;
- the optional ``reward(self) -> float`` in [0, 1], read after the last turn, is the episode's reward
  for tasks without ground truth. With ground truth the checker judges each turn by BFCL's rules:
  the state (every public attribute) equals a twin's that replayed the ground-truth calls, and the
  twin's results are among the model's (:mod:`mlx_ssp.agents.checker`).

The same contract holds TRL's ``environment_factory`` classes (public methods as tools, ``reset``)
and inductive-mlxrl's environments, with one difference that matters for training: here the
environment never sees the model, only calls, and every call runs in the episode's own worker
process (:mod:`mlx_ssp.agents.worker`) under a time and memory limit.

BFCL's backends are one environment behind this contract (:mod:`mlx_ssp.agents.bfcl`): an adapter
whose tools are the involved classes' methods and whose schemas are BFCL's own JSON docs.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from mlx_ssp.agents.worker import Built
from mlx_ssp.errors import UserError

RESERVED = ("reset", "reward")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


# ------------------------------------------------------------------ naming and loading a class


def resolve_ref(ref: str, base_dir: Path | None) -> str:
    """``ref`` with a file path made absolute (relative to ``base_dir``, the task file's directory), so
    a task record names its class wherever it is read from. ``package.module:Class`` is unchanged."""
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
        raise UserError(f"environment {ref!r}: expected 'path/to/file.py:Class' or 'package.module:Class'")
    where, cls = ref.split(":")
    if not where.endswith(".py"):
        return ref
    path = Path(where).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        raise UserError(f"environment {ref!r}: no file {path}")
    return f"{path}:{cls}"


def load_class(ref: str) -> type:
    """The class an absolute ``file.py:Class`` or ``package.module:Class`` names."""
    where, name = ref.split(":")
    if where.endswith(".py"):
        # the file's own directory importable, as when it runs as a script: it may import its neighbours
        if str(Path(where).parent) not in sys.path:
            sys.path.append(str(Path(where).parent))
        # one module per file path: two task files naming one environment share it
        mod_name = "mlx_ssp_env_" + hashlib.sha1(where.encode()).hexdigest()[:12]
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, where)
            if spec is None or spec.loader is None:
                raise UserError(f"environment {ref!r}: cannot import {where}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[mod_name]
                raise UserError(f"environment {ref!r}: importing {where} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise UserError(f"environment {ref!r}: {e}") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise UserError(f"environment {ref!r}: {where} has no class {name}")
    if not callable(getattr(cls, "reset", None)):
        raise UserError(f"environment {ref!r}: the class needs a reset(self, config) method")
    return cls


def tool_functions(cls: type) -> dict[str, Any]:
    """The class's tools by name: its public methods (plain, static or class methods, inherited
    ones included) other than ``reset`` and ``reward``, as the attribute an instance would call
    (a plain method still unbound, so its signature starts with ``self``)."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") or name in RESERVED:
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
            out[name] = getattr(cls, name)
    return out


def _call_parameters(cls: type, name: str, fn: Any) -> list[inspect.Parameter]:
    """The parameters a call passes (without ``self``; a class method's ``cls`` is bound already)."""
    params = list(inspect.signature(fn).parameters.values())
    return params[1:] if inspect.isfunction(inspect.getattr_static(cls, name)) else params


def build_class(ref: str, config: dict) -> Built:
    """A fresh instance, reset to ``config`` (runs in the environment's worker process)."""
    cls = load_class(ref)
    try:
        inst = cls()
        inst.reset(config)
    except Exception as e:
        raise UserError(f"environment {ref!r}: {cls.__name__}() or reset(config) failed: {type(e).__name__}: {e}") from None
    reward = getattr(inst, "reward", None)
    return Built({cls.__name__: inst}, {name: getattr(inst, name) for name in tool_functions(cls)},
                 reward if callable(reward) else None)


def format_value(value: Any) -> str:
    """A tool's return value as the model sees it: a ``str`` as is, anything else as JSON (``str()``
    when it is not JSON-serialisable)."""
    if type(value) is str:
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return str(value)


# ------------------------------------------------------------------ schemas


def _param_schema(hint: Any) -> tuple[dict, bool]:
    """(JSON schema of a type hint, whether it admits None)."""
    if hint is inspect.Parameter.empty or hint is Any:
        return {}, False
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        schema: dict = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _JSON_TYPES:
            schema = {"type": _JSON_TYPES[next(iter(kinds))], **schema}
        return schema, False
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner, _ = _param_schema(rest[0]) if len(rest) == 1 else ({}, False)
        return inner, len(rest) < len(args)
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple):
        schema = {"type": "array"}
        if args and args[0] is not Ellipsis:
            item, _ = _param_schema(args[0])
            if item:
                schema["items"] = item
        return schema, False
    if origin is dict or hint is dict:
        return {"type": "object"}, False
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}, False
    return {}, False


_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")
# Google-style section names: a description line that merely ends in a colon is not one
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns?|Yields?|Raises|Examples?|Notes?|Attributes|"
                      r"Warnings?|See Also|Todo|References)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s*\*{0,2}(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description: the first paragraph, {parameter: description} from a Google-style ``Args:``)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    desc: list[str] = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line) or _SECTION.match(line):
            break
        desc.append(line.strip())
    params: dict[str, str] = {}
    in_args, current, indent = False, None, None
    for line in lines:
        if _ARGS_HEADER.match(line):
            in_args, current = True, None
            continue
        if not in_args:
            continue
        if _SECTION.match(line) and not line.startswith((" ", "\t")):
            break
        if not line.strip():
            continue
        lead = len(line) - len(line.lstrip())
        m = _ARG_LINE.match(line)
        if m and (indent is None or lead <= indent):
            indent, current = lead, m.group(1)
            params[current] = m.group(3).strip()
        elif current is not None:
            params[current] = (params[current] + " " + line.strip()).strip()
    return " ".join(desc), params


def _hints(fn: Any) -> dict[str, Any]:
    """The function's resolved type hints; when one does not resolve (a forward reference to nothing),
    those that are not strings, so one bad hint loses only the string ones."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - NameError, TypeError... from the environment's own annotations
        return {k: v for k, v in getattr(fn, "__annotations__", {}).items() if not isinstance(v, str)}


def tool_schema(name: str, fn: Any, cls: type | None = None) -> dict:
    """One tool's OpenAI-style schema from its signature and docstring (``cls``: the class it is
    looked up on, which tells a plain method, whose ``self`` is dropped, from a static one)."""
    description, arg_docs = parse_docstring(fn.__doc__)
    hints = _hints(fn)
    properties, required = {}, []
    params = _call_parameters(cls, name, fn) if cls is not None else list(inspect.signature(fn).parameters.values())[1:]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        schema, _ = _param_schema(hints.get(p.name, inspect.Parameter.empty))
        if p.name in arg_docs:
            schema = {**schema, "description": arg_docs[p.name]}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)  # Optional[...] without a default still must be passed
        elif p.default is not None:
            try:
                json.dumps(p.default, allow_nan=False)
            except (TypeError, ValueError):
                raise UserError(f"tool {name}: the default of {p.name} ({p.default!r}) is not JSON; "
                                "use None, a number, a string, a bool, a list or a dict") from None
            schema = {**schema, "default": p.default}
        properties[p.name] = schema
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }}


def tool_schemas(cls: type) -> list[dict]:
    """Every tool's schema, in name order."""
    return [tool_schema(name, fn, cls) for name, fn in sorted(tool_functions(cls).items())]
