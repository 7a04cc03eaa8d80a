"""Validated configuration: one pydantic model per stage, YAML files, ``--set`` overrides.

A run's YAML file has one section per stage (``model``, ``tasks``, ``rollout``, ``select``, ``sft``,
``merge``, ``rl``, ``eval``), two process-wide sections (``distributed``; ``sandbox``, the operator's
bounds on what a code task may ask of the sandbox), ``upload`` (where ``mlx_ssp run`` uploads its
final model) plus a few top-level keys (``run_dir``, ``seed``, ``name``, ``report_to``:
:mod:`mlx_ssp.trackers`). Each stage command reads its own section(s); ``mlx_ssp run`` reads them
all. Precedence: ``--set`` beats the file, which beats the defaults. Unknown keys and bad values
fail at load time with a message naming the file, the dotted key and the valid choices.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_serializer

from mlx_ssp.errors import UserError


class StrictModel(BaseModel):
    """Base for every config model: unknown keys are errors, assignment is validated, and no float
    setting may be NaN or infinite (``.inf``/``.nan`` in YAML: refused at load, naming the key, before
    it reaches a request, a record or a meta file as the non-JSON ``Infinity``/``NaN``).

    ``OMIT_AT_DEFAULT`` names keys added after runs were made with the model: a dump leaves them out
    while they hold their default, so the resolved config (and every fingerprint made from it) of a
    run that does not use them is what it was, and earlier runs resume instead of being redone."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)
    OMIT_AT_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_new_defaults(self, handler):
        data = handler(self)
        if self.OMIT_AT_DEFAULT and isinstance(data, dict):
            fields = type(self).model_fields
            for k in self.OMIT_AT_DEFAULT:
                if k in data and getattr(self, k) == fields[k].get_default(call_default_factory=True):
                    del data[k]
        return data


M = TypeVar("M", bound=BaseModel)

#: section name -> "module:Class". Imported lazily so that a stage's dependencies load only
#: when that stage runs.
SECTIONS: dict[str, str] = {
    "model": "mlx_ssp.models:ModelConfig",
    "teacher": "mlx_ssp.models:ModelConfig",
    "tasks": "mlx_ssp.tasks.config:TasksConfig",
    "rollout": "mlx_ssp.rollout:RolloutConfig",
    "select": "mlx_ssp.select:SelectConfig",
    "eval": "mlx_ssp.eval:EvalConfig",
    "sft": "mlx_ssp.sft:SFTConfig",
    "merge": "mlx_ssp.merge.config:MergeStageConfig",
    "rl": "mlx_ssp.rl.config:RLConfig",
    "distributed": "mlx_ssp.distributed:DistributedConfig",
    "sandbox": "mlx_ssp.sandbox_policy:SandboxPolicy",
    "distill": "mlx_ssp.distill:DistillConfig",
    "upload": "mlx_ssp.hub:UploadConfig",
}
#: Scalar keys allowed at the top of a run file.
TOP_LEVEL = {"run_dir": "directory for every stage's outputs", "seed": "global seed", "name": "run name",
             "report_to": "experiment trackers for the metrics (the names of mlx_ssp.trackers.TRACKERS)"}


def section_model(name: str) -> type[BaseModel]:
    """The config class of a section (imports its module)."""
    try:
        target = SECTIONS[name]
    except KeyError:
        raise UserError(f"unknown config section '{name}'; valid sections: {', '.join(SECTIONS)}") from None
    mod, _, cls = target.partition(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise UserError(f"config section '{name}' is not available in this version ({e})") from None


#: Bounds of the one YAML loader. A config is a few KiB; an "alias bomb" (anchors that refer to
#: anchors, ``a: &a [x, x]``, ``b: &b [*a, *a]``, ...) is a few hundred bytes whose expansion is
#: exponential, and every consumer (``--set``, pydantic, copies) walks it expanded.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 100_000


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes of the document with every alias expanded (memoised, so linear in the node graph);
    stops counting once past ``limit``. A cycle (a node inside its own alias) is infinite."""
    size: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            active.discard(key)
            kids = _children(node)
            size[key] = min(limit + 1, 1 + sum(size[id(c)] for c in kids))
            continue
        if key in size:
            continue
        if key in active:
            return limit + 1
        active.add(key)
        stack.append((node, True))
        for c in _children(node):
            if id(c) in active:
                return limit + 1
            if id(c) not in size:
                stack.append((c, False))
    return size[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for kv in node.value for x in kv]
    return []


class NotYAMLError(UserError):
    """The text does not parse as YAML (as opposed to YAML that is too large)."""


def load_yaml_text(text: str, source: str) -> Any:
    """Parse one YAML document (safe tags only) with the size and alias-expansion bounds above;
    malformed or oversized input is a UserError naming ``source``."""
    return _load_yaml(text, source, every=False)[0]


def load_yaml_documents(text: str, source: str) -> list[Any]:
    """Every document of a YAML stream (``---`` separated; empty ones left out), each under the
    bounds of :func:`load_yaml_text` (the alias bound counts all of them together)."""
    return [d for d in _load_yaml(text, source, every=True) if d is not None]


def _load_yaml(text: str, source: str, *, every: bool) -> list[Any]:
    if len(text) > MAX_YAML_BYTES:
        raise UserError(f"{source}: {len(text)} characters is more than a config may hold ({MAX_YAML_BYTES})")
    loader = yaml.SafeLoader(text)
    try:
        if not every:
            nodes = [loader.get_single_node()]
        else:
            nodes = []
            while loader.check_node():
                nodes.append(loader.get_node())
        budget = MAX_YAML_NODES
        docs = []
        for node in nodes:
            if node is None:
                docs.append(None)
                continue
            size = _expanded_size(node, budget)
            if size > budget:
                raise UserError(
                    f"{source}: the YAML expands to more than {MAX_YAML_NODES} values through its aliases (*name); "
                    "write the values out or use fewer aliases"
                )
            budget -= size
            docs.append(loader.construct_document(node))
        return docs
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise NotYAMLError(f"{source}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    except RecursionError:
        raise UserError(f"{source}: the YAML is nested too deeply") from None
    finally:
        loader.dispose()


def read_config_text(path: str | Path) -> str:
    """A config file's text; a missing, oversized or non-UTF-8 file is a UserError naming it."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {p}")
    if p.stat().st_size > MAX_YAML_BYTES:
        raise UserError(f"{p}: {p.stat().st_size} bytes is more than a config file may hold ({MAX_YAML_BYTES})")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing, malformed, oversized or non-UTF-8 file is a UserError naming
    the file."""
    p = Path(path)
    data = load_yaml_text(read_config_text(p), str(p))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as a YAML scalar/list/mapping)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set expects KEY=VALUE (for example rollout.k=8), got '{item}'")
    try:
        value = load_yaml_text(raw, f"--set {key.strip()}") if raw.strip() else ""
    except NotYAMLError:
        value = raw  # not YAML: the text as is (an oversized or alias-expanding value stays an error)
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        value = float(value)  # YAML 1.1 reads "1e-3" as a string
    return [k for k in key.strip().split(".")], value


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``key=value`` set (dotted keys create mappings)."""
    out = _deepcopy(data)
    for item in overrides or ():
        keys, value = parse_override(item)
        node = out
        for k in keys[:-1]:
            child = node.get(k)
            if child is None or isinstance(child, str) and k in ("model", "teacher"):
                # "model: demo" is shorthand for "model: {path: demo}"; allow model.dtype=... on it
                child = {} if child is None else {"path": child}
                node[k] = child
            if not isinstance(child, dict):
                raise UserError(f"--set {item}: '{k}' is a value, not a section")
            node = child
        node[keys[-1]] = value
    return out


def _deepcopy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deepcopy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deepcopy(v) for v in x]
    return x


