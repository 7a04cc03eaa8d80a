"""Strategy-level distances between solutions: what a solution *does*, not how it is worded.

Word n-grams measure wording: in a check, a paraphrase of one method scored 0.90 from it, a
different method in the same template 0.48, and a bare final answer 1.0, so farthest-point selection
picked outliers and left the different method out. Each distance here compares a *feature set* of
the solution's steps, by Jaccard distance:

- ``steps`` (math, reasoning-gym, the testbed): the equations the trace writes, ``lhs = value``
  with numbers normalised (``1,000`` -> ``1000``, ``8.0`` -> ``8``, ``×``/``·`` -> ``*``, ``÷`` -> ``/``,
  spaces dropped) and the two operands of a lone ``+`` or ``*`` sorted (``5+3=8`` is ``3+5=8``); a
  trace with no equation (a bare answer) has no features. "3+5=8, then 8*2=16" and "First add: 3 + 5
  = 8. Double it: 8 * 2 = 16" are the same strategy (distance 0); "2*3=6, 2*5=10, 6+10=16" is another.
- ``ast`` (code): the statements of the Python code (the first fenced block, else the text) as
  canonical AST dumps with identifiers renamed in order of first use (``v0, v1, ...``) and constants
  replaced by their type, so renaming variables or changing a literal is the same strategy, and a loop
  instead of a comprehension is a different one (docstrings and annotations do not count). Text that
  does not parse as Python has no features.
- ``calls`` (tool use): the sequence of calls as ``name(sorted argument keys)``, order kept (each call
  tagged with its position among calls of that name), so the same calls with other argument values
  are one strategy. Single-turn completions are parsed with the agents' call parser (never evaluated).

Rules shared by all three: two solutions with no features are compared by their word 3-grams (so
prose-only traces of a domain that sometimes writes equations are not all collapsed into one); a
solution with no features against one with features is 0.5 (nothing shown is not evidence of a
different method, so a bare answer never outranks a genuinely different method in farthest-point
selection).

:data:`AUTO` maps a verifier kind to its distance (``distance: auto`` in ``select``); everything
else uses word n-grams. The functions are pure; :func:`distance_fn` gives the registry's
``texts -> matrix`` form.
"""

from __future__ import annotations

import ast
import copy
import math
import re
from itertools import combinations
from typing import Callable

import numpy as np

from mlx_ssp.agents.calls import CallSyntaxError, calls_from_message
from mlx_ssp.select.text import jaccard_distance, ngrams
from mlx_ssp.text.work import charge

EMPTY_VS_SOME = 0.5

# -- math: equations ---------------------------------------------------------------------------

_NUM = r"-?\d[\d,]*(?:\.\d+)?"
# the left side is the run of these characters before "=" (holding a digit); found by scanning back
# from each "= NUMBER", since the regex form of it backtracks in cubic time on long digit runs
_LHS_CHAR = re.compile(r"[\d\s.,+\-*/×÷·x^()]")
_DIGIT = re.compile(r"\d")
_RHS = re.compile(rf"=\s*({_NUM})")
_NUMS = re.compile(_NUM)


def _equations(text: str) -> list[tuple[str, str]]:
    """``(lhs, rhs)`` of each ``lhs = number`` in ``text``, left to right, not overlapping: what
    ``re.findall(r"([C]*\\d[C]*)=\\s*(NUM)")`` gives (C: :data:`_LHS_CHAR`), in linear time: one
    pass, and each character read by at most one scan back (charged to :mod:`mlx_ssp.text.work`)."""
    out, prev = [], 0
    charge(len(text))
    for m in _RHS.finditer(text):
        p = s = m.start()
        while s > prev and _LHS_CHAR.match(text, s - 1):
            s -= 1
        charge(2 * (p - s))  # the scan back and the look for a digit
        if _DIGIT.search(text, s, p):
            out.append((text[s:p], m.group(1)))
            prev = m.end()
    return out


def _num(s: str) -> str:
    s = s.replace(",", "")
    try:
        v = float(s)
    except ValueError:
        return s
    if not math.isfinite(v):  # 309+ digits: int(inf) would raise; the digits are the feature
        return s
    return str(int(v)) if v == int(v) else repr(v)


def _expr(s: str) -> str:
    # a comma or full stop around the expression is prose
    s = re.sub(r"\s+", "", s).strip(",.").replace("×", "*").replace("·", "*").replace("÷", "/")
    s = re.sub(r"(?<=\d)x(?=\d)", "*", s)
    s = _NUMS.sub(lambda m: _num(m.group(0)), s.strip("(").rstrip(")") if s.count("(") != s.count(")") else s)
    m = re.fullmatch(rf"({_NUM})([+*])({_NUM})", s)
    if m:  # a lone commutative step: operand order is not a strategy
        a, op, b = m.groups()
        a, b = sorted((a, b), key=lambda t: (float(t), t))
        s = f"{a}{op}{b}"
    return s


