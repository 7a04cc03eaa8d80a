"""Final-answer extraction from a completion, shared by the ``math`` and ``reasoning_gym`` verifiers.

Two modes, chosen per domain (``tasks.domains.<name>.answer_extraction``) and stored in each task's
``metadata["answer_extraction"]`` so that ``mlx_ssp verify`` re-scores a file exactly as the rollout did:

- ``strict``: the answer after the *last* of these markers, whichever comes last in the text:
  ``Answer:`` (any case, markdown bold allowed), ``#### `` (GSM8K style), ``\\boxed{...}`` / ``\\fbox{...}``
  (balanced braces). The answer is the rest of the marker's line; when that is empty, the next
  block of non-empty lines (a grid written under ``Answer:``). Anything else is "no answer".
- ``lenient``: strict first; then the last "answer is X"; then the last "= X" (the right-hand side of
  the last equals sign); then a verifier-specific last resort: the last number (``math``) or the last
  non-empty line (``reasoning_gym``). This is the rule the calibration in CALIBRATION.md used: the demo
  model rarely writes the requested format, and strict scoring gives RL almost no signal.

Text before the last ``</think>`` is dropped (thinking models reason there; the answer follows it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MODES = ("strict", "lenient")
DEFAULT_MODE = "strict"

_ANSWER_RE = re.compile(r"(?:\*\*|__)?\b(?:final[ \t]+)?answer[ \t]*(?:\*\*|__)?[ \t]*:[ \t]*(?:\*\*|__)?", re.IGNORECASE)
_HASH_RE = re.compile(r"####")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS_RE = re.compile(r"\banswer\s+(?:is|=|would be|will be)\s*:?\s*", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?%?|-?\.\d+")


@dataclass(frozen=True)
class Extracted:
    text: str  # the answer text (may be empty when the marker was followed by nothing)
    method: str  # answer_marker | hashes | boxed | answer_is | last_equals | last_number | last_line


def strip_thinking(text: str) -> str:
    i = text.rfind("</think>")
    return text[i + len("</think>"):] if i >= 0 else text


def _balanced(text: str, start: int) -> str | None:
    """Content of a brace group whose ``{`` is at ``start - 1``; None if it never closes."""
    depth = 1
    for j in range(start, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:j]
    return None


def _clean(ans: str) -> str:
    ans = ans.strip()
    # markdown emphasis and surrounding math delimiters the model may wrap its answer in
    ans = re.sub(r"^(?:\*\*|__|\*|`)+|(?:\*\*|__|\*|`)+$", "", ans).strip()
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
        return line
    block: list[str] = []
    for nxt in text[end + 1:].split("\n"):
        if nxt.strip():
            block.append(nxt)
        elif block:
            break
    return "\n".join(block)


def extract_strict(text: str) -> Extracted | None:
    text = strip_thinking(text)
    best: tuple[int, Extracted] | None = None
    for m in _ANSWER_RE.finditer(text):
        cand = Extracted(_clean(_rest_of_line(text, m.end())), "answer_marker")
        best = (m.start(), cand) if best is None or m.start() > best[0] else best
    for m in _HASH_RE.finditer(text):
        cand = Extracted(_clean(_rest_of_line(text, m.end())), "hashes")
        best = (m.start(), cand) if best is None or m.start() > best[0] else best
    for m in _BOX_RE.finditer(text):
        inner = _balanced(text, m.end())
        if inner is not None:
            cand = Extracted(_clean(inner), "boxed")
            best = (m.start(), cand) if best is None or m.start() > best[0] else best
    if best is None:
        return None
    # a boxed answer inside the "Answer:" line wins over the raw line ("Answer: $\boxed{5}$")
    ex = best[1]
    if ex.method != "boxed":
        m = _BOX_RE.search(ex.text)
        inner = _balanced(ex.text, m.end()) if m else None
        if inner is not None:
            ex = Extracted(_clean(inner), ex.method)
    return ex


def _last_line(text: str) -> str | None:
    for line in reversed(text.split("\n")):
        if line.strip():
            return line
    return None


def extract(text: str, mode: str = DEFAULT_MODE, last_resort: str = "last_number") -> Extracted | None:
    """The final answer of ``text`` under ``mode`` (``strict`` | ``lenient``); None if there is none.

    ``last_resort`` is the lenient mode's final fallback: ``last_number`` or ``last_line``."""
    if mode not in MODES:
        raise ValueError(f"unknown answer_extraction '{mode}'; valid: {', '.join(MODES)}")
    ex = extract_strict(text)
    if ex is not None and ex.text:
        return ex
    if mode == "strict":
        return ex
    body = strip_thinking(text)
    hits = list(_ANSWER_IS_RE.finditer(body))
    if hits:
        rest = _rest_of_line(body, hits[-1].end())
        # a sentence ends the answer ("The answer is 12. Next ..."); keep decimals like 3.5
        rest = re.split(r"(?<!\d)\.(?!\d)|\.\s", rest, maxsplit=1)[0]
        if _clean(rest):
            return Extracted(_clean(rest), "answer_is")
    eq = body.rfind("=")
    if eq >= 0:
        rhs = _clean(_rest_of_line(body, eq + 1))
        if rhs and "=" not in rhs:
            return Extracted(rhs, "last_equals")
    if last_resort == "last_number":
        nums = _NUMBER_RE.findall(body)
        if nums:
            return Extracted(nums[-1].strip(), "last_number")
        return None
    if last_resort == "last_line":
        line = _last_line(body)
        return Extracted(_clean(line), "last_line") if line else None
    raise ValueError(f"unknown last_resort '{last_resort}'")
