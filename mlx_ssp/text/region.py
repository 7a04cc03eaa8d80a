"""The part of a completion that is searched for its answer or its calls: the text after the last
``</think>``, at most its last :data:`MAX_SCAN_CHARS` characters (so a runaway completion bounds the
work of every scan after it)."""

from __future__ import annotations

from mlx_ssp.text.work import charge

#: Only this many trailing characters (after ``</think>``) are searched for the answer: far above any
#: ordinary completion (~60k tokens), so it only ever cuts runaway text, and it bounds the work.
MAX_SCAN_CHARS = 262_144


def strip_thinking(text: str) -> str:
    i = text.rfind("</think>")
    charge(len(text) - max(i, 0))
    return text[i + len("</think>"):] if i >= 0 else text


def answer_region(text: str) -> str:
    """The part of a completion searched for its answer: after the last ``</think>``, at most the
    last :data:`MAX_SCAN_CHARS` characters."""
    body = strip_thinking(text)
    return body[-MAX_SCAN_CHARS:] if len(body) > MAX_SCAN_CHARS else body
