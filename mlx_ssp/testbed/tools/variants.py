"""Variants of a tool testbed episode for pretraining corpora: the other orders of a turn's calls
that still pass (:func:`alternative_orders`) and the ways to fail the checker (:func:`unreliable`,
:data:`UNRELIABLE`), each kept only by the checker's own turn judge on in-process twins of the
backend (the overview is :mod:`mlx_ssp.testbed.tools.episodes`)."""

from __future__ import annotations

import copy
import inspect
import itertools
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mlx_ssp.agents.calls import Call
from mlx_ssp.agents.checker import judge_turns  # the checker's own turn judge: variants are kept by its verdict
from mlx_ssp.agents.env import build_class, format_value, tool_functions
from mlx_ssp.agents.environment import state_difference
from mlx_ssp.errors import UserError
from mlx_ssp.testbed.tools.envs import CLASSES
from mlx_ssp.testbed.tools.intents import SPECS, Ctx
from mlx_ssp.testbed.tools.space import POOLS, Episode, Link, allowed_names

UNRELIABLE = ("wrong_value", "foreign_tool", "missed_chain", "acted_on_irrelevance")


class _Twin:
    """An in-process stand-in for :class:`mlx_ssp.agents.environment.Environment`, the interface the
    checker's turn judge uses. The toy backends are pure, fast and bounded, so they need no worker."""

    broken = ""

    def __init__(self, ep: Episode):
        self._built = build_class(ep.environment, copy.deepcopy(ep.config))

    def method_names(self) -> set[str]:
        return set(self._built.tools)

    def execute_full(self, calls: list[Call], allowed: Any) -> list[str]:
        out = []
        for call in calls:
            fn = self._built.tools.get(call.name) if call.name in allowed else None
            try:
                if fn is None:
                    raise LookupError(f"no function named {call.name!r}")
                out.append(format_value(fn(*call.positional, **call.arguments)))
            except Exception as e:  # noqa: BLE001 - a tool's error is its result text, as in the worker
                out.append(f"Error during execution: {e}")
        return out

    def state(self) -> dict[str, dict]:
        return {cls: copy.deepcopy({k: v for k, v in vars(inst).items() if not k.startswith("_")})
                for cls, inst in self._built.instances.items()}

    def state_difference(self, other: Any) -> str:
        return state_difference(self.state(), other.state() if isinstance(other, _Twin) else other)


def passes(ep: Episode, calls: tuple[tuple[Call, ...], ...]) -> bool:
    """Whether the checker passes every turn of ``ep`` when the model makes ``calls`` (one message per
    turn, as a gold episode does), judged by its own turn judge on in-process twins."""
    turns = [[list(t), []] if t else [[]] for t in calls]
    verdicts = judge_turns([list(t) for t in ep.calls], turns, _Twin(ep), _Twin(ep), set(), None)
    return all(v.passed for v in verdicts)


# ------------------------------------------------------------------ alternative orders and unreliable variants


def _relink(link: Link | None, old: tuple, new: tuple) -> Link | None:
    """``link`` with its call indices following a reordering of the turns' calls."""
    if link is None:
        return None
    return replace(link, index=new[link.turn].index(old[link.turn][link.index]),
                   source_index=new[link.source_turn].index(old[link.source_turn][link.source_index]))


def alternative_orders(ep: Episode, limit: int = 8) -> list[Episode]:
    """Up to ``limit`` variants (``order1``, ``order2``...) whose turns make the same calls in another
    order and still pass: a turn's permutations that pass, combined over the turns."""
    per_turn = []
    for t, turn in enumerate(ep.calls):
        orders = [turn]
        for perm in itertools.permutations(turn):
            if perm not in orders and passes(ep, ep.calls[:t] + (perm,) + ep.calls[t + 1:]):
                orders.append(perm)
        per_turn.append(orders)
    out: list[Episode] = []
    for combo in itertools.product(*per_turn):
        if len(out) == limit:
            break
        if combo != ep.calls and passes(ep, combo):
            out.append(replace(ep, calls=combo, chained=_relink(ep.chained, ep.calls, combo),
                               variant=f"order{len(out) + 1}"))
    return out


def _replaced(ep: Episode, t: int, i: int, call: Call) -> tuple:
    turn = ep.calls[t][:i] + (call,) + ep.calls[t][i + 1:]
    return ep.calls[:t] + (turn,) + ep.calls[t + 1:]


def _sites(ep: Episode, rng: random.Random) -> list[tuple[int, int, Call]]:
    sites = [(t, i, call) for t, turn in enumerate(ep.calls) for i, call in enumerate(turn)]
    rng.shuffle(sites)
    return sites


