"""BFCL's executable multi-turn backends: the registry, their function docs, and the two pieces an
environment's worker process runs (building an episode's instances, formatting a call's result).

Kept apart from :mod:`mlx_ssp.agents.environment` with nothing but the standard library and BFCL's own
modules imported, because the worker zygote (:mod:`mlx_ssp.agents.worker`) imports it once and
forks every worker from it: what it imports, every worker carries.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_ssp.agents.worker import Built
from mlx_ssp.errors import UserError

_PREFIX = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"


@dataclass(frozen=True)
class Backend:
    class_name: str
    short: str
    module: str
    doc_file: str
    stateless: bool = False


def _b(class_name: str, short: str, module: str, doc: str, stateless: bool = False) -> Backend:
    return Backend(class_name, short, f"{_PREFIX}.{module}", doc, stateless)


#: The 8 multi-turn backend classes (BFCL's mapping; MathAPI is its one stateless class).
BACKENDS: dict[str, Backend] = {
    b.class_name: b
    for b in (
        _b("GorillaFileSystem", "file_system", "gorilla_file_system", "gorilla_file_system.json"),
        _b("MathAPI", "math", "math_api", "math_api.json", stateless=True),
        _b("MessageAPI", "message", "message_api", "message_api.json"),
        _b("TwitterAPI", "twitter", "posting_api", "posting_api.json"),
        _b("TicketAPI", "ticket", "ticket_api", "ticket_api.json"),
        _b("TradingBot", "trading", "trading_bot", "trading_bot.json"),
        _b("TravelAPI", "travel", "travel_booking", "travel_booking.json"),
        _b("VehicleControlAPI", "vehicle_control", "vehicle_control", "vehicle_control.json"),
    )
}


def backend(class_name: str) -> Backend:
    try:
        return BACKENDS[class_name]
    except KeyError:
        raise UserError(f"unknown BFCL backend class {class_name!r}; known: {', '.join(BACKENDS)}") from None


def _backend_class(class_name: str) -> type:
    return getattr(importlib.import_module(backend(class_name).module), class_name)


@functools.lru_cache(maxsize=None)
def _docs(class_name: str) -> tuple[dict, ...]:
    import bfcl_eval  # an optional package: only BFCL tasks need it

    path = Path(bfcl_eval.__file__).parent / "data" / "multi_turn_func_doc" / backend(class_name).doc_file
    with open(path, encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def function_docs(class_name: str) -> list[dict]:
    """BFCL's JSON function docs for the class (one dict per function; a fresh copy each call)."""
    return copy.deepcopy(list(_docs(class_name)))


def format_result(result: Any) -> str:
    """A method's return value as the text BFCL shows (and compares)."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError, RecursionError):  # e.g. an object instance inside
            return str(result)
    return str(result)


def build_instances(initial_config: dict, involved_classes: list[str], long_context: bool) -> Built:
    """Fresh instances of ``involved_classes``, each loaded from a deep copy of its scenario, and their
    public methods as the tools (runs in the environment's worker process)."""
    instances: dict[str, Any] = {}
    for name in involved_classes:
        b = backend(name)
        inst = _backend_class(name)()
        if not b.stateless:
            cfg = initial_config.get(name, {})
            if not isinstance(cfg, dict):
                raise UserError(f"initial_config[{name!r}] must be an object")
            inst._load_scenario(copy.deepcopy(cfg), long_context=long_context)
        instances[name] = inst
    tools: dict[str, Any] = {}
    for inst in instances.values():  # later classes win a name clash, as in BFCL's mapping
        for m, fn in inspect.getmembers(inst, predicate=inspect.ismethod):
            if not m.startswith("_"):
                tools[m] = fn
    return Built(instances, tools)
