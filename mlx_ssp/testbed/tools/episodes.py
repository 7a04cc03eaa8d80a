"""The tool testbed's episode generator: seeded, pure, graded, with a held-out part of the space.

:func:`episodes` draws episodes on one backend of :mod:`.envs` from ``random.Random(f"{seed}:{backend}:{split}")``.
An episode has 2-3 user turns; each turn is one to three clauses joined into one message, each clause
a paraphrase (four per intent) of one call, planned on the backend's state as the turn reaches it (a
real instance runs every ground-truth call while the episode is drawn, so none fails and every result
is known). Calls in one turn touch distinct entities, so most of them commute (:func:`alternative_orders`).

**Levels** (:data:`LEVELS`, level -> most calls in a turn, whether an argument is chained):

- 1: one call per turn; 2: up to two (one turn has two);
- 3: one call per turn, and a *chained* argument: a later turn's call needs what an earlier read
  returned (BFCL's chaining: "look up cat", then "copy cat to dog" is ``put(key='dog', value=<cat's
  value>)``; "find the richest account", then "move 5 from the richest account to bob"); the value
  appears in that earlier tool result and in no user turn (a word-boundary check rejects the draw);
- 4: a chained argument and up to three calls per turn.

**Irrelevance**: a share ``irrelevance`` of all turns (default 0.15, at most 1/3; exact in
expectation) are requests no tool can do ("make cat expire in an hour"), with empty ground truth
(such a turn passes only without a state-changing call). Episodes without a chain have 2 or 3 turns,
at least one of them relevant; chain episodes have 3, at least two of them relevant.

**The held-out part of the space**: every fourth name of each pool (:data:`POOLS`; keys, counters and
files share the word pool, so the backends interfere) and every intent's fourth paraphrase are
held out. Spaces (:data:`SPACES`): ``held_out`` episodes use at least one held-out name or
paraphrase; the others use none and split by a hash of the episode (its turns and config) into
``train`` (7/8) and ``seen`` (1/8: in-distribution episodes no train draw can produce). The three
spaces are disjoint by construction, whatever the seeds; :func:`space_of` names an episode's.

**For pretraining corpora**: :func:`unreliable` makes an episode whose calls fail the checker in one
way (:data:`UNRELIABLE`: a wrong argument value, another backend's confusable tool, the chained
argument guessed instead of copied, a state-changing call on an irrelevant request), and
:func:`alternative_orders` the other orders of a turn's calls that pass it. Both are judged by the
checker's own turn judge (:mod:`mlx_ssp.agents.checker`) on in-process twins of the backend, so a
variant is kept only if the checker would score it so (tests re-verify them through the verifier).
An :class:`Episode` is an ``episodes:`` row (:meth:`Episode.row`); a variant's row carries the
variant's calls as its ``ground_truth``, so its conversation with real results is
:func:`mlx_ssp.agents.gold.gold_messages` of its task. A variant has its episode's turns and config,
by which an episodes file deduplicates its rows: write each variant kind to a file of its own.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_ssp.agents.calls import Call
from mlx_ssp.agents.checker import judge_turns  # the checker's own turn judge: variants are kept by its verdict
from mlx_ssp.agents.env import build_class, format_value, tool_functions
from mlx_ssp.agents.environment import state_difference
from mlx_ssp.errors import UserError
from mlx_ssp.testbed.tools.envs import CLASSES

ENV_MODULE = "mlx_ssp.testbed.tools.envs"
BACKENDS = tuple(CLASSES)

WORDS = ("cat", "dog", "sun", "box", "map", "pen", "cup", "owl", "fig", "jam", "hat", "kit", "log", "net", "oak", "ray")
VALUES = ("red", "blue", "gold", "jade", "mint", "rose", "lime", "teal", "plum", "sand", "pink", "navy", "snow",
          "rust", "fern", "sage")
TEXTS = ("buy milk", "call mom", "fix sink", "pay rent", "feed fish", "mow lawn", "bake bread", "wash car", "read book",
         "sort mail", "book flight", "clean desk", "paint fence", "water plants", "plan trip", "iron shirts")
PEOPLE = ("ann", "bob", "cy", "dee", "eve", "fay", "gus", "hal", "ivy", "jo", "kim", "lu", "max", "ned", "oli", "pat")
#: entity and value pools; keys, counter names and file names share ``word`` (interference by design)
POOLS: dict[str, tuple[str, ...]] = {"word": WORDS, "value": VALUES, "text": TEXTS, "person": PEOPLE}
#: every fourth item of each pool never appears outside the held-out space
HELD_OUT_NAMES = frozenset(x for pool in POOLS.values() for x in pool[3::4])
#: every intent's paraphrase of this index never appears outside the held-out space
HELD_OUT_FORM = 3
SEEN_MOD = 8  # 1 in SEEN_MOD episodes outside the held-out space is reserved for in-distribution eval
SPACES = ("train", "seen", "held_out")
#: level -> (most calls in a turn, a chained argument)
LEVELS: dict[int, tuple[int, bool]] = {1: (1, False), 2: (2, False), 3: (1, True), 4: (3, True)}
#: the highest share of irrelevance turns every level can have (a chain episode: 3 turns, 2 of them relevant)
MAX_IRRELEVANCE = 1 / 3
UNRELIABLE = ("wrong_value", "foreign_tool", "missed_chain", "acted_on_irrelevance")
JOINERS = (" and ", ", then ", ", and ", ", also ")
AMOUNTS = range(2, 10)  # amounts the user names; counts and balances are 10-99, so never confused with them


# ------------------------------------------------------------------ episodes


@dataclass(frozen=True)
class Link:
    """A chained argument: ``calls[turn][index].arguments[argument]`` is what
    ``calls[source_turn][source_index]`` returned."""

    turn: int
    index: int
    argument: str
    source_turn: int
    source_index: int


@dataclass(frozen=True)
class Episode:
    """One episode on a backend: its initial state, user turns and ground-truth calls per turn."""

    id: str
    backend: str
    level: int
    config: dict
    turns: tuple[str, ...]
    calls: tuple[tuple[Call, ...], ...]
    chained: Link | None = None
    space: str = "train"
    forms: tuple[str, ...] = ()  # the paraphrases used, "backend.intent.index"
    variant: str = "gold"  # gold, an UNRELIABLE kind, or orderN (alternative_orders)

    @property
    def environment(self) -> str:
        return f"{ENV_MODULE}:{CLASSES[self.backend].__name__}"

    def ground_truth(self) -> list[list[str]]:
        return [[c.as_python() for c in turn] for turn in self.calls]

    def row(self) -> dict:
        """The episode as an ``episodes:`` row (:mod:`mlx_ssp.agents.source`); a variant's id is
        ``<id>.<variant>`` and its ``ground_truth`` the variant's calls (an episodes file keeps one row
        per turns and config: a variant goes in another file than its episode)."""
        return {"id": self.id if self.variant == "gold" else f"{self.id}.{self.variant}",
                "environment": self.environment, "config": copy.deepcopy(self.config), "turns": list(self.turns),
                "ground_truth": self.ground_truth(), "domain": self.backend, "level": self.level}


def identity(ep: Episode) -> str:
    """What makes two episodes the same problem: the backend, the turns and the initial state."""
    return json.dumps([ep.backend, list(ep.turns), ep.config], sort_keys=True)


def uses_held_out(ep: Episode) -> bool:
    """Whether the episode uses a held-out name (in its config, turns or calls) or paraphrase."""
    words = set(re.findall(r"\w+", json.dumps([ep.config, ep.turns, ep.ground_truth()])))
    phrases = " ".join([json.dumps(ep.config), *ep.turns])
    return (any(int(f.rsplit(".", 1)[1]) == HELD_OUT_FORM for f in ep.forms)
            or any((x in words) if " " not in x else (x in phrases) for x in HELD_OUT_NAMES))


def space_of(ep: Episode) -> str:
    """``held_out``, ``seen`` or ``train`` (the module docstring)."""
    if uses_held_out(ep):
        return "held_out"
    return "seen" if zlib.crc32(identity(ep).encode()) % SEEN_MOD == 0 else "train"


# ------------------------------------------------------------------ planning calls on a backend's state


@dataclass
class _Ctx:
    """What a plan sees: the backend instance in the turn's current state, the draw's rng, the pool
    items the space allows, and the entities this turn already touches."""

    env: Any
    rng: random.Random
    allowed: frozenset
    busy: set = field(default_factory=set)

    def pick(self, pool: str | None = None, among: Any = None, exclude: tuple = ()) -> str | None:
        """An item of ``pool`` (or of ``among``, existing entities) that is allowed, not busy and not
        excluded; it becomes busy. None when there is none."""
        base = POOLS[pool] if among is None else sorted(among)
        xs = [x for x in base if x in self.allowed and x not in self.busy and x not in exclude]
        if not xs:
            return None
        x = self.rng.choice(xs)
        self.busy.add(x)
        return x

    def sample(self, pool: str, k: int) -> list[str]:
        return self.rng.sample([x for x in POOLS[pool] if x in self.allowed], k)

    def once(self, tag: str) -> bool:
        """False if the turn already has a call marked ``tag`` (one global read per turn)."""
        if tag in self.busy:
            return False
        self.busy.add(tag)
        return True


Planned = tuple[Call | None, dict] | None  # (the call, or None for an irrelevance clause; the form's slots)


@dataclass(frozen=True)
class Intent:
    """One kind of request: four paraphrases of its clause and how to plan its call."""

    name: str
    forms: tuple[str, ...]
    plan: Callable[[_Ctx], Planned]
    writes: bool = False


@dataclass(frozen=True)
class Chain:
    """A call that needs an earlier read's result: the read (``source``), the later call's paraphrases
    and plan (given the read's call and result; it returns the call, the slots and the argument that
    holds the result), and ``now``: what the read would return in the current state (the reference
    must not have moved by the later turn, so re-reading and remembering agree)."""

    name: str
    source: Intent
    forms: tuple[str, ...]
    plan: Callable[[_Ctx, Call, Any], tuple[Call, dict, str] | None]
    now: Callable[[Any, Call], Any]


@dataclass(frozen=True)
class Backend:
    name: str
    config: Callable[[_Ctx], dict]
    intents: tuple[Intent, ...]
    chains: tuple[Chain, ...]
    irrelevant: Intent
    #: tool -> (another backend, its tool of nearly the same meaning or the same name)
    confusable: dict[str, tuple[str, str]]


def _amount(c: _Ctx) -> int:
    return c.rng.choice(AMOUNTS)


def _distinct_numbers(c: _Ctx, k: int) -> list[int]:
    return c.rng.sample(range(10, 100), k)  # distinct: top() and richest() have one answer


# -- KeyValue


def _kv_get(c: _Ctx) -> Planned:
    k = c.pick(among=c.env.data)
    return k and (Call("get", {"key": k}), {"k": k})


def _kv_put(c: _Ctx) -> Planned:
    k = c.pick("word")
    v = k and c.pick("value", exclude=(c.env.data.get(k),))
    return v and (Call("put", {"key": k, "value": v}), {"k": k, "v": v})


def _kv_delete(c: _Ctx) -> Planned:
    k = c.pick(among=c.env.data) if len(c.env.data) > 2 else None
    return k and (Call("delete", {"key": k}), {"k": k})


def _kv_keys(c: _Ctx) -> Planned:
    return (Call("keys", {}), {}) if c.once("#list") else None


def _kv_copy(c: _Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    k = src.arguments["key"]
    c.busy.add(k)
    k2 = c.pick("word", exclude=tuple(x for x, v in c.env.data.items() if v == value))
    return k2 and (Call("put", {"key": k2, "value": value}), {"k": k, "k2": k2}, "value")


def _kv_irrelevant(c: _Ctx) -> Planned:
    k = c.pick(among=c.env.data)
    return k and (None, {"k": k})


_KV_GET = Intent("get", ("look up {k}", "get the value of {k}", "read key {k}", "tell me what {k} holds"), _kv_get)
KV = Backend(
    "kv",
    lambda c: {"data": dict(zip(c.sample("word", k := c.rng.randint(3, 5)), c.sample("value", k)))},
    (_KV_GET,
     Intent("put", ("put {v} under {k}", "set {k} to {v}", "store {v} at key {k}", "save {v} as {k}"), _kv_put, True),
     Intent("delete", ("delete {k}", "remove key {k}", "drop {k}", "erase key {k}"), _kv_delete, True),
     Intent("keys", ("list the keys", "show all keys", "tell me which keys exist", "give me every key"), _kv_keys)),
    (Chain("copy", _KV_GET, ("copy {k} to {k2}", "put the value of {k} under {k2}", "store what {k} holds at {k2} too",
                             "set {k2} to whatever {k} holds"), _kv_copy,
           lambda env, src: env.data.get(src.arguments["key"])),),
    Intent("irrelevant", ("make {k} expire in an hour", "lock {k} so nobody can change it",
                          "show when {k} was last changed", "back up {k} to the cloud"), _kv_irrelevant),
    {"get": ("ctr", "get"), "put": ("files", "write"), "delete": ("files", "rm"), "keys": ("files", "ls")},
)


# -- Counters


def _ctr_get(c: _Ctx) -> Planned:
    n = c.pick(among=c.env.counts)
    return n and (Call("get", {"name": n}), {"n": n})


def _ctr_add(c: _Ctx) -> Planned:
    n = c.pick("word")
    a = _amount(c)
    return n and (Call("add", {"name": n, "amount": a}), {"n": n, "a": a})


def _ctr_inc(c: _Ctx) -> Planned:
    n = c.pick("word")
    return n and (Call("add", {"name": n}), {"n": n})


def _ctr_clear(c: _Ctx) -> Planned:
    n = c.pick(among=[x for x, v in c.env.counts.items() if v != 0])
    return n and (Call("clear", {"name": n}), {"n": n})


def _ctr_top(c: _Ctx) -> Planned:
    return (Call("top", {}), {}) if c.once("#list") else None


def _ctr_add_count(c: _Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    n = src.arguments["name"]
    c.busy.add(n)
    n2 = c.pick("word")
    return n2 and (Call("add", {"name": n2, "amount": value}), {"n": n, "n2": n2}, "amount")


def _ctr_add_top(c: _Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    c.busy.add(value)
    a = _amount(c)
    return Call("add", {"name": value, "amount": a}), {"a": a}, "name"


def _ctr_irrelevant(c: _Ctx) -> Planned:
    n = c.pick(among=c.env.counts)
    return n and (None, {"n": n, "a": _amount(c)})


_CTR_GET = Intent("get", ("get {n}", "tell me the count of {n}", "look up counter {n}", "read {n}"), _ctr_get)
_CTR_TOP = Intent("top", ("find the top counter", "tell me which counter is highest", "show the biggest counter",
                          "look up the leading counter"), _ctr_top)
CTR = Backend(
    "ctr",
    lambda c: {"counts": dict(zip(c.sample("word", k := c.rng.randint(3, 5)), _distinct_numbers(c, k)))},
    (_CTR_GET,
     Intent("add", ("add {a} to {n}", "increase {n} by {a}", "count {a} more for {n}", "raise {n} by {a}"), _ctr_add,
            True),
     Intent("inc", ("increment {n}", "add one to {n}", "count one more for {n}", "bump {n} by one"), _ctr_inc, True),
     Intent("clear", ("clear {n}", "reset {n} to zero", "zero out {n}", "set {n} back to 0"), _ctr_clear, True),
     _CTR_TOP),
    (Chain("add_count", _CTR_GET, ("add the count of {n} to {n2}", "increase {n2} by the value of {n}",
                                   "raise {n2} by as much as {n} holds", "add {n}'s count to {n2}"), _ctr_add_count,
           lambda env, src: env.counts.get(src.arguments["name"])),
     Chain("add_top", _CTR_TOP, ("add {a} to the top counter", "increase the highest counter by {a}",
                                 "raise the leading counter by {a}", "count {a} more for the biggest counter"),
           _ctr_add_top, lambda env, src: env.top())),
    Intent("irrelevant", ("set a limit of {a} on {n}", "show the history of {n}", "make {n} count down instead",
                          "graph {n} over the last week"), _ctr_irrelevant),
    {"get": ("kv", "get"), "add": ("bank", "deposit"), "clear": ("kv", "delete"), "top": ("bank", "richest")},
)


# -- Files


def _fs_ls(c: _Ctx) -> Planned:
    return (Call("ls", {}), {}) if c.once("#list") else None


def _fs_cat(c: _Ctx) -> Planned:
    f = c.pick(among=c.env.files)
    return f and (Call("cat", {"name": f}), {"f": f})


def _fs_write(c: _Ctx) -> Planned:
    f = c.pick("word")
    t = f and c.pick("text", exclude=(c.env.files.get(f),))
    return t and (Call("write", {"name": f, "text": t}), {"f": f, "t": t})


def _fs_rm(c: _Ctx) -> Planned:
    f = c.pick(among=c.env.files) if len(c.env.files) > 2 else None
    return f and (Call("rm", {"name": f}), {"f": f})


def _fs_copy(c: _Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    f = src.arguments["name"]
    c.busy.add(f)
    f2 = c.pick("word", exclude=tuple(x for x, v in c.env.files.items() if v == value))
    return f2 and (Call("write", {"name": f2, "text": value}), {"f": f, "f2": f2}, "text")


def _fs_irrelevant(c: _Ctx) -> Planned:
    f = c.pick(among=c.env.files)
    p = f and c.pick("person")
    return p and (None, {"f": f, "p": p})


_FS_CAT = Intent("cat", ("show {f}", "read {f}", "open file {f}", "print {f}"), _fs_cat)
FILES = Backend(
    "files",
    lambda c: {"files": dict(zip(c.sample("word", k := c.rng.randint(3, 5)), c.sample("text", k)))},
    (Intent("ls", ("list the files", "show all files", "tell me which files exist", "give me every file name"), _fs_ls),
     _FS_CAT,
     Intent("write", ('write "{t}" to {f}', 'save "{t}" in {f}', 'put "{t}" into file {f}', 'set {f} to "{t}"'),
            _fs_write, True),
     Intent("rm", ("delete {f}", "remove file {f}", "erase {f}", "throw away {f}"), _fs_rm, True)),
    (Chain("copy", _FS_CAT, ("copy {f} to {f2}", "write the text of {f} into {f2}", "save what {f} says as {f2}",
                             "put the contents of {f} into {f2}"), _fs_copy,
           lambda env, src: env.files.get(src.arguments["name"])),),
    Intent("irrelevant", ("email {f} to {p}", "show when {f} was made", "make {f} read-only",
                          "fax {f} to {p}"), _fs_irrelevant),
    {"cat": ("kv", "get"), "write": ("kv", "put"), "rm": ("kv", "delete"), "ls": ("kv", "keys")},
)


# -- Bank


def _bank_balance(c: _Ctx) -> Planned:
    a = c.pick(among=c.env.accounts)
    return a and (Call("balance", {"account": a}), {"a": a})


def _bank_deposit(c: _Ctx) -> Planned:
    a = c.pick(among=c.env.accounts)
    m = _amount(c)
    return a and (Call("deposit", {"account": a, "amount": m}), {"a": a, "m": m})


def _bank_transfer(c: _Ctx) -> Planned:
    m = _amount(c)
    s = c.pick(among=[x for x, v in c.env.accounts.items() if v >= m])
    d = s and c.pick(among=c.env.accounts)
    return d and (Call("transfer", {"src": s, "dst": d, "amount": m}), {"s": s, "d": d, "m": m})


def _bank_richest(c: _Ctx) -> Planned:
    return (Call("richest", {}), {}) if c.once("#list") else None


def _bank_deposit_balance(c: _Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    a = src.arguments["account"]
    c.busy.add(a)
    a2 = c.pick(among=c.env.accounts)
    return a2 and (Call("deposit", {"account": a2, "amount": value}), {"a": a, "a2": a2}, "amount")


def _bank_pay_from_richest(c: _Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    c.busy.add(value)
    d = c.pick(among=c.env.accounts)
    m = _amount(c)
    return d and (Call("transfer", {"src": value, "dst": d, "amount": m}), {"d": d, "m": m}, "src")


def _bank_irrelevant(c: _Ctx) -> Planned:
    a = c.pick(among=c.env.accounts)
    p = a and c.pick("person", exclude=tuple(c.env.accounts))
    return p and (None, {"a": a, "p": p})


_BANK_BALANCE = Intent("balance", ("check {a}'s balance", "tell me how much {a} has", "look up the balance of {a}",
                                   "show what {a} holds"), _bank_balance)
_BANK_RICHEST = Intent("richest", ("find the richest account", "tell me who has the most money",
                                   "show whose account holds the most", "look up the richest person"), _bank_richest)
BANK = Backend(
    "bank",
    lambda c: {"accounts": dict(zip(c.sample("person", k := c.rng.randint(3, 5)), _distinct_numbers(c, k)))},
    (_BANK_BALANCE,
     Intent("deposit", ("deposit {m} for {a}", "pay {m} into {a}'s account", "add {m} to {a}'s account",
                        "put {m} in {a}'s account"), _bank_deposit, True),
     Intent("transfer", ("move {m} from {s} to {d}", "transfer {m} from {s} to {d}", "send {m} from {s} to {d}",
                         "have {s} pay {d} {m}"), _bank_transfer, True),
     _BANK_RICHEST),
    (Chain("deposit_balance", _BANK_BALANCE, ("deposit as much as {a} has for {a2}",
                                              "pay {a}'s balance into {a2}'s account",
                                              "add the amount {a} holds to {a2}'s account",
                                              "match {a}'s balance with a deposit for {a2}"), _bank_deposit_balance,
           lambda env, src: env.accounts.get(src.arguments["account"])),
     Chain("pay_from_richest", _BANK_RICHEST, ("move {m} from the richest account to {d}",
                                               "transfer {m} from whoever has the most to {d}",
                                               "send {m} to {d} from the richest account",
                                               "have the richest person pay {d} {m}"), _bank_pay_from_richest,
           lambda env, src: env.richest())),
    Intent("irrelevant", ("open a new account for {p}", "show {a}'s last statement",
                          "set up a monthly payment from {a}", "tell me the interest rate {a} gets"), _bank_irrelevant),
    {"balance": ("ctr", "get"), "deposit": ("ctr", "add"), "richest": ("ctr", "top"), "transfer": ("ctr", "add")},
)

SPECS: dict[str, Backend] = {b.name: b for b in (KV, CTR, FILES, BANK)}


# ------------------------------------------------------------------ drawing


class _Redraw(Exception):
    """This draw cannot be completed (no entity fits, a reference moved): draw again."""


def _allowed(space: str) -> frozenset:
    items = {x for pool in POOLS.values() for x in pool}
    return frozenset(items if space == "held_out" else items - HELD_OUT_NAMES)


def _form(spec: Backend, c: _Ctx, owner: str, forms: tuple[str, ...], held_out: bool, slots: dict,
          used: list[str], fresh: bool = False) -> str:
    """A paraphrase of ``owner``'s clause (``fresh``: one the episode has not used yet), filled in."""
    ids = [j for j in range(len(forms)) if held_out or j != HELD_OUT_FORM]
    ids = [j for j in ids if not fresh or f"{spec.name}.{owner}.{j}" not in used]
    if not ids:
        raise _Redraw
    i = c.rng.choice(ids)
    used.append(f"{spec.name}.{owner}.{i}")
    return forms[i].format(**slots)


