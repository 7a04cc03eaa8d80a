"""The tool testbed's intents: what a user asks of each of the four backends (four paraphrases of a
clause per intent), how each request is planned as a call on the backend's current state, the
chained calls and the irrelevance requests (:data:`SPECS`; the overview is
:mod:`mlx_ssp.testbed.tools.episodes`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_ssp.agents.calls import Call
from mlx_ssp.testbed.tools.space import POOLS

AMOUNTS = range(2, 10)  # amounts the user names; counts and balances are 10-99, so never confused with them


@dataclass
class Ctx:
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
    plan: Callable[[Ctx], Planned]
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
    plan: Callable[[Ctx, Call, Any], tuple[Call, dict, str] | None]
    now: Callable[[Any, Call], Any]


@dataclass(frozen=True)
class Backend:
    name: str
    config: Callable[[Ctx], dict]
    intents: tuple[Intent, ...]
    chains: tuple[Chain, ...]
    irrelevant: Intent
    #: tool -> (another backend, its tool of nearly the same meaning or the same name)
    confusable: dict[str, tuple[str, str]]


def _amount(c: Ctx) -> int:
    return c.rng.choice(AMOUNTS)


def _distinct_numbers(c: Ctx, k: int) -> list[int]:
    return c.rng.sample(range(10, 100), k)  # distinct: top() and richest() have one answer


# -- KeyValue


def _kv_get(c: Ctx) -> Planned:
    k = c.pick(among=c.env.data)
    return k and (Call("get", {"key": k}), {"k": k})


def _kv_put(c: Ctx) -> Planned:
    k = c.pick("word")
    v = k and c.pick("value", exclude=(c.env.data.get(k),))
    return v and (Call("put", {"key": k, "value": v}), {"k": k, "v": v})


def _kv_delete(c: Ctx) -> Planned:
    k = c.pick(among=c.env.data) if len(c.env.data) > 2 else None
    return k and (Call("delete", {"key": k}), {"k": k})


def _kv_keys(c: Ctx) -> Planned:
    return (Call("keys", {}), {}) if c.once("#list") else None


def _kv_copy(c: Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    k = src.arguments["key"]
    c.busy.add(k)
    k2 = c.pick("word", exclude=tuple(x for x, v in c.env.data.items() if v == value))
    return k2 and (Call("put", {"key": k2, "value": value}), {"k": k, "k2": k2}, "value")


def _kv_irrelevant(c: Ctx) -> Planned:
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


def _ctr_get(c: Ctx) -> Planned:
    n = c.pick(among=c.env.counts)
    return n and (Call("get", {"name": n}), {"n": n})


def _ctr_add(c: Ctx) -> Planned:
    n = c.pick("word")
    a = _amount(c)
    return n and (Call("add", {"name": n, "amount": a}), {"n": n, "a": a})


def _ctr_inc(c: Ctx) -> Planned:
    n = c.pick("word")
    return n and (Call("add", {"name": n}), {"n": n})


def _ctr_clear(c: Ctx) -> Planned:
    n = c.pick(among=[x for x, v in c.env.counts.items() if v != 0])
    return n and (Call("clear", {"name": n}), {"n": n})


def _ctr_top(c: Ctx) -> Planned:
    return (Call("top", {}), {}) if c.once("#list") else None


def _ctr_add_count(c: Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    n = src.arguments["name"]
    c.busy.add(n)
    n2 = c.pick("word")
    return n2 and (Call("add", {"name": n2, "amount": value}), {"n": n, "n2": n2}, "amount")


def _ctr_add_top(c: Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    c.busy.add(value)
    a = _amount(c)
    return Call("add", {"name": value, "amount": a}), {"a": a}, "name"


def _ctr_irrelevant(c: Ctx) -> Planned:
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


def _fs_ls(c: Ctx) -> Planned:
    return (Call("ls", {}), {}) if c.once("#list") else None


def _fs_cat(c: Ctx) -> Planned:
    f = c.pick(among=c.env.files)
    return f and (Call("cat", {"name": f}), {"f": f})


def _fs_write(c: Ctx) -> Planned:
    f = c.pick("word")
    t = f and c.pick("text", exclude=(c.env.files.get(f),))
    return t and (Call("write", {"name": f, "text": t}), {"f": f, "t": t})


def _fs_rm(c: Ctx) -> Planned:
    f = c.pick(among=c.env.files) if len(c.env.files) > 2 else None
    return f and (Call("rm", {"name": f}), {"f": f})


def _fs_copy(c: Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    f = src.arguments["name"]
    c.busy.add(f)
    f2 = c.pick("word", exclude=tuple(x for x, v in c.env.files.items() if v == value))
    return f2 and (Call("write", {"name": f2, "text": value}), {"f": f, "f2": f2}, "text")


def _fs_irrelevant(c: Ctx) -> Planned:
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


def _bank_balance(c: Ctx) -> Planned:
    a = c.pick(among=c.env.accounts)
    return a and (Call("balance", {"account": a}), {"a": a})


def _bank_deposit(c: Ctx) -> Planned:
    a = c.pick(among=c.env.accounts)
    m = _amount(c)
    return a and (Call("deposit", {"account": a, "amount": m}), {"a": a, "m": m})


def _bank_transfer(c: Ctx) -> Planned:
    m = _amount(c)
    s = c.pick(among=[x for x, v in c.env.accounts.items() if v >= m])
    d = s and c.pick(among=c.env.accounts)
    return d and (Call("transfer", {"src": s, "dst": d, "amount": m}), {"s": s, "d": d, "m": m})


def _bank_richest(c: Ctx) -> Planned:
    return (Call("richest", {}), {}) if c.once("#list") else None


def _bank_deposit_balance(c: Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    a = src.arguments["account"]
    c.busy.add(a)
    a2 = c.pick(among=c.env.accounts)
    return a2 and (Call("deposit", {"account": a2, "amount": value}), {"a": a, "a2": a2}, "amount")


def _bank_pay_from_richest(c: Ctx, src: Call, value: Any) -> tuple[Call, dict, str] | None:
    c.busy.add(value)
    d = c.pick(among=c.env.accounts)
    m = _amount(c)
    return d and (Call("transfer", {"src": value, "dst": d, "amount": m}), {"d": d, "m": m}, "src")


def _bank_irrelevant(c: Ctx) -> Planned:
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
