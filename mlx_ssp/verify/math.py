"""``math`` verifier: extract the final answer, compare it to the reference by mathematical equivalence.

Algorithm:
1. Extract the final answer with :mod:`mlx_ssp.verify.extract` under the task's
   ``metadata["answer_extraction"]`` (``strict`` | ``lenient``; default strict; the lenient last resort
   is the last number in the text).
2. Parse the extracted text and the reference with ``math-verify`` (LaTeX and plain expressions:
   numbers with thousands commas, fractions, percentages, ``\\frac``, ``\\sqrt``...), then compare
   with ``math_verify.verify`` (numeric within its float rounding, symbolic, sets, intervals).

Deviations / choices:
- We extract the answer ourselves instead of letting math-verify scan the whole completion, so that
  strict vs lenient is an explicit, per-domain switch and an intermediate number cannot win.
- Text that contains a word of three or more letters (not a LaTeX command), such as "18 dollars", is
  parsed as plain text (math-verify takes its number); anything else is parsed as LaTeX math (wrapped
  in ``$...$``) so that "2x+1" stays an expression rather than the number 2.
- Bounded work. An extracted answer longer than ``MAX_ANSWER_CHARS`` is no answer. Redundant
  doubled groups (``((x))``, ``{{x}}``) are reduced to one layer first: math-verify's parser takes
  time exponential in such nesting (190 parentheses around 42 scored wrong after its timeout). Then,
  before math-verify sees it, an answer is refused with reason ``answer_too_complex`` when its
  brackets nest deeper than ``MAX_NESTING`` or when an upper-bound estimate of its numbers (powers,
  factorials, binomials, products; symbols count as 1) says some exact integer sympy would compute
  has more than ``MAX_NUMBER_DIGITS`` digits (``9^{9^{9^{9}}}``, ``1000000000!``): such a value
  cannot be an ordinary final answer, and computing it costs seconds to hours.
- math-verify's own timeouts use ``signal.alarm``, which only works in the main thread; off the main
  thread we call it without one. :func:`mlx_ssp.verify.verify` puts a per-item time limit around
  every in-process verifier, in any thread, as the last resort.
- Parsed references are cached (one reference is scored against K completions), and so are
  judgements of (reference, extracted answer) pairs (the K samples often agree). Two plain
  integers (up to 15 digits) are compared as integers without math-verify: the same verdict
  (tested against math-verify), a thousandth of the cost.
"""

from __future__ import annotations

import math
import re
import threading
from functools import lru_cache
from typing import TYPE_CHECKING

from mlx_ssp.verify import VerifyResult, register
from mlx_ssp.verify.extract import DEFAULT_MODE, MODES, extract

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task

_WORD_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")
_INT_RE = re.compile(r"[+-]?[0-9]{1,15}\Z")  # short enough that no float rounding can merge two of them
MAX_ANSWER_CHARS = 400  # a "final answer" longer than this is a runaway line, not an answer
MAX_NESTING = 10  # bracket depth beyond which an answer is "too complex" (math-verify slows sharply)
MAX_NUMBER_DIGITS = 100_000  # no exact integer in an answer may be estimated larger than this
_LOG10_2 = math.log10(2)
_GROUP_TOKEN_RE = re.compile(r"\\.|[(){}\[\]]", re.DOTALL)
_MAG_TOKEN_RE = re.compile(r"\s+|(\d+(?:\.\d*)?|\.\d+)|(\\[A-Za-z]+|\\.)|(\*\*)|(.)", re.DOTALL)
_PAIRS = {"(": ")", "{": "}", "[": "]"}


def reduce_grouping(ans: str) -> str:
    """``ans`` with every redundant doubled ``(`` ``)`` or ``{`` ``}`` layer removed (``((x))`` ->
    ``(x)``), in one stack pass; unchanged when its brackets do not pair up. Escaped ``\\{`` is a
    literal, not a group."""
    stack: list[tuple[str, int]] = []
    pairs: dict[int, int] = {}
    for m in _GROUP_TOKEN_RE.finditer(ans):
        c, i = m.group(), m.start()
        if c[0] == "\\":
            continue
        if c in _PAIRS:
            stack.append((c, i))
        elif not stack or _PAIRS[stack[-1][0]] != c:
            return ans
        else:
            pairs[stack.pop()[1]] = i
    if stack:
        return ans
    drop = {i for i, j in pairs.items() if ans[i] in "({" and pairs.get(i + 1) == j - 1 and ans[i + 1] == ans[i]}
    if not drop:
        return ans
    drop |= {pairs[i] for i in drop}
    return "".join(c for k, c in enumerate(ans) if k not in drop)