def _run(env: Any, call: Call) -> Any:
    try:
        return getattr(env, call.name)(**call.arguments)
    except Exception:  # noqa: BLE001 - a ground-truth call must not fail: the plan did not fit this state
        raise _Redraw from None


def _draw(spec: Backend, rng: random.Random, level: int, irrelevance: float, space: str) -> Episode:
    """One episode (raises :class:`_Redraw` when this draw does not work out)."""
    held_out = space == "held_out"
    c = _Ctx(CLASSES[spec.name](), rng, _allowed(space))
    config = spec.config(c)
    c.env.reset(copy.deepcopy(config))
    most, chained = LEVELS[level]
    n_turns = 3 if chained else rng.choice((2, 3))
    free = n_turns - (2 if chained else 1)  # turns that may be irrelevant: a chain needs two relevant ones
    # each free turn is irrelevant with the probability that makes `irrelevance` the expected share of all turns
    k = sum(rng.random() < irrelevance * n_turns / free for _ in range(free))
    skip = set(rng.sample(range(n_turns), k))
    irrelevant = [i in skip for i in range(n_turns)]
    relevant = [i for i, x in enumerate(irrelevant) if not x]
    counts = {t: rng.randint(1, most) for t in relevant}
    counts[rng.choice(relevant)] = most
    chain = rng.choice(spec.chains) if chained else None
    target = relevant[-1]
    source = rng.choice(relevant[:-1]) if chained else -1
    turns, calls, forms, link = [], [], [], None
    src_call = src_result = src_index = None
    for t in range(n_turns):
        c.busy = set()
        if irrelevant[t]:
            _, slots = spec.irrelevant.plan(c) or (None, None)
            if slots is None:
                raise _Redraw
            clause = _form(spec, c, "irrelevant", spec.irrelevant.forms, held_out, slots, forms, fresh=True)
            turns.append(_sentence([clause], rng))
            calls.append(())
            continue
        clauses, turn_calls = [], []
        if chain is not None and t == target:
            if chain.now(c.env, src_call) != src_result:
                raise _Redraw  # the earlier read's answer has moved: "it" would be ambiguous
            planned = chain.plan(c, src_call, src_result)
            if planned is None:
                raise _Redraw
            call, slots, arg = planned
            link = Link(t, 0, arg, source, src_index)
            clauses.append(_form(spec, c, f"chain_{chain.name}", chain.forms, held_out, slots, forms))
            turn_calls.append(call)
            _run(c.env, call)
        n_rest = counts[t] - len(turn_calls)
        src_at = rng.randrange(n_rest) if t == source else -1
        for j in range(n_rest):
            intent = chain.source if j == src_at else rng.choice(spec.intents)
            planned = intent.plan(c)
            if planned is None:
                raise _Redraw
            call, slots = planned
            clauses.append(_form(spec, c, intent.name, intent.forms, held_out, slots, forms))
            turn_calls.append(call)
            result = _run(c.env, call)
            if j == src_at:
                src_call, src_result, src_index = call, result, len(turn_calls) - 1
        turns.append(_sentence(clauses, rng))
        calls.append(tuple(turn_calls))
    if link is not None and any(re.search(rf"(?<!\w){re.escape(str(src_result))}(?!\w)", x) for x in turns):
        raise _Redraw  # the chained value must come from the tool result, not from the user
    return Episode("", spec.name, level, config, tuple(turns), tuple(calls), link, space, tuple(forms))


