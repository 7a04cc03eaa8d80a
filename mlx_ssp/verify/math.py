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
- math-verify's timeouts use ``signal.alarm``, which only works in the main thread; off the main
  thread we call it without a timeout (answers are one short line, so parsing is bounded anyway).
- Parsed references are cached (one reference is scored against K completions), and so are
  judgements of (reference, extracted answer) pairs (the K samples often agree). Two plain
  integers (up to 15 digits) are compared as integers without math-verify: the same verdict
  (tested against math-verify), a thousandth of the cost.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from typing import TYPE_CHECKING

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
from math_verify import verify as mv_verify

from mlx_ssp.verify import VerifyResult, register
from mlx_ssp.verify.extract import DEFAULT_MODE, MODES, extract

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task

_CONFIGS = (LatexExtractionConfig(), ExprExtractionConfig())
_WORD_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")
_INT_RE = re.compile(r"[+-]?[0-9]{1,15}\Z")  # short enough that no float rounding can merge two of them
MAX_ANSWER_CHARS = 400  # a "final answer" longer than this is a runaway line, not an answer


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def _math_text(ans: str) -> str:
    """How to present ``ans`` to math-verify: plain text if it reads like prose, else ``$...$``."""
    if "$" in ans or "\\(" in ans or "\\[" in ans:
        return ans
    if _WORD_RE.search(ans):
        return ans
    return f"${ans}$"


def _parse(ans: str) -> list:
    return parse(_math_text(ans), extraction_config=_CONFIGS, parsing_timeout=_timeout())


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    return tuple(_parse(gold))


def equivalent(gold: str, pred: str) -> bool:
    """``pred`` equals ``gold`` mathematically (both are short answer strings)."""
    g = list(_parse_gold(gold))
    p = _parse(pred)
    if not g or not p:
        return False
    return bool(mv_verify(g, p, timeout_seconds=_timeout()))


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
    ok = _judge(str(task.answer), ex.text)
    if ok is None:
        return VerifyResult(0.0, "unparsable", detail)
    return VerifyResult(1.0 if ok else 0.0, "correct" if ok else "wrong_answer", detail)


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
    return bool(g) and bool(mv_verify(g, pred, timeout_seconds=_timeout()))