def _nesting(ans: str) -> int:
    depth = best = 0
    for m in _GROUP_TOKEN_RE.finditer(ans):
        c = m.group()
        if c in _PAIRS:
            depth += 1
            best = max(best, depth)
        elif c in ")}]":
            depth = max(0, depth - 1)
    return best


def _value(mag: float) -> float:
    """An upper bound of a number from an upper bound of its log10 (inf when huge)."""
    return 10.0 ** mag if mag < 300 else math.inf


class _Magnitude:
    """Upper-bound estimate of log10 of the numbers an answer denotes, by a loose recursive descent
    over its tokens (never fails: unknown tokens count as 1). ``worst`` is the largest estimate of
    any sub-expression, since sympy evaluates exact integers bottom-up. Recursion depth is bounded
    by the bracket depth, which the caller has checked."""

    def __init__(self, ans: str):
        self.toks = [m for m in _MAG_TOKEN_RE.finditer(ans) if not m.group().isspace()]
        self.i = 0
        self.worst = 0.0

    def _peek(self) -> str:
        return self.toks[self.i].group() if self.i < len(self.toks) else ""

    def _note(self, mag: float) -> float:
        self.worst = max(self.worst, mag)
        return mag

    def sequence(self, closer: str = "") -> float:
        """A run of factors and operators up to ``closer``: a product bounds it (each + or - adds
        a factor of 2)."""
        total = 0.0
        while self.i < len(self.toks):
            t = self._peek()
            if t == closer:
                self.i += 1
                break
            if t in ")}]":  # a stray closer
                self.i += 1
                continue
            if t in ("+", "-", "\\pm", "\\mp"):
                self.i += 1
                total += _LOG10_2
                continue
            total += self.chain()
        return self._note(total)

    def chain(self) -> float:
        """``a ^ b ^ c`` (``**`` too), right-associative, folded without recursion."""
        operands = [self.postfix()]
        while self._peek() in ("^", "**"):
            self.i += 1
            operands.append(self.postfix())
        mag = operands.pop()
        while operands:
            base = operands.pop()
            mag = self._note(_value(mag) * base if base > 0 else 0.0)
        return mag

    def postfix(self) -> float:
        mag = self.primary()
        while self._peek() == "!":
            self.i += 1
            n = _value(mag)
            mag = self._note(math.inf if n > 1e300 else math.lgamma(n + 1) / math.log(10) if n > 1 else 0.0)
        return mag

    def primary(self) -> float:
        if self.i >= len(self.toks):
            return 0.0
        m = self.toks[self.i]
        self.i += 1
        t = m.group()
        if m.group(1):
            digits = t.split(".")[0].lstrip("0")
            return self._note(len(digits) if len(digits) > 15 else math.log10(max(1.0, float(t))))
        if t in _PAIRS:
            return self.sequence(_PAIRS[t])
        if t in ("\\frac", "\\dfrac", "\\tfrac", "\\cfrac"):
            return self._note(self.primary() + self.primary())
        if t == "\\binom":
            n, k = self.primary(), self.primary()  # C(n, k) <= min(2^n, n^k)
            return self._note(min(_value(n) * _LOG10_2, _value(k) * n))
        if t == "\\sqrt":
            if self._peek() == "[":
                self.i += 1
                self.sequence("]")
            return self.primary()
        if t in ("\\text", "\\mathrm", "\\textbf", "\\mathbf", "\\operatorname", "\\mbox"):
            self.primary()
            return 0.0
        return 0.0  # a symbol, a command, an operator: counts as 1


