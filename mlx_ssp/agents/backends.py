"""BFCL's executable multi-turn backends and one episode's world over them.

:data:`BACKENDS` is the registry of the 8 multi-turn classes (BFCL's
``executable_backend_config.CLASS_FILE_PATH_MAPPING``, minus WebSearch and Memory). An
:class:`Environment` holds fresh instances of an episode's ``involved_classes``, each loaded from a deep
copy of its ``initial_config`` entry, and runs :class:`~mlx_ssp.agents.calls.Call` data against them:

1. the call's name is looked up in a table of the instances' public bound methods built at start
   (``getattr`` is never applied to a name from the model: dunder/private names and anything that is
   not a backend method simply are not in the table); it must also be in ``allowed`` (the functions
   offered in that turn);
2. the arguments' repr is capped (:attr:`CallLimits.max_argument_chars`), positional arguments are
   bound with ``inspect.signature(method).bind`` (BFCL's ground truth has ``sort('final_report.pdf')``);
3. the method runs in a daemon thread joined with :attr:`CallLimits.timeout_s`; a call still running
   then cannot be stopped (Python threads cannot be killed) and may still change the instances, so the
   environment is marked broken and every later call returns an error;
4. the result is formatted as BFCL does (``str`` as is; ``dict`` -> ``json.dumps``, falling back to
   ``str``; else ``str``) and any failure becomes ``"Error during execution: <message>"``; the text
   returned to the model is cut at :attr:`CallLimits.max_result_chars` with a marker (the checker
   compares the uncut texts, :meth:`Environment.execute_full`).

Deviations from BFCL's executor (``multi_turn_utils.execute_multi_turn_func_call``): no ``eval`` of
call strings (and so no name blocklist: nothing outside the method table can be reached); instances
are never cached in ``globals()`` (BFCL keys them by model name and test id, so K parallel samples of
one task would share one world); ``allowed`` restricts calls to the offered functions (BFCL's eval
run executes any method of the involved classes); time and size limits per call.

Randomness: every stochastic backend (MessageAPI, TradingBot, TravelAPI, VehicleControlAPI) draws from
its own ``random.Random(scenario.get("random_seed", <class default>))`` made in ``_load_scenario``, none
from the global ``random`` module, so a ground-truth twin and the model's environment produce the same
ids for the same calls and the process's global RNG is untouched. ``_load_scenario`` keeps references
into the dict it is given (``self.inbox = scenario.get("inbox")``): hence the deep copy in.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

from mlx_ssp.agents.calls import Call
from mlx_ssp.errors import UserError

_PREFIX = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
_ERROR = "Error during execution: "


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
    import bfcl_eval

    path = Path(bfcl_eval.__file__).parent / "data" / "multi_turn_func_doc" / backend(class_name).doc_file
    with open(path, encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def function_docs(class_name: str) -> list[dict]:
    """BFCL's JSON function docs for the class (one dict per function; a fresh copy each call)."""
    return copy.deepcopy(list(_docs(class_name)))


@dataclass(frozen=True)
class CallLimits:
    timeout_s: float = 5.0
    max_result_chars: int = 8192
    max_argument_chars: int = 65536


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


