"""``bfcl_multi_turn:CATEGORY``: BFCL v4's multi-turn entries as episode tasks.

Each entry of ``bfcl_eval/data/BFCL_v4_multi_turn_{CATEGORY}.json`` (``base``, ``miss_func``,
``miss_param``, ``long_context``; 200 each) becomes one task:

- ``prompt``: the first user turn (the task's system prompt is added by the domain, as elsewhere);
- ``metadata["episode"]``: what an episode and its checker need: every user turn (``user_turns``),
  ``initial_config``, ``involved_classes``, the ground truth per turn (BFCL call strings, from
  ``possible_answer/``), ``long_context``, the function names offered from the start (``offered``) and
  those held back until a turn (``held_out``: turn -> names; ``miss_func`` only), and the length a
  tool result shown to the model is cut at (``max_result_chars``: 8192, ``long_context`` 32768; the
  checker compares uncut results);
- ``metadata["tools"]`` / ``["functions"]``: the schemas offered at the start: the involved classes'
  documented functions minus ``excluded_function`` and minus the held-back ones.

A held-back function is announced the way BFCL's prompting handlers do it: its turn, empty in the
data, becomes a user message carrying the new functions' docs and BFCL's sentence "I have updated
some more functions you can choose from. What about now?". (BFCL's function-calling handlers re-send
the tool list instead; re-rendering the system prompt mid-episode would invalidate the episode's KV
cache, so the docs travel in the conversation.)

Domains by backend: an entry's backend is the involved class with the most calls on its
ground-truth ``path`` (ties: the first on the path); BFCL built the 200 ``base`` entries as 50 per
file system, trading, travel and vehicle control, with the other classes (Twitter, messages,
tickets, math) as helpers. Without ``params.backend`` every task's domain is ``<domain>_<backend>``
(so ``tasks export bfcl_multi_turn:base`` writes one domain per backend); with ``backend: NAME`` (a
short name such as ``vehicle_control``, or a class name) only that backend's entries are drawn, into
the domain as named. ``params.tools: used`` offers only the functions the entry's ground truth calls
(short prompts for small models and CPU runs: an easier task than BFCL's, say so when reporting);
``params.reward: partial`` makes the fraction of turns passed the reward (default ``accuracy``);
``params.max_steps`` caps the messages per turn that try to call (default 20, BFCL's limit: a weak
model that keeps writing unparseable calls is told the error 20 times per turn);
``params.render: compact`` shows the tools as one signature line each and asks for python-syntax
calls (``params.describe``: words of description per tool; :mod:`mlx_ssp.agents.render`), and
``params.max_result_chars`` changes where results shown to the model are cut. Splits are disjoint
as for the other file sources (shuffled by seed and domain).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from mlx_ssp.agents import render
from mlx_ssp.agents.bfcl.backends import BACKENDS, function_docs
from mlx_ssp.agents.environment import MAX_STEPS, RESULT_CHARS
from mlx_ssp.errors import UserError
from mlx_ssp.tasks.file_sources import bfcl_schema
from mlx_ssp.tasks.item import Item, read_rows

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
LONG_RESULT_CHARS = 32768  # long_context's point is long results
#: BFCL's text for the turn that brings the held-back functions (prompting handlers).
HELD_OUT_PROMPT = "I have updated some more functions you can choose from. What about now?"
#: The default system prompt of multi-turn domains (BFCL's multi-turn behaviour, in our words).
SYSTEM_PROMPT = (
    "You help the user by calling functions, over several turns. In each turn, call the functions needed "
    "(you will see their results) and keep calling until the request is done; then reply in plain text "
    "without a call, which ends your turn. If no function can do it, or a needed value is missing, say so "
    "in plain text instead of calling. Call a function as "
    '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>.'
)


def _data_dir() -> Path:
    try:
        import bfcl_eval
    except ImportError:
        raise UserError("source 'bfcl_multi_turn' needs the bfcl-eval package (pip install --no-deps bfcl-eval)") from None
    return Path(bfcl_eval.__file__).parent / "data"


def catalogue() -> str:
    return "BFCL multi-turn categories: " + ", ".join(CATEGORIES)


def primary_backend(entry: dict) -> str:
    """The class with the most ground-truth calls on the entry's ``path`` (ties: first on the path)."""
    on_path = [p.split(".", 1)[0] for p in entry.get("path", [])]
    counts = Counter(c for c in on_path if c in entry["involved_classes"])
    if not counts:
        return entry["involved_classes"][0]
    best = max(counts.values())
    return next(c for c in on_path if counts.get(c) == best)


PARAMS = ("backend", "tools", "reward", "max_steps", *render.PARAMS)
#: which functions a task offers: every documented one of its classes (BFCL), or only those its
#: ground truth calls (a smaller task for small models and short CPU runs; not BFCL's benchmark)
TOOL_SETS = ("all", "used")