def too_complex(ans: str) -> str | None:
    """Why ``ans`` is refused before math-verify (see the module docstring), or None."""
    depth = _nesting(ans)
    if depth > MAX_NESTING:
        return f"brackets nest {depth} deep (limit {MAX_NESTING})"
    est = _Magnitude(ans)
    est.sequence()
    if est.worst > MAX_NUMBER_DIGITS:
        size = "more than 1e300" if math.isinf(est.worst) else f"about {est.worst:.3g}"
        return f"a number in it would have {size} digits (limit {MAX_NUMBER_DIGITS})"
    return None


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def _math_text(ans: str) -> str:
    """How to present ``ans`` to math-verify: plain text if it reads like prose, else ``$...$``."""
    if "$" in ans or "\\(" in ans or "\\[" in ans:
        return ans
    if _WORD_RE.search(ans):
        return ans
    return f"${ans}$"


@lru_cache(maxsize=1)
def _math_verify():
    """math-verify and its two extraction configs. Imported on first use: it pulls in sympy and
    latex2sympy2 (~0.6 s), which commands that never score a math answer (merge, export) should not pay."""
    import math_verify

    return math_verify, (math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig())


def _parse(ans: str) -> list:
    mv, configs = _math_verify()
    return mv.parse(_math_text(ans), extraction_config=configs, parsing_timeout=_timeout())


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    return tuple(_parse(gold))


def equivalent(gold: str, pred: str) -> bool:
    """``pred`` equals ``gold`` mathematically (both are short answer strings)."""
    g = list(_parse_gold(gold))
    p = _parse(pred)
    if not g or not p:
        return False
    return bool(_math_verify()[0].verify(g, p, timeout_seconds=_timeout()))


def _check(task: "Task") -> None:
    if task.answer is None or (isinstance(task.answer, str) and not task.answer.strip()):
        raise ValueError("missing 'answer' (the reference answer)")
    if isinstance(task.answer, (dict, list)):
        raise ValueError("'answer' must be a number or a string")
    mode = task.metadata.get("answer_extraction", DEFAULT_MODE)
    if mode not in MODES:
        raise ValueError(f"metadata.answer_extraction '{mode}' is not one of {', '.join(MODES)}")
    if not _parse_gold(str(task.answer)):
        raise ValueError(f"math-verify cannot parse the reference answer {task.answer!r}")


@register("math", check=_check)
def verify_math(completion: str, task: "Task") -> VerifyResult:
    mode = task.metadata.get("answer_extraction", DEFAULT_MODE)
    ex = extract(completion or "", mode, last_resort="last_number")
    if ex is None or not ex.text:
        return VerifyResult(0.0, "no_answer", "")
    if len(ex.text) > MAX_ANSWER_CHARS:
        return VerifyResult(0.0, "no_answer", f"{ex.method}: answer longer than {MAX_ANSWER_CHARS} chars")
    detail = f"{ex.method}: {ex.text[:200]}"
    pred, why = _guard(ex.text)
    if why is not None:
        return VerifyResult(0.0, "answer_too_complex", f"{detail} ({why})")
    ok = _judge(str(task.answer), pred)
    if ok is None:
        return VerifyResult(0.0, "unparsable", detail)
    return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer", detail)


@lru_cache(maxsize=65536)
def _guard(text: str) -> tuple[str, str | None]:
    """The answer as math-verify will see it, and why it is refused (None: it is not). Cached like
    :func:`_judge`; a plain integer needs neither step."""
    if _INT_RE.match(text):
        return text, None
    pred = reduce_grouping(text)
    return pred, too_complex(pred)


@lru_cache(maxsize=65536)
def _judge(gold: str, pred_text: str) -> bool | None:
    """Whether the extracted answer equals the reference (None: the answer does not parse). Cached:
    the K samples of a task often end in the same answer, and parsing is most of a rollout's
    verification cost."""
    if _INT_RE.match(gold) and _INT_RE.match(pred_text):
        # plain integers (most GSM8K-style answers): math-verify's verdict is integer equality
        # (tested against it), at a thousandth of the cost of a sympy parse
        return int(gold) == int(pred_text)
    return _judge_math_verify(gold, pred_text)


def _judge_math_verify(gold: str, pred_text: str) -> bool | None:
    pred = _parse(pred_text)
    if not pred:
        return None
    g = list(_parse_gold(gold))
    return bool(g) and bool(_math_verify()[0].verify(g, pred, timeout_seconds=_timeout()))
