"""Final-answer extraction from a completion, shared by the ``math`` and ``reasoning_gym`` verifiers.

Two modes, chosen per domain (``tasks.domains.<name>.answer_extraction``) and stored in each task's
``metadata["answer_extraction"]`` so that ``mlx_ssp verify`` re-scores a file exactly as the rollout did:

- ``strict``: the answer after the *last* of these markers, whichever comes last in the text:
  ``Answer:`` (any case, markdown bold allowed), ``#### `` (GSM8K style), ``\\boxed{...}`` / ``\\fbox{...}``
  (balanced braces). The answer is the rest of the marker's line; when that is empty, the next
  block of non-empty lines (a grid written under ``Answer:``). Anything else is "no answer".
- ``lenient``: strict first; then the last "answer is X"; then the last "= X" (the right-hand side of
  the last equals sign); then a verifier-specific last resort: the last number (``math``) or the last
  non-empty line (``reasoning_gym``). It exists because the demo model rarely writes the requested
  format, and strict scoring gives RL almost no signal.

Text before the last ``</think>`` is dropped (thinking models reason there; the answer follows it).

Bounded work (a policy under RL writes whatever makes the verifier slow): only the last
:data:`MAX_SCAN_CHARS` characters after ``</think>`` are searched, and every step is linear in that
length. Each marker kind is found by one regex pass that keeps only its last match (no regex here
can backtrack: quantifiers that could give characters back to a neighbour are possessive), only
the winning marker's line is read, and ``\\boxed{`` braces are matched in one stack pass over the
braces instead of one scan per ``\\boxed{``. Each scan charges the characters it covers to
:mod:`mlx_ssp.text.work`, where the tests bound it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlx_ssp.text.region import MAX_SCAN_CHARS, answer_region, strip_thinking  # noqa: F401  (re-exported)
from mlx_ssp.text.work import charge

MODES = ("strict", "lenient")
DEFAULT_MODE = "strict"
_ANSWER_RE = re.compile(
    r"(?:\*\*|__)?\b(?:final[ \t]++)?answer[ \t]*+(?:\*\*|__)?[ \t]*+:[ \t]*+(?:\*\*|__)?", re.IGNORECASE
)
_HASH_RE = re.compile(r"####")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*+\{")
_BRACE_RE = re.compile(r"[{}]")
_ANSWER_IS_RE = re.compile(r"\banswer\s++(?:is|=|would be|will be)\s*+:?\s*+", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\$?\d[\d,]*+(?:\.\d+)?(?:\s*+/\s*+\d+)?%?|-?\.\d+")
_SENTENCE_END_RE = re.compile(r"(?<!\d)\.(?!\d)|\.\s")
_EMPHASIS = "*_`"


@dataclass(frozen=True)
class Extracted:
    text: str  # the answer text (may be empty when the marker was followed by nothing)
    method: str  # answer_marker | hashes | boxed | answer_is | last_equals | last_number | last_line


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    charge(len(text))  # one pass: no pattern here can backtrack
    last = None
    for last in pattern.finditer(text):
        pass
    return last


def _balanced(text: str, start: int) -> str | None:
    """Content of a brace group whose ``{`` is at ``start - 1``; None if it never closes."""
    depth = 1
    for m in _BRACE_RE.finditer(text, start):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            charge(m.end() - start)
            return text[start:m.start()]
    charge(len(text) - start)
    return None


def _last_closed_box(text: str) -> tuple[int, str] | None:
    """(start, content) of the last ``\\boxed{...}`` whose brace closes, by one stack pass."""
    charge(2 * len(text))  # the two looks for a box
    if "\\boxed" not in text and "\\fbox" not in text:  # the common case, at C speed
        return None
    charge(len(text))  # the regex pass
    boxes = list(_BOX_RE.finditer(text))
    if not boxes:
        return None
    first = boxes[0].end() - 1
    charge(len(text) - first + len(boxes))  # the brace pass, then the boxes from the last
    closes: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_RE.finditer(text, first):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            closes[stack.pop()] = m.start()
    for m in reversed(boxes):
        end = closes.get(m.end() - 1)
        if end is not None:
            return m.start(), text[m.end():end]
    return None


def _strip_emphasis(ans: str) -> str:
    """Drop leading and trailing markdown emphasis tokens (``**``, ``__``, ``*``, backtick) in linear
    time: the same result as ``re.sub(r"^(?:\\*\\*|__|\\*|`)+|(?:\\*\\*|__|\\*|`)+$", "", ans)``,
    whose second alternative backtracks exponentially on a run of ``*`` that does not end the text."""
    if not ans or ans[0] not in _EMPHASIS and ans[-1] not in _EMPHASIS:
        return ans
    n, p = len(ans), 0
    while p < n:
        if ans.startswith(("**", "__"), p):
            p += 2
        elif ans[p] in "*`":
            p += 1
        else:
            break
    i = n
    while i > p and ans[i - 1] in _EMPHASIS:
        i -= 1
    charge(p + 2 * (n - i))  # the leading run; the trailing run here and in the underscore pass
    # an underscore only strips in pairs: start after the last odd run of underscores
    j = n
    while j > i:
        if ans[j - 1] != "_":
            j -= 1
            continue
        k = j
        while k > i and ans[k - 1] == "_":
            k -= 1
        if (j - k) % 2:
            i = k + 1
            break
        j = k
    return ans[p:i]


def _clean(ans: str) -> str:
    charge(len(ans))
    ans = ans.strip()
    # markdown emphasis and surrounding math delimiters the model may wrap its answer in
    ans = _strip_emphasis(ans).strip()
    if len(ans) >= 2 and ans[0] == ans[-1] == "$":
        ans = ans[1:-1].strip()
    elif ans.startswith("\\(") and ans.endswith("\\)") or ans.startswith("\\[") and ans.endswith("\\]"):
        ans = ans[2:-2].strip()
    return ans.rstrip(".").strip()


def unclean_period(text: str, ex: "Extracted") -> str | None:
    """The extracted answer with its trailing period kept, when the completion had one there
    (for answers that end in a period, such as a sentence); None otherwise."""
    i = text.rfind(ex.text)
    if i >= 0 and text[i + len(ex.text):i + len(ex.text) + 1] == ".":
        return ex.text + "."
    return None


def _rest_of_line(text: str, pos: int) -> str:
    """Text from ``pos`` to the end of its line; if that is blank, the next block of non-empty
    lines (a multi-line answer such as a grid written under ``Answer:``)."""
    end = text.find("\n", pos)
    line = text[pos:] if end < 0 else text[pos:end]
    if line.strip() or end < 0:
        charge(len(line))
        return line
    block: list[str] = []
    i = end + 1
    while True:
        j = text.find("\n", i)
        nxt = text[i:] if j < 0 else text[i:j]
        if nxt.strip():
            block.append(nxt)
        elif block:
            break
        if j < 0:
            break
        i = j + 1
    charge(i + len(nxt) - pos)
    return "\n".join(block)


def _strict(text: str) -> Extracted | None:
    """Strict extraction on an already-cut answer region."""
    cands: list[tuple[int, str, int]] = []  # (start, method, where the answer starts)
    m = _last_match(_ANSWER_RE, text)
    if m is not None:
        cands.append((m.start(), "answer_marker", m.end()))
    charge(len(text))  # the look for "####"
    m = _last_match(_HASH_RE, text) if "####" in text else None
    if m is not None:
        cands.append((m.start(), "hashes", m.end()))
    box = _last_closed_box(text)
    if box is not None:
        cands.append((box[0], "boxed", -1))
    if not cands:
        return None
    start, method, pos = max(cands)
    if method == "boxed":
        return Extracted(_clean(box[1]), "boxed")  # type: ignore[index]
    ex = Extracted(_clean(_rest_of_line(text, pos)), method)
    # a boxed answer inside the "Answer:" line wins over the raw line ("Answer: $\boxed{5}$")
    charge(len(ex.text))
    m = _BOX_RE.search(ex.text)
    inner = _balanced(ex.text, m.end()) if m else None
    if inner is not None:
        ex = Extracted(_clean(inner), ex.method)
    return ex


def extract_strict(text: str) -> Extracted | None:
    return _strict(answer_region(text))


def _last_line(text: str) -> str | None:
    end = len(text)
    while end >= 0:
        i = text.rfind("\n", 0, end)
        line = text[i + 1:end]
        if line.strip():
            charge(len(text) - i)
            return line
        if i < 0:
            charge(len(text))
            return None
        end = i
    return None


def extract(text: str, mode: str = DEFAULT_MODE, last_resort: str = "last_number") -> Extracted | None:
    """The final answer of ``text`` under ``mode`` (``strict`` | ``lenient``); None if there is none.

    ``last_resort`` is the lenient mode's final fallback: ``last_number`` or ``last_line``."""
    if mode not in MODES:
        raise ValueError(f"unknown answer_extraction '{mode}'; valid: {', '.join(MODES)}")
    body = answer_region(text)
    ex = _strict(body)
    if ex is not None and ex.text:
        return ex
    if mode == "strict":
        return ex
    hit = _last_match(_ANSWER_IS_RE, body)
    if hit is not None:
        rest = _rest_of_line(body, hit.end())
        # a sentence ends the answer ("The answer is 12. Next ..."); keep decimals like 3.5
        charge(len(rest))
        rest = _SENTENCE_END_RE.split(rest, maxsplit=1)[0]
        if _clean(rest):
            return Extracted(_clean(rest), "answer_is")
    eq = body.rfind("=")
    charge(len(body) - max(eq, 0))
    if eq >= 0:
        rhs = _clean(_rest_of_line(body, eq + 1))
        if rhs and "=" not in rhs:
            return Extracted(rhs, "last_equals")
    if last_resort == "last_number":
        num = _last_match(_NUMBER_RE, body)
        return Extracted(num.group().strip(), "last_number") if num is not None else None
    if last_resort == "last_line":
        line = _last_line(body)
        return Extracted(_clean(line), "last_line") if line else None
    raise ValueError(f"unknown last_resort '{last_resort}'")
