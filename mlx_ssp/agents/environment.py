"""One episode's world over BFCL's executable multi-turn backends (the registry of the 8 classes,
BFCL's ``CLASS_FILE_PATH_MAPPING`` minus WebSearch and Memory, is :data:`mlx_ssp.agents.bfcl.backends.BACKENDS`).

An :class:`Environment` holds fresh instances of an episode's ``involved_classes``, each loaded from a deep
copy of its ``initial_config`` entry, and runs :class:`~mlx_ssp.agents.calls.Call` data against them:

1. the call's name is looked up in a table of the instances' public bound methods built at start
   (``getattr`` is never applied to a name from the model: dunder/private names and anything that is
   not a backend method simply are not in the table); it must also be in ``allowed`` (the functions
   offered in that turn);
2. the arguments' repr is capped (:attr:`CallLimits.max_argument_chars`), positional arguments are
   bound with ``inspect.signature(method).bind`` (BFCL's ground truth has ``sort('final_report.pdf')``);
3. the instances live in a worker process of their own (:mod:`mlx_ssp.agents.worker`: a thread
   holding the interpreter lock, as big-integer or mpmath work does, could not be stopped); a call
   still running after :attr:`CallLimits.timeout_s` gets its worker killed, the environment is
   marked broken and every later call returns an error (an episode ends there:
   :class:`~mlx_ssp.agents.episode.Episode`); the worker's memory is capped at
   :attr:`CallLimits.max_memory_mb`;
4. the result is formatted as BFCL does (``str`` as is; ``dict`` -> ``json.dumps``, falling back to
   ``str``; else ``str``) and any failure becomes ``"Error during execution: <message>"``; the text
   returned to the model is cut at :attr:`CallLimits.max_result_chars` with a marker (the checker
   compares the uncut texts, :meth:`Environment.execute_full`).

Deviations from BFCL's executor (``multi_turn_utils.execute_multi_turn_func_call``): no ``eval`` of
call strings (and so no name blocklist: nothing outside the method table can be reached); instances
are never cached in ``globals()`` (BFCL keys them by model name and test id, so K parallel samples of
one task would share one world); ``allowed`` restricts calls to the offered functions (BFCL's eval
run executes any method of the involved classes); time, memory and size limits per call; process-wide state a
call changes (``mpmath.mp.dps``, module globals) dies with the episode's worker.

Randomness: every stochastic backend (MessageAPI, TradingBot, TravelAPI, VehicleControlAPI) draws from
its own ``random.Random(scenario.get("random_seed", <class default>))`` made in ``_load_scenario``, none
from the global ``random`` module, so a ground-truth twin and the model's environment produce the same
ids for the same calls and the process's global RNG is untouched. ``_load_scenario`` keeps references
into the dict it is given (``self.inbox = scenario.get("inbox")``): hence the deep copy in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection

from mlx_ssp.agents.bfcl.backends import BACKENDS, backend, build_instances, format_result
from mlx_ssp.agents.calls import Call
from mlx_ssp.agents.env import build_class, format_value, load_class
from mlx_ssp.agents.worker import Built, Worker, WorkerGone
from mlx_ssp.errors import UserError

_ERROR = "Error during execution: "

#: BFCL's per-turn step limit (``MAXIMUM_STEP_LIMIT``): messages in a turn that try to call
MAX_STEPS = 20
#: what a result shown to the model is cut at by default (the checker compares uncut results)
RESULT_CHARS = 8192


@dataclass(frozen=True)
class CallLimits:
    timeout_s: float = 5.0
    max_result_chars: int = RESULT_CHARS
    max_argument_chars: int = 65536
    max_memory_mb: int = 2048  # the worker's address space (Linux); 0 = no cap
    #: a result longer than this comes back cut, with the rest's length and digest (still compared exactly)
    max_full_result_chars: int = 1 << 20


def limits_of(episode: dict) -> CallLimits:
    """An episode task's call limits: ``metadata.episode`` may raise the result cap
    (``max_result_chars``: long_context's point is long results) and set ``call_timeout_s``."""
    d = CallLimits()
    timeout, chars = episode.get("call_timeout_s", d.timeout_s), episode.get("max_result_chars", d.max_result_chars)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise UserError(f"metadata.episode.call_timeout_s must be a positive finite number (got {timeout!r})")
    if isinstance(chars, bool) or not isinstance(chars, int) or chars < 1:
        raise UserError(f"metadata.episode.max_result_chars must be an integer >= 1 (got {chars!r})")
    return CallLimits(timeout_s=float(timeout), max_result_chars=chars)


def cap_result(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n... [{len(text) - max_chars} characters dropped]"


class _CallFailed(Exception):
    pass


@dataclass(frozen=True)
class World:
    """What an episode's environment is built from, as data for its worker: ``build(*args)`` returns
    the instances and tools, ``fmt`` turns a tool's return value into the text the model sees."""

    build: Callable[..., Built]
    args: tuple
    fmt: Callable[[Any], str]


#: what every worker's zygote imports once (light modules only: every worker carries them)
_PRELOAD = ("mlx_ssp.agents.bfcl.backends", "mlx_ssp.agents.env", *(b.module for b in BACKENDS.values()))


def bfcl_world(initial_config: dict, involved_classes: list[str], long_context: bool = False) -> World:
    """BFCL's backends: fresh instances of ``involved_classes``, each loaded from a deep copy of
    ``initial_config[class]`` (``_load_scenario(cfg, long_context=...)``)."""
    if not isinstance(initial_config, dict):
        raise UserError("initial_config must be an object mapping backend class -> scenario")
    for name in involved_classes:
        backend(name)  # an unknown class is a UserError here, before any process starts
    return World(build_instances, (initial_config, list(involved_classes), bool(long_context)), format_result)


def class_world(ref: str, config: dict) -> World:
    """A user environment class (:mod:`mlx_ssp.agents.env`; ``ref`` already resolved), reset to ``config``."""
    if not isinstance(config, dict):
        raise UserError(f"environment {ref}: config must be an object")
    return World(build_class, (ref, config), format_value)


def world_of(episode: dict) -> World:
    """The world of an episode task (``metadata["episode"]``): its ``environment`` class, else BFCL's
    ``involved_classes``."""
    if "environment" in episode:
        return class_world(episode["environment"], episode.get("config", {}))
    return bfcl_world(episode.get("initial_config", {}), episode["involved_classes"],
                      bool(episode.get("long_context")))


class Environment:
    """One episode's world, never shared with another Environment, living in a worker process of its
    own (:mod:`mlx_ssp.agents.worker`) that is killed when a call is over its time limit.
    :meth:`close` (or ``with``) stops the worker."""

    def __init__(self, world: World, *, limits: CallLimits = CallLimits()):
        self.limits = limits
        self.broken = ""  # why later calls are refused ("" = not broken)
        self.timed_out = False  # broken by a call over its time limit (else the worker died)
        if world.build is build_class:
            # the class's module is loaded here too, so the state's own objects unpickle in this process
            load_class(world.args[0])
        self._worker = Worker(world.build, world.args, world.fmt, max_memory_mb=limits.max_memory_mb,
                              max_result_chars=limits.max_full_result_chars, preload=_PRELOAD)
        self._signatures = self._worker.signatures  # tool name -> signature
        self.has_reward = self._worker.has_reward

    def close(self) -> None:
        """Stop the worker process (the state is gone with it)."""
        self._worker.close()

    def __enter__(self) -> "Environment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ calls

    def method_names(self) -> set[str]:
        return set(self._signatures)

    def bind(self, call: Call) -> Call:
        """``call`` with its positional arguments named by the method's signature (unchanged if it has
        none, or if the name is unknown or binding fails: executing it reports why)."""
        sig = self._signatures.get(call.name)
        if not call.positional or sig is None:
            return call
        try:
            bound = sig.bind(*call.positional, **call.arguments)
        except TypeError:
            return call
        return Call(call.name, dict(bound.arguments), ())

    def _prepare(self, call: Call, allowed: Collection[str]):
        if not isinstance(call, Call):
            raise _CallFailed(f"not a call: {type(call).__name__}")
        sig = self._signatures.get(call.name)
        if sig is None:
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
            # the worker gets its own copies (the request is pickled): a backend keeps argument objects
            # in its state (TwitterAPI stores the `mentions` list), which never reach back into the call
            return sig.bind(*call.positional, **call.arguments)
        except TypeError as e:
            raise _CallFailed(f"{call.name}: {e}") from None

    def _run(self, name: str, bound) -> str:
        try:
            kind, text = self._worker.request(("call", name, bound.args, bound.kwargs), self.limits.timeout_s,
                                              f"{name}")
        except WorkerGone as e:
            self.broken, self.timed_out = f"an earlier call ({e}) was stopped", e.timed_out
            return f"{_ERROR}{e}; the environment was stopped"
        return text if kind == "ok" else _ERROR + text

    def execute_full(self, calls: list[Call], allowed: Collection[str]) -> list[str]:
        """One uncut result text per call, in order (what the checker compares)."""
        out = []
        for call in calls:
            if self.broken:
                out.append(f"{_ERROR}the environment is unusable: {self.broken}")
                continue
            try:
                bound = self._prepare(call, allowed)
            except _CallFailed as e:
                out.append(_ERROR + str(e))
                continue
            out.append(self._run(call.name, bound))
        return out

    def execute(self, calls: list[Call], allowed: Collection[str]) -> list[str]:
        """One result text per call, in order, each cut at ``limits.max_result_chars`` (what the model sees)."""
        return [cap_result(r, self.limits.max_result_chars) for r in self.execute_full(calls, allowed)]

    # ------------------------------------------------------------ state

    def _ask(self, req: tuple, what: str, failed: str) -> Any:
        """A request other than a call; :class:`EnvironmentBroken` once the environment was stopped
        (or is stopped by this request), or when the worker answers with an error."""
        if self.broken:
            raise EnvironmentBroken(self.broken)
        try:
            kind, value = self._worker.request(req, self.limits.timeout_s, what)
        except WorkerGone as e:
            self.broken, self.timed_out = str(e), e.timed_out
            raise EnvironmentBroken(self.broken) from None
        if kind != "ok":
            raise EnvironmentBroken(f"{failed}{value}")
        return value

    def state(self) -> dict[str, dict]:
        """class -> {public attribute: a copy of its value} (what the state check compares)."""
        return self._ask(("state",), "reading the state", "the state could not be read: ")

    def reward(self) -> float:
        """The environment's own ``reward()`` (tasks without ground truth), checked to be in [0, 1]."""
        value = self._ask(("reward",), "reward()", "")
        if not 0.0 <= value <= 1.0:  # NaN fails too
            raise EnvironmentBroken(f"reward() returned {value}, not a number in [0, 1]")
        return value

    def state_difference(self, other: "Environment | dict[str, dict]") -> str:
        """"" if every public attribute of every instance equals ``other``'s (an Environment or a
        :meth:`state` snapshot), else which class and attribute differ first."""
        theirs = other.state() if isinstance(other, Environment) else other
        return state_difference(self.state(), theirs)


class EnvironmentBroken(Exception):
    """The environment's worker was stopped (a call over its time limit, or the process died)."""


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