def math_steps(text: str) -> frozenset[str]:
    """The normalised equations of a trace (none: no steps shown, e.g. a bare answer)."""
    eqs = set()
    for lhs, rhs in _equations(text[:20000]):
        lhs = _expr(lhs)
        if lhs and any(c.isdigit() for c in lhs):
            eqs.add(f"{lhs}={_num(rhs)}")
    return frozenset(eqs)


# -- code: canonical statements -----------------------------------------------------------------

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


class _Canon(ast.NodeTransformer):
    """Identifiers renamed in order of first use; constants replaced by their type."""

    def __init__(self):
        self.names: dict[str, str] = {}

    def _rename(self, name: str) -> str:
        return self.names.setdefault(name, f"v{len(self.names)}")

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id=self._rename(node.id), ctx=node.ctx), node)

    def visit_arg(self, node):
        node.arg = self._rename(node.arg)
        node.annotation = None
        return node

    def visit_FunctionDef(self, node):
        node.name = self._rename(node.name)
        node.returns = None
        self.generic_visit(node)
        if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            node.body = node.body[1:] or [ast.Pass()]  # a docstring is wording
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        return node  # attribute names (methods of the standard library) are part of the strategy

    def visit_Constant(self, node):
        return ast.copy_location(ast.Constant(value=type(node.value).__name__), node)


def code_statements(text: str) -> frozenset[str]:
    """Canonical dumps of every statement of the code (nested ones too, each without its body)."""
    m = _FENCE.search(text)
    src = (m.group(1) if m else text)[:50000]
    try:
        tree = _Canon().visit(ast.parse(src))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):  # each statement without its nested blocks (they count on their own)
            head = copy.copy(node)
            for f in ("body", "orelse", "finalbody", "handlers"):
                if hasattr(head, f):
                    setattr(head, f, [])
            out.add(ast.dump(head))
    return frozenset(out)


# -- tool use: call shapes ----------------------------------------------------------------------


def call_shapes(text: str) -> frozenset[str]:
    """``name(keys)#i`` for each call in the completion (i: its rank among calls of that name)."""
    try:
        calls = calls_from_message({"role": "assistant", "content": text[:50000]})
    except CallSyntaxError:
        return frozenset()
    seen: dict[str, int] = {}
    out = set()
    for c in calls:
        shape = f"{c.name}({','.join(sorted(c.arguments))})"
        seen[shape] = seen.get(shape, 0) + 1
        out.add(f"{shape}#{seen[shape]}")
    return frozenset(out)


# -- the distance -------------------------------------------------------------------------------


def feature_distance(a: frozenset, b: frozenset) -> float:
    """Jaccard distance, with the empty-set rules of the module docstring."""
    if not a and not b:
        return 0.0
    if not a or not b:
        return EMPTY_VS_SOME
    return 1.0 - len(a & b) / len(a | b)


FEATURES: dict[str, Callable[[str], frozenset]] = {"steps": math_steps, "ast": code_statements, "calls": call_shapes}

#: verifier kind -> strategy distance (``distance: auto``); other verifiers use word n-grams
AUTO: dict[str, str] = {"math": "steps", "reasoning_gym": "steps", "testbed": "steps", "code": "ast",
                        "toolcall": "calls", "bfcl_multi_turn": "ngram", "episode": "ngram"}  # episodes: their call sequence


def distance_fn(kind: str) -> Callable[[int], Callable[[list[str]], np.ndarray]]:
    """The registry form (``n -> texts -> symmetric matrix``; n unused) of a strategy distance."""
    feat = FEATURES[kind]

    def make(n: int) -> Callable[[list[str]], np.ndarray]:
        def matrix(texts: list[str]) -> np.ndarray:
            fs = [feat(t) for t in texts]
            m = np.zeros((len(fs), len(fs)))
            words = None
            for i, j in combinations(range(len(fs)), 2):
                if not fs[i] and not fs[j]:  # neither shows steps: only their wording can tell them apart
                    if words is None:
                        words = [ngrams(t, 3) for t in texts]
                    m[i, j] = m[j, i] = jaccard_distance(words[i], words[j])
                else:
                    m[i, j] = m[j, i] = feature_distance(fs[i], fs[j])
            return m

        return matrix

    return make


def distinct_strategies(texts: list[str], kind: str) -> int:
    """How many distinct strategies (distinct feature sets) a prompt's solutions show."""
    feat = FEATURES[kind]
    return len({feat(t) for t in texts})