def cap_result(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n... [{len(text) - max_chars} characters dropped]"


class _CallFailed(Exception):
    pass


class Environment:
    """One episode's world: fresh instances of ``involved_classes``, each loaded from a deep copy of
    ``initial_config[class]`` (``_load_scenario(cfg, long_context=...)``), never shared with another
    Environment."""

    def __init__(
        self,
        initial_config: dict,
        involved_classes: list[str],
        *,
        long_context: bool = False,
        limits: CallLimits = CallLimits(),
    ):
        if not isinstance(initial_config, dict):
            raise UserError("initial_config must be an object mapping backend class -> scenario")
        self.limits = limits
        self.broken = ""  # why later calls are refused ("" = not broken)
        self._instances: dict[str, Any] = {}
        self._methods: dict[str, Any] = {}  # public method name -> bound method
        for name in involved_classes:
            b = backend(name)
            inst = _backend_class(name)()
            if not b.stateless:
                cfg = initial_config.get(name, {})
                if not isinstance(cfg, dict):
                    raise UserError(f"initial_config[{name!r}] must be an object")
                inst._load_scenario(copy.deepcopy(cfg), long_context=long_context)
            self._instances[name] = inst
            # later classes win a name clash, as in BFCL's mapping (the 8 classes have none today)
            for m, fn in inspect.getmembers(inst, predicate=inspect.ismethod):
                if not m.startswith("_"):
                    self._methods[m] = fn

    # ------------------------------------------------------------ calls

    def method_names(self) -> set[str]:
        return set(self._methods)

    def bind(self, call: Call) -> Call:
        """``call`` with its positional arguments named by the method's signature (unchanged if it has
        none, or if the name is unknown or binding fails: executing it reports why)."""
        fn = self._methods.get(call.name)
        if not call.positional or fn is None:
            return call
        try:
            bound = inspect.signature(fn).bind(*call.positional, **call.arguments)
        except TypeError:
            return call
        return Call(call.name, dict(bound.arguments), ())

    def _prepare(self, call: Call, allowed: Collection[str]):
        if not isinstance(call, Call):
            raise _CallFailed(f"not a call: {type(call).__name__}")
        fn = self._methods.get(call.name)
        if fn is None:
            raise _CallFailed(f"no function named {call.name!r} is available")
        if call.name not in allowed:
            raise _CallFailed(f"function {call.name!r} is not available in this turn")
        try:
            size = len(repr(call.arguments)) + len(repr(call.positional))
        except (RecursionError, MemoryError):
            size = self.limits.max_argument_chars + 1
        if size > self.limits.max_argument_chars:
            raise _CallFailed(f"the arguments of {call.name} are longer than {self.limits.max_argument_chars} characters")
        try:
            # copies: a backend keeps argument objects in its state (TwitterAPI stores the `mentions`
            # list and a later mention() appends to it), which must not reach back into the call
            bound = inspect.signature(fn).bind(*copy.deepcopy(call.positional), **copy.deepcopy(call.arguments))
        except TypeError as e:
            raise _CallFailed(f"{call.name}: {e}") from None
        return fn, bound

    def _run(self, fn, bound) -> str:
        box: dict[str, Any] = {}

        def work():
            try:
                box["ok"] = format_result(fn(*bound.args, **bound.kwargs))
            except BaseException as e:  # a backend bug is the call's error, as in BFCL
                box["err"] = str(e)

        t = threading.Thread(target=work, name="mlx_ssp-agent-call", daemon=True)
        t.start()
        t.join(self.limits.timeout_s)
        if t.is_alive():
            self.broken = f"an earlier call ({fn.__name__}) did not finish within {self.limits.timeout_s:g}s"
            return f"{_ERROR}{fn.__name__} did not finish within {self.limits.timeout_s:g}s"
        return box["ok"] if "ok" in box else _ERROR + box["err"]

    def execute_full(self, calls: list[Call], allowed: Collection[str]) -> list[str]:
        """One uncut result text per call, in order (what the checker compares)."""
        out = []
        for call in calls:
            if self.broken:
                out.append(f"{_ERROR}the environment is unusable: {self.broken}")
                continue
            try:
                fn, bound = self._prepare(call, allowed)
            except _CallFailed as e:
                out.append(_ERROR + str(e))
                continue
            out.append(self._run(fn, bound))
        return out

    def execute(self, calls: list[Call], allowed: Collection[str]) -> list[str]:
        """One result text per call, in order, each cut at ``limits.max_result_chars`` (what the model sees)."""
        return [cap_result(r, self.limits.max_result_chars) for r in self.execute_full(calls, allowed)]

    # ------------------------------------------------------------ state

    def _public(self, name: str) -> dict[str, Any]:
        return {k: v for k, v in vars(self._instances[name]).items() if not k.startswith("_")}

    def state(self) -> dict[str, dict]:
        """class -> {public attribute: deep copy of its value} (what the state check compares)."""
        return {name: copy.deepcopy(self._public(name)) for name in self._instances}

    def state_difference(self, other: "Environment | dict[str, dict]") -> str:
        """"" if every public attribute of every instance equals ``other``'s (an Environment or a
        :meth:`state` snapshot), else which class and attribute differ first."""
        theirs = other.state_live() if isinstance(other, Environment) else other
        return state_difference(self.state_live(), theirs)

    def state_live(self) -> dict[str, dict]:
        """Like :meth:`state` but without copying: references into the live instances (read only)."""
        return {name: self._public(name) for name in self._instances}


def state_difference(mine: dict[str, dict], theirs: dict[str, dict]) -> str:
    """The first class/attribute whose values differ between two state dicts, as a short text."""
    for cls in sorted(set(mine) | set(theirs)):
        a, b = mine.get(cls), theirs.get(cls)
        if a is None or b is None:
            return f"{cls}: present in only one environment"
        for attr in sorted(set(a) | set(b)):
            if attr not in a or attr not in b:
                return f"{cls}.{attr}: present in only one environment"
            if a[attr] != b[attr]:
                return f"{cls}.{attr} differs"
    return ""