def _check_params(params: dict) -> None:
    bad = sorted(set(params) - set(PARAMS))
    if bad:
        raise UserError(f"source 'bfcl_multi_turn': unknown params {', '.join(bad)}; valid: {', '.join(PARAMS)}")
    if params.get("tools", "all") not in TOOL_SETS:
        raise UserError(f"source 'bfcl_multi_turn': params.tools must be one of {', '.join(TOOL_SETS)}")
    if params.get("reward", "accuracy") not in ("accuracy", "partial"):
        raise UserError("source 'bfcl_multi_turn': params.reward must be accuracy or partial")
    steps = params.get("max_steps", MAX_STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserError(f"source 'bfcl_multi_turn': params.max_steps must be an integer >= 1 (got {steps!r})")
    render.check_params("bfcl_multi_turn", params)


def _backend_filter(params: dict) -> str | None:
    name = params.get("backend")
    if name is None:
        return None
    for b in BACKENDS.values():
        if name in (b.short, b.class_name):
            return b.class_name
    raise UserError(f"source 'bfcl_multi_turn': unknown backend '{name}'; valid: "
                    + ", ".join(b.short for b in BACKENDS.values()))


def _tool(doc: dict) -> dict:
    return {"type": "function", "function": {**doc, "parameters": bfcl_schema(doc.get("parameters", {}))}}


def _own_description(doc: dict) -> dict:
    """A doc without BFCL's per-class preamble ("This tool belongs to ... Tool description: "), which
    compact rendering would otherwise spend its few words on."""
    desc = doc.get("description") or ""
    return {**doc, "description": desc.split("Tool description: ", 1)[-1]}


def held_out_message(docs: list[dict], rendering: dict | None = None) -> dict:
    """The user message of a turn that brings held-back functions (their schemas, or their compact
    signature lines, then BFCL's sentence)."""
    rendering = rendering or {}
    if rendering.get("render") == "compact":
        listing = render.compact_listing([_tool(_own_description(d)) for d in docs], int(rendering.get("describe", 0)))
        return {"role": "user", "content": f"{listing}\n\n{HELD_OUT_PROMPT}"}
    listing = "\n".join(json.dumps(_tool(d), ensure_ascii=False) for d in docs)
    return {"role": "user", "content": f"New functions you can call (JSON schemas):\n{listing}\n\n{HELD_OUT_PROMPT}"}


def entry_item(entry: dict, ground_truth: list[list[str]], category: str, *, with_domain: bool,
               tools: str = "all", reward: str = "accuracy", max_steps: int = MAX_STEPS,
               rendering: dict | None = None) -> Item:
    """One BFCL multi-turn entry as an :class:`Item` (see the module docstring)."""
    classes = list(entry["involved_classes"])
    unknown = [c for c in classes if c not in BACKENDS]
    if unknown:
        raise UserError(f"BFCL entry {entry['id']}: no backend for {', '.join(unknown)}")
    docs = [d for c in classes for d in function_docs(c)]
    excluded = set(entry.get("excluded_function") or [])
    held = {int(t): list(names) for t, names in (entry.get("missed_function") or {}).items()}
    held_names = {n for names in held.values() for n in names}
    offered = [d for d in docs if d["name"] not in excluded and d["name"] not in held_names]
    if tools == "used":
        used = {c.split("(", 1)[0].strip() for turn in ground_truth for c in turn}
        offered = [d for d in offered if d["name"] in used]
    by_name = {d["name"]: d for d in docs}
    turns = []
    for t, msgs in enumerate(entry["question"]):
        if t in held:
            if msgs:
                raise UserError(f"BFCL entry {entry['id']}: turn {t} brings functions but has a user message")
            msgs = [held_out_message([by_name[n] for n in held[t]], rendering)]
        turns.append([dict(m) for m in msgs])
    if len(turns) != len(ground_truth):
        raise UserError(f"BFCL entry {entry['id']}: {len(turns)} turns but {len(ground_truth)} ground-truth turns")
    backend = primary_backend(entry)
    md: dict[str, Any] = {
        "episode": {
            "user_turns": turns,
            "initial_config": entry.get("initial_config", {}),
            "involved_classes": classes,
            "ground_truth": ground_truth,
            "long_context": category == "long_context",
            "offered": [d["name"] for d in offered],
            "held_out": {str(t): names for t, names in sorted(held.items())},
            # what a tool result shown to the model is cut at (long_context is about long results)
            "max_result_chars": (rendering or {}).get(
                "max_result_chars", LONG_RESULT_CHARS if category == "long_context" else RESULT_CHARS),
            "reward": reward,
            "max_steps": max_steps,
        },
        "tools": [_tool(d) for d in offered],
        "functions": offered,
        "backend": BACKENDS[backend].short,
        "bfcl_id": entry["id"],
        "bfcl_category": f"multi_turn_{category}",
    }
    identity = [turns, md["episode"]["initial_config"]]
    prompt: Any = turns[0]
    rendered, _ = render.apply(turns[0], [_tool(_own_description(d)) for d in offered], rendering or {})
    if rendered is not None:
        md["episode"]["render"] = "compact"
        md["tools"] = []  # the signature lines are in the system message
        prompt = rendered
    return Item(entry["id"], prompt, ground_truth, md, domain=BACKENDS[backend].short if with_domain else None,
                identity=identity)


def load_multi_turn(arg: str, params: dict) -> list[Item]:
    """Every entry of ``BFCL_v4_multi_turn_{arg}.json`` (optionally one backend's) as items."""
    if arg not in CATEGORIES:
        raise UserError(f"unknown BFCL multi-turn category '{arg}'; valid: {', '.join(CATEGORIES)}")
    _check_params(params)
    only = _backend_filter(params)
    d = _data_dir()
    answers = {r["id"]: r["ground_truth"] for r in read_rows(str(d / "possible_answer" / f"BFCL_v4_multi_turn_{arg}.json"))}
    items = []
    for entry in read_rows(str(d / f"BFCL_v4_multi_turn_{arg}.json")):
        if entry["id"] not in answers or (only is not None and primary_backend(entry) != only):
            continue
        items.append(entry_item(entry, answers[entry["id"]], arg, with_domain=only is None,
                                tools=params.get("tools", "all"), reward=params.get("reward", "accuracy"),
                                max_steps=params.get("max_steps", MAX_STEPS),
                                rendering={k: params[k] for k in render.PARAMS if k in params}))
    return items
