"""``episodes:PATH.jsonl``: multi-turn episodes on any environment class (:mod:`mlx_ssp.agents.env`).

One episode per line::

    {"id": "kv-1", "environment": "envs/kv.py:KeyValueStore", "config": {"a": "1"},
     "turns": ["Store 2 under b.", "What is under a?"],
     "ground_truth": [["put(key='b', value='2')"], ["get(key='a')"]],
     "domain": "kv", "system": "You manage a key-value store."}

``environment`` is ``file.py:Class`` (relative to the task file) or ``package.module:Class``;
``config`` goes to ``reset(config)``; ``turns`` are the user messages; ``ground_truth`` (optional:
without it the environment's ``reward()`` scores the episode) is BFCL's call syntax per turn;
``domain`` (default: the class name) becomes the task's sub-domain, as BFCL's backends do;
``system`` (optional) is the episode's own system prompt; ``level`` (optional, an integer >= 0: a
generator's difficulty) goes to the task's ``metadata.level`` for calibration. Every tool of the
class is offered, its schema read from its signature and docstring. A bad line fails at load naming
the file, the line and the key.

``params``: ``reward`` (``accuracy``: 1 iff every turn passes, default; ``partial``: the fraction
passed), ``max_steps`` (messages per turn that try to call; default 20, BFCL's), ``call_timeout_s``
(each call's time limit, default 5), ``max_result_chars`` (what a result shown to the model is cut
at; the checker compares uncut results), ``render`` (``native`` or ``compact``) and ``describe``
(compact: words of each tool's description shown; :mod:`mlx_ssp.agents.render`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_ssp.agents import render
from mlx_ssp.agents.calls import CallSyntaxError, parse_ground_truth
from mlx_ssp.agents.env import load_class, resolve_ref, tool_schemas
from mlx_ssp.agents.environment import MAX_STEPS, RESULT_CHARS
from mlx_ssp.errors import UserError
from mlx_ssp.io import iter_jsonl_numbered
from mlx_ssp.tasks.item import Item

PARAMS = ("reward", "max_steps", "call_timeout_s", *render.PARAMS)
REWARDS = ("accuracy", "partial")
ROW_KEYS = ("id", "environment", "config", "turns", "ground_truth", "domain", "system", "level")


def check_params(params: dict, kind: str = "episodes") -> None:
    """The episode params (:data:`PARAMS`) of a source ``kind`` that builds its items with :func:`episode_item`."""
    bad = sorted(set(params) - set(PARAMS))
    if bad:
        raise UserError(f"source '{kind}': unknown params {', '.join(bad)}; valid: {', '.join(PARAMS)}")
    if params.get("reward", "accuracy") not in REWARDS:
        raise UserError(f"source '{kind}': params.reward must be one of {', '.join(REWARDS)}")
    v = params.get("max_steps", 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"source '{kind}': params.max_steps must be an integer >= 1 (got {v!r})")
    render.check_params(kind, params)
    t = params.get("call_timeout_s", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
        raise UserError(f"source '{kind}': params.call_timeout_s must be a positive number (got {t!r})")


def _row_error(where: str, key: str, what: str) -> UserError:
    return UserError(f"{where}: '{key}' {what}")


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def episode_item(row: dict, where: str, base_dir: Path, params: dict, classes: dict[str, type], *,
                 sub_domain: bool = True) -> Item:
    """One line of an episodes file as an :class:`Item` (``where``: ``FILE:LINE`` for errors).
    ``sub_domain``: the row's ``domain`` (or the class name) is appended to the task's domain; off
    for a source whose every domain is already one environment."""
    unknown = sorted(set(row) - set(ROW_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(ROW_KEYS)}")
    for key in ("id", "environment", "turns"):
        if key not in row:
            raise _row_error(where, key, "is required")
    if not isinstance(row["id"], str) or not row["id"]:
        raise _row_error(where, "id", "must be a non-empty string")
    turns = row["turns"]
    if not _strings(turns) or not turns:
        raise _row_error(where, "turns", "must be a non-empty list of user messages (strings)")
    config = row.get("config", {})
    if not isinstance(config, dict):
        raise _row_error(where, "config", "must be an object")
    gt = row.get("ground_truth")
    if gt is not None:
        if not isinstance(gt, list) or not all(_strings(t) for t in gt) or len(gt) != len(turns):
            raise _row_error(where, "ground_truth", f"must be one list of call strings per turn ({len(turns)} turns)")
        for t, calls in enumerate(gt):
            for c in calls:
                try:
                    parse_ground_truth(c)
                except CallSyntaxError as e:
                    raise _row_error(where, "ground_truth", f"turn {t}: {e}") from None
    for key in ("domain", "system"):
        if key in row and (not isinstance(row[key], str) or not row[key]):
            raise _row_error(where, key, "must be a non-empty string")
    level = row.get("level")
    if level is not None and (isinstance(level, bool) or not isinstance(level, int) or level < 0):
        raise _row_error(where, "level", "must be an integer >= 0")
    try:
        ref = resolve_ref(row["environment"], base_dir)
        if ref not in classes:
            classes[ref] = load_class(ref)
    except UserError as e:
        raise UserError(f"{where}: 'environment': {e}") from None
    cls = classes[ref]
    tools = tool_schemas(cls)
    if gt is None and not callable(getattr(cls, "reward", None)):
        raise UserError(f"{where}: no 'ground_truth' and {cls.__name__} has no reward() method: nothing can score it")
    names = {t["function"]["name"] for t in tools}
    user_turns = [[{"role": "user", "content": text}] for text in turns]
    episode: dict[str, Any] = {
        "environment": ref,
        "config": config,
        "user_turns": user_turns,
        "offered": sorted(names),
        "reward": params.get("reward", "accuracy"),
        "max_steps": params.get("max_steps", MAX_STEPS),
        "max_result_chars": params.get("max_result_chars", RESULT_CHARS),
    }
    if gt is not None:
        episode["ground_truth"] = gt
    if "call_timeout_s" in params:
        episode["call_timeout_s"] = float(params["call_timeout_s"])
    messages = ([{"role": "system", "content": row["system"]}] if "system" in row else []) + user_turns[0]
    rendered, template_tools = render.apply(messages, tools, params)
    if rendered is not None:
        episode["render"] = params["render"]
        messages = rendered
    prompt: Any = turns[0] if messages == user_turns[0] else messages
    md = {"episode": episode, "tools": template_tools, "environment_class": cls.__name__}
    if level is not None:
        md["level"] = level
    return Item(row["id"], prompt, gt, md, domain=row.get("domain", cls.__name__) if sub_domain else None,
                identity=[turns, config, ref])


def load_episodes(arg: str, params: dict) -> list[Item]:
    """Every line of the episodes file ``arg`` as an item."""
    check_params(params)
    path = Path(arg).expanduser()
    classes: dict[str, type] = {}
    items = [episode_item(row, f"{path}:{n}", path.resolve().parent, params, classes)
             for n, row in iter_jsonl_numbered(str(path), what="episodes")]
    if not items:
        raise UserError(f"{path}: no episodes")
    seen: set[str] = set()
    for it in items:
        if it.key in seen:
            raise UserError(f"{path}: id '{it.key}' appears twice")
        seen.add(it.key)
    return items