def _others(value: Any, ep: Episode) -> list[Any]:
    """Plausible wrong values in place of ``value``: the other items of its pool, or nearby numbers."""
    if isinstance(value, int):
        return [v for v in (value + 1, value - 1, value + 2, value + 10) if v > 0]
    pool = next((p for p in POOLS.values() if value in p), ())
    allowed = allowed_names(ep.space)
    return [x for x in pool if x != value and x in allowed]


def _wrong_value(ep: Episode, rng: random.Random) -> tuple | None:
    for t, i, call in _sites(ep, rng):
        for arg, value in call.arguments.items():
            if ep.chained and (t, i, arg) == (ep.chained.turn, ep.chained.index, ep.chained.argument):
                continue  # that one is missed_chain's
            others = _others(value, ep)
            rng.shuffle(others)
            for other in others[:4]:
                calls = _replaced(ep, t, i, Call(call.name, {**call.arguments, arg: other}))
                if not passes(ep, calls):
                    return calls
    return None


def _foreign_tool(ep: Episode, rng: random.Random) -> tuple | None:
    spec = SPECS[ep.backend]
    for t, i, call in _sites(ep, rng):
        if call.name not in spec.confusable:
            continue
        other, name = spec.confusable[call.name]
        params = list(inspect.signature(tool_functions(CLASSES[other])[name]).parameters)[1:]
        values = list(call.arguments.values())
        if len(values) > len(params):
            continue
        calls = _replaced(ep, t, i, Call(name, dict(zip(params, values))))
        if not passes(ep, calls):
            return calls
    return None


def _missed_chain(ep: Episode, rng: random.Random) -> tuple | None:
    if ep.chained is None:
        return None
    link = ep.chained
    call = ep.calls[link.turn][link.index]
    value = call.arguments[link.argument]
    source = ep.calls[link.source_turn][link.source_index]
    # what a model that did not use the earlier result writes: the name it looked up, else a guess
    guesses = [v for v in source.arguments.values() if type(v) is type(value)]
    state = [v for v in _config_values(ep) if type(v) is type(value) and v not in guesses]
    rng.shuffle(state)
    guesses += state
    for guess in guesses:
        if guess == value:
            continue
        calls = _replaced(ep, link.turn, link.index, Call(call.name, {**call.arguments, link.argument: guess}))
        if not passes(ep, calls):
            return calls
    return None


def _config_values(ep: Episode) -> list[Any]:
    (state,) = ep.config.values()
    return sorted(state) + sorted(state.values(), key=str)


def _acted_on_irrelevance(ep: Episode, rng: random.Random) -> tuple | None:
    spec = SPECS[ep.backend]
    for t in [t for t, turn in enumerate(ep.calls) if not turn]:
        env = CLASSES[ep.backend]()
        env.reset(copy.deepcopy(ep.config))
        for call in itertools.chain.from_iterable(ep.calls[:t]):
            getattr(env, call.name)(**call.arguments)
        c = Ctx(env, rng, allowed_names(ep.space))
        writes = [x for x in spec.intents if x.writes]
        rng.shuffle(writes)
        for intent in writes:
            planned = intent.plan(c)
            if planned is not None:
                calls = ep.calls[:t] + ((planned[0],),) + ep.calls[t + 1:]
                if not passes(ep, calls):
                    return calls
    return None


_MAKERS: dict[str, Callable[[Episode, random.Random], tuple | None]] = {
    "wrong_value": _wrong_value, "foreign_tool": _foreign_tool, "missed_chain": _missed_chain,
    "acted_on_irrelevance": _acted_on_irrelevance,
}


def unreliable(ep: Episode, kind: str, seed: int = 0) -> Episode | None:
    """A variant of ``ep`` whose calls fail the checker in the way ``kind`` names (:data:`UNRELIABLE`):

    - ``wrong_value``: one argument has another value of its kind (another key, value, amount);
    - ``foreign_tool``: one call uses another backend's tool of nearly the same meaning or name, its
      arguments given that tool's parameter names (``rm(name='cat')`` in KeyValue, ``get(key='hits')``
      in Counters);
    - ``missed_chain``: the chained argument is guessed (the name that was looked up, or another value
      of the initial state) instead of copied from the earlier result;
    - ``acted_on_irrelevance``: a state-changing call in a turn no tool can serve.

    None when the kind does not apply (no chain, no irrelevance turn) or no such variant fails."""
    if kind not in _MAKERS:
        raise UserError(f"unknown unreliable variant {kind!r}; valid: {', '.join(UNRELIABLE)}")
    calls = _MAKERS[kind](ep, random.Random(f"{seed}:{ep.id}:{kind}"))
    return None if calls is None else replace(ep, calls=calls, variant=kind)


def unreliable_variants(ep: Episode, seed: int = 0) -> list[Episode]:
    """One variant per :data:`UNRELIABLE` kind that applies to ``ep``."""
    return [v for v in (unreliable(ep, kind, seed) for kind in UNRELIABLE) if v is not None]