def _sentence(clauses: list[str], rng: random.Random) -> str:
    text = clauses[0] + "".join(rng.choice(JOINERS) + x for x in clauses[1:])
    return text[0].upper() + text[1:] + "."


def _spec(backend: str) -> Backend:
    if backend not in SPECS:
        raise UserError(f"unknown tool testbed backend {backend!r}; valid: {', '.join(SPECS)}")
    return SPECS[backend]


def check_options(levels: Any = (1, 4), irrelevance: Any = 0.15, space: Any = "train") -> tuple[int, int]:
    """Validated ``levels`` as (min, max); a UserError names the bad option."""
    ok = (isinstance(levels, (list, tuple)) and len(levels) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in levels))
    if not ok or not min(LEVELS) <= levels[0] <= levels[1] <= max(LEVELS):
        raise UserError(f"tool testbed: levels must be [min, max] within {min(LEVELS)}-{max(LEVELS)}, got {levels!r}")
    number = isinstance(irrelevance, (int, float)) and not isinstance(irrelevance, bool)
    if not number or not 0 <= irrelevance <= MAX_IRRELEVANCE:
        raise UserError(f"tool testbed: irrelevance must be a number in [0, {MAX_IRRELEVANCE:.3g}], "
                        f"got {irrelevance!r}")
    if space not in SPACES:
        raise UserError(f"tool testbed: space must be one of {', '.join(SPACES)}, got {space!r}")
    return int(levels[0]), int(levels[1])