def _valid_keys(cls: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the model found by walking ``loc`` (best effort, for error messages)."""
    node: Any = cls
    for part in loc[:-1]:
        if isinstance(part, int):  # a list position: the item's model is already ``node``
            continue
        fields = getattr(node, "model_fields", None)
        if fields is None or part not in fields:
            return []
        # unwrap Optional[X] / X | None / list[X] / dict[str, X], nested (Optional[list[X]])
        todo, node = [fields[part].annotation], None
        while todo and node is None:
            arg = todo.pop(0)
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                node = arg
            todo += list(getattr(arg, "__args__", ()))
        if node is None:
            return []
    fields = getattr(node, "model_fields", None)
    return sorted(fields) if fields else []


def format_validation_error(err: ValidationError, cls: type[BaseModel], source: str, prefix: str = "") -> str:
    """One readable message per problem: ``FILE: key.path: what is wrong (valid: ...)``."""
    lines = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"] if not isinstance(x, str) or not x.startswith("function-"))
        key = ".".join(str(x) for x in ((prefix,) if prefix else ()) + loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(cls, loc)
            msg = f"unknown key '{key}'" + (f"; valid keys: {', '.join(valid)}" if valid else "")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
            msg = f"{key}: {e['msg']}{shown}"
        lines.append(msg)
    head = f"{source}: " if source else ""
    return head + "; ".join(lines)


def validate(cls: type[M], data: Any, *, source: str = "", prefix: str = "") -> M:
    """Build ``cls`` from ``data``; pydantic errors become a UserError naming file and key."""
    try:
        return cls.model_validate({} if data is None else data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, cls, source, prefix)) from None


def check_top_level(data: dict[str, Any], source: str) -> None:
    """Unknown top-level keys are errors that list the sections and keys this version knows."""
    for k in data:
        if k not in SECTIONS and k not in TOP_LEVEL:
            valid = sorted(SECTIONS) + sorted(TOP_LEVEL)
            raise UserError(f"{source}: unknown key '{k}'; valid keys: {', '.join(valid)}")


def load_file(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The raw run file with ``--set`` applied and top-level keys checked (sections unvalidated)."""
    data = read_yaml(path) if path else {}
    data = apply_overrides(data, overrides)
    check_top_level(data, str(path or "--set"))
    return data


def load_section(data: dict[str, Any], name: str, *, source: str = "", cls: type[M] | None = None) -> M:
    """Validate section ``name`` of a run file (missing section -> all defaults)."""
    cls = cls or section_model(name)  # type: ignore[assignment]
    raw = data.get(name)
    if name in ("model", "teacher") and isinstance(raw, str):
        raw = {"path": raw}
    return validate(cls, raw, source=source, prefix=name)  # type: ignore[arg-type]


def plain(cfg: Any) -> Any:
    """A validated section as JSON-ready data (a model's ``model_dump``; anything else as it is):
    what fingerprints hash and what trackers log as parameters."""
    return cfg.model_dump(mode="json") if hasattr(cfg, "model_dump") else cfg


def section_seed(cfg: Any, top: int) -> int:
    """The seed rule: the section's own ``seed`` when it has one and it is set, else ``top``
    (:mod:`mlx_ssp.stage_config` applies it; here so the merge engine uses it without the stage loader)."""
    own = getattr(cfg, "seed", None)
    return own if own is not None else top


def digest(payload: Any) -> str:
    """A short stable hash of JSON-ready data (keys sorted; anything else by ``str``): the
    fingerprint of a pipeline stage or of a multimerge's merge."""
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
