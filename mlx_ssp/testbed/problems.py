"""The testbed's synthetic task family: problems, their correct strategies, and traces.

Three domains built so that the recipe's questions have room to show an effect:

- ``sum`` -- ``add 3 5 2 4``: the total. Strategies: ``chain`` (left to right: ``3+5=8 ; 8+2=10 ;
  10+4=14``), ``pairs`` (adjacent pairs, then their sums: ``3+5=8 ; 2+4=6 ; 8+6=14``) and
  ``sorted`` (largest first, then a chain). Difficulty: the number of terms (2-6) and their size.
  Both arithmetic domains also have ``direct`` (``answer 14`` with no working): a correct trace,
  but one that a small model can only write for problems it can add up at a glance.
- ``diff`` -- ``sub 20 5 2``: the first number minus the rest. Strategies: ``chain``
  (``20-5=15 ; 15-2=13``) and ``group`` (the subtrahends summed first: ``5+2=7 ; 20-7=13``). The same
  surface as ``sum`` (a verb, numbers, ``a op b = c`` steps), so the two domains interfere: a model
  trained on one writes the other's operator.
- ``countdown`` -- ``make 14 from 3 5 2 4``: an expression over some of the numbers (each at most as
  often as given; ``+ - *``, parentheses) whose value is the target. Its strategies are the distinct
  solutions (by their set of intermediate results), usually several per problem.

Every trace is ``step ; step ; ...`` then a last line ``answer X`` (a number, or the countdown
expression). :func:`trace` writes one strategy's trace; :func:`strategies` lists the strategies that
solve a problem (so a spectrum exists, and pretraining can weight them unequally); :func:`solve`
checks a final answer. All pure and seeded (``random.Random``).
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Optional

DOMAINS = ("sum", "diff", "countdown")


@dataclass(frozen=True)
class Problem:
    """One problem: its domain, numbers (and countdown target), the prompt, and its difficulty level
    (number of terms / numbers)."""

    domain: str
    numbers: tuple[int, ...]
    target: Optional[int] = None
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def prompt(self) -> str:
        nums = " ".join(map(str, self.numbers))
        if self.domain == "sum":
            return f"add {nums}"
        if self.domain == "diff":
            return f"sub {nums}"
        return f"make {self.target} from {nums}"

    @property
    def level(self) -> int:
        return len(self.numbers)

    @property
    def answer(self) -> Optional[int]:
        """The number a ``sum``/``diff`` answer must be (None for countdown: any valid expression)."""
        if self.domain == "sum":
            return sum(self.numbers)
        if self.domain == "diff":
            return self.numbers[0] - sum(self.numbers[1:])
        return None


# -- drawing problems ------------------------------------------------------------------------------

HELD_OUT_MOD = 4


def held_out(p: Problem) -> bool:
    """Whether a problem belongs to the held-out quarter of the problem space (by a hash of its
    prompt): pretraining never sees these, and only they are drawn into eval and probe splits, so
    held-out pass rates measure what was learnt, not what was memorised."""
    import zlib

    return zlib.crc32(p.prompt.encode()) % HELD_OUT_MOD == 0


def draw(domain: str, rng: random.Random, level: int, max_term: int = 9) -> Problem:
    """A problem of ``domain`` at ``level`` terms/numbers (sum, diff: 2-6; countdown: 2-4)."""
    if domain == "sum":
        return Problem("sum", tuple(rng.randint(1, max_term) for _ in range(level)))
    if domain == "diff":
        rest = [rng.randint(1, max_term) for _ in range(level - 1)]
        return Problem("diff", (sum(rest) + rng.randint(0, 2 * max_term), *rest))  # never negative
    if domain == "countdown":
        nums = tuple(rng.randint(1, max_term) for _ in range(level))
        sols = countdown_solutions(nums)
        targets = sorted(v for v in sols if 1 <= v <= 99)
        # prefer targets with two or more distinct solutions: the spectrum this domain exists for
        multi = [t for t in targets if len(sols[t]) > 1 and len(_distinct(sols[t])) > 1]
        return Problem("countdown", nums, rng.choice(multi or targets))
    raise ValueError(f"unknown testbed domain {domain!r}; valid: {', '.join(DOMAINS)}")


# -- strategies and traces -------------------------------------------------------------------------


def _chain(terms: list[int], op: str) -> tuple[list[str], int]:
    acc, steps = terms[0], []
    for t in terms[1:]:
        new = acc + t if op == "+" else acc - t
        steps.append(f"{acc}{op}{t}={new}")
        acc = new
    return steps, acc


def _pairs(terms: list[int]) -> tuple[list[str], int]:
    """Sum adjacent pairs, grouped from the right (an odd first term waits), then the sums, until one
    is left: for three terms ``b+c`` comes first, so it differs from the chain at every level > 2."""
    steps, level = [], list(terms)
    while len(level) > 1:
        head, rest = (level[:1], level[1:]) if len(level) % 2 else ([], level)
        nxt = []
        for i in range(0, len(rest), 2):
            s = rest[i] + rest[i + 1]
            steps.append(f"{rest[i]}+{rest[i + 1]}={s}")
            nxt.append(s)
        level = head + nxt
    return steps, level[0]


def _sum_steps(p: Problem, name: str) -> tuple[list[str], str]:
    terms = list(p.numbers)
    if name == "chain":
        steps, v = _chain(terms, "+")
    elif name == "pairs":
        steps, v = _pairs(terms)
    else:  # sorted
        steps, v = _chain(sorted(terms, reverse=True), "+")
    return steps, str(v)


def _diff_steps(p: Problem, name: str) -> tuple[list[str], str]:
    first, rest = p.numbers[0], list(p.numbers[1:])
    if name == "chain":
        steps, v = _chain([first, *rest], "-")
        return steps, str(v)
    steps, s = _chain(rest, "+") if len(rest) > 1 else ([], rest[0])  # group: the subtrahends first
    return steps + [f"{first}-{s}={first - s}"], str(first - s)


def countdown_solutions(nums: tuple[int, ...]) -> dict[int, list[tuple[str, tuple[str, ...]]]]:
    """value -> [(expression, steps)] over every ordered subset of 2+ numbers combined left to right
    or as two pairs, with + - * (non-negative intermediates): the solutions a trace can write."""
    out: dict[int, list[tuple[str, tuple[str, ...]]]] = {}
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

    def add(v, expr, steps):
        if v >= 0:
            out.setdefault(v, []).append((expr, tuple(steps)))

    for k in range(2, len(nums) + 1):
        for perm in itertools.permutations(range(len(nums)), k):
            xs = [nums[i] for i in perm]
            for opseq in itertools.product(ops, repeat=k - 1):  # ((a o b) o c) o d
                v, expr, steps, ok = xs[0], str(xs[0]), [], True
                for o, x in zip(opseq, xs[1:]):
                    new = ops[o](v, x)
                    if new < 0:
                        ok = False
                        break
                    steps.append(f"{v}{o}{x}={new}")
                    expr = f"({expr}){o}{x}" if o == "*" and ("+" in expr or "-" in expr) else f"{expr}{o}{x}"
                    v = new
                if ok:
                    add(v, expr, steps)
            if k == 4:  # (a o b) o (c o d)
                for o1, o2, o3 in itertools.product(ops, repeat=3):
                    a, b = ops[o1](xs[0], xs[1]), ops[o2](xs[2], xs[3])
                    v = ops[o3](a, b)
                    if min(a, b, v) >= 0:
                        add(v, f"({xs[0]}{o1}{xs[1]}){o3}({xs[2]}{o2}{xs[3]})",
                            [f"{xs[0]}{o1}{xs[1]}={a}", f"{xs[2]}{o2}{xs[3]}={b}", f"{a}{o3}{b}={v}"])
    return out


def _distinct(solutions: list[tuple[str, tuple[str, ...]]]) -> dict[str, tuple[list[str], str]]:
    """Distinct solutions by their set of intermediate results (a reordering of the same steps is
    one strategy), named ``s0, s1, ...`` in a canonical order (fewest steps, then by text)."""
    seen: dict[frozenset, tuple[list[str], str]] = {}
    for expr, steps in solutions:
        key = frozenset(s.split("=")[1] for s in steps) | {len(steps)}
        if key not in seen or (len(steps), expr) < (len(seen[key][0]), seen[key][1]):
            seen[key] = (list(steps), expr)
    ranked = sorted(seen.values(), key=lambda se: (len(se[0]), se[1]))
    return {f"s{i}": se for i, se in enumerate(ranked)}


def _countdown_strategies(p: Problem) -> dict[str, tuple[list[str], str]]:
    return _distinct(countdown_solutions(p.numbers).get(p.target, []))


def strategies(p: Problem) -> dict[str, tuple[list[str], str]]:
    """strategy name -> (steps, final answer) for every strategy that solves ``p``."""
    if p.domain == "countdown":
        return _countdown_strategies(p)
    if p.domain == "sum":
        found = {n: _sum_steps(p, n) for n in ("chain", "pairs", "sorted")}
    else:
        found = {n: _diff_steps(p, n) for n in ("chain", "group")}
    found["direct"] = ([], str(p.answer))  # last: a zero weight for it leaves older corpora's draws unchanged
    out: dict[str, tuple[list[str], str]] = {}
    for n, st in found.items():  # a strategy that writes an earlier one's steps (sorted input) is that one
        if all(st[0] != o[0] for o in out.values()):
            out[n] = st
    return out


def trace(p: Problem, name: str) -> str:
    """The completion text of strategy ``name`` on ``p``."""
    steps, ans = strategies(p)[name]
    return " ; ".join(steps) + f"\nanswer {ans}" if steps else f"answer {ans}"


# -- checking an answer ------------------------------------------------------------------------------

_ANSWER = re.compile(r"^\s*answer\s+(.+?)\s*$", re.MULTILINE)
_TOKEN = re.compile(r"\s*(\d+|[-+*()])")
MAX_EXPR_CHARS = 64


def final_answer(completion: str) -> Optional[str]:
    """The text after the last ``answer`` line, or None."""
    found = _ANSWER.findall(completion[-4096:])
    return found[-1] if found else None


def parse_expression(text: str) -> Optional[tuple[int, list[int]]]:
    """(value, the numbers it uses) of an expression of non-negative integers, + - * and
    parentheses, by recursive descent (model output is data: nothing is evaluated as code); None if
    it is not one. Bounded: at most :data:`MAX_EXPR_CHARS` characters."""
    if len(text) > MAX_EXPR_CHARS:
        return None
    toks, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            return None
        toks.append(m.group(1))
        pos = m.end()
    used: list[int] = []
    i = 0

    def atom():
        nonlocal i
        if i < len(toks) and toks[i].isdigit():
            used.append(int(toks[i]))
            i += 1
            return int(toks[i - 1])
        if i < len(toks) and toks[i] == "(":
            i += 1
            v = expr()
            if v is None or i >= len(toks) or toks[i] != ")":
                return None
            i += 1
            return v
        return None

    def term():
        nonlocal i
        v = atom()
        while v is not None and i < len(toks) and toks[i] == "*":
            i += 1
            w = atom()
            v = None if w is None else v * w
        return v

    def expr():
        nonlocal i
        v = term()
        while v is not None and i < len(toks) and toks[i] in "+-":
            op = toks[i]
            i += 1
            w = term()
            v = None if w is None else (v + w if op == "+" else v - w)
        return v

    v = expr()
    return None if v is None or i != len(toks) else (v, used)


def solve(p: Problem, completion: str) -> tuple[bool, str]:
    """(correct, reason) of a completion's final answer."""
    ans = final_answer(completion)
    if ans is None:
        return False, "no_answer"
    if p.domain != "countdown":
        return (ans == str(p.answer), "correct" if ans == str(p.answer) else "wrong_answer")
    parsed = parse_expression(ans)
    if parsed is None:
        return False, "bad_expression"
    value, used = parsed
    pool = list(p.numbers)
    for n in used:
        if n not in pool:
            return False, "numbers_not_given"
        pool.remove(n)
    return (value == p.target, "correct" if value == p.target else "wrong_answer")


#: domain -> level range (min, max) the family draws from
LEVELS: dict[str, tuple[int, int]] = {"sum": (2, 6), "diff": (2, 6), "countdown": (2, 4)}


def problem_from_meta(domain: str, meta: dict) -> Problem:
    return Problem(domain, tuple(int(x) for x in meta["numbers"]), meta.get("target"))