def episodes(backend: str, split: str, n: int, seed: int, *, space: str | None = None, levels: Any = (1, 4),
             irrelevance: float = 0.15, exclude: Any = ()) -> list[Episode]:
    """``n`` distinct episodes of ``backend`` in ``space`` (default: ``train`` for the train split,
    else ``held_out``), levels drawn uniformly from ``levels``, none whose :func:`identity` is in
    ``exclude``; ids ``<backend>-<split>-L<level>-<index>``. Pure: the same arguments give the same
    episodes, and the first ``n`` of a larger draw are these."""
    spec = _spec(backend)
    space = space or ("train" if split == "train" else "held_out")
    lo, hi = check_options(levels, irrelevance, space)
    rng = random.Random(f"{seed}:{backend}:{split}")
    out: list[Episode] = []
    seen = set(exclude)
    budget = 200 + 60 * n  # draws: held_out accepts most, train 7/8, seen 1/8
    while len(out) < n and budget > 0:
        level = rng.randint(lo, hi)
        for _ in range(min(budget, 64)):  # redraw at this level: levels stay uniform whatever their rejection rates
            budget -= 1
            try:
                ep = _draw(spec, rng, level, irrelevance, space)
            except _Redraw:
                continue
            key = identity(ep)
            if key not in seen and space_of(ep) == space:
                seen.add(key)
                out.append(replace(ep, id=f"{backend}-{split}-L{level}-{len(out):04d}"))
                break
    if len(out) < n:
        raise UserError(f"tool testbed {backend}: only {len(out)} distinct {space} episodes for {split}; "
                        f"{n} requested (widen levels or lower the sizes)")
    return out


def episode_rows(backend: str, split: str, n: int, seed: int, **options: Any) -> list[dict]:
    """:func:`episodes` as ``episodes:`` rows (one JSON object per line of an episodes file)."""
    return [ep.row() for ep in episodes(backend, split, n, seed, **options)]


# ------------------------------------------------------------------ in-process twins and the checker's verdict


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
    allowed = _allowed(ep.space)
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
        c = _Ctx(env, rng, _allowed(ep.space))
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
