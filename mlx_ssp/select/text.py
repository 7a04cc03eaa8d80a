"""Word-level text features of selection (pure): normalisation, word tokens, word n-grams, the
Jaccard distance of two sets and the Levenshtein distance of two sequences. The leaf every distance
(:mod:`.distance`, :mod:`.strategy`) and the data-quality checks (:mod:`.quality`) share."""

from __future__ import annotations

import re

import numpy as np

_WORD = re.compile(r"\w+|[^\w\s]")


def normalize(text: str) -> str:
    """Whitespace-collapsed text: the key of exact-duplicate removal."""
    return " ".join(text.split())


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def ngrams(text: str, n: int = 3) -> frozenset:
    """Set of word n-grams (a text shorter than n words is one gram)."""
    w = words(text)
    if len(w) < n:
        return frozenset([tuple(w)]) if w else frozenset()
    return frozenset(tuple(w[i : i + n]) for i in range(len(w) - n + 1))


def jaccard_distance(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 0.0
    return 1.0 - len(a & b) / len(a | b)


def levenshtein(a: list, b: list) -> int:
    """Edit distance between two sequences; one vectorised row per element of ``a``."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    vocab: dict = {}
    ai = np.array([vocab.setdefault(x, len(vocab)) for x in a])
    bi = np.array([vocab.setdefault(x, len(vocab)) for x in b])
    idx = np.arange(len(bi) + 1)
    prev = idx.copy()
    for i, x in enumerate(ai, 1):
        cur = np.empty_like(prev)
        cur[0] = i
        # deletion and substitution from the previous row ...
        cur[1:] = np.minimum(prev[1:] + 1, prev[:-1] + (bi != x))
        # ... then insertions: cur[j] = min_k<=j cur[k] + (j - k), a running minimum
        cur = np.minimum.accumulate(cur - idx) + idx
        prev = cur
    return int(prev[-1])



def edit_distance(a: str, b: str) -> float:
    """Word-level Levenshtein distance normalised by the longer length (in [0, 1])."""
    wa, wb = words(a), words(b)
    m = max(len(wa), len(wb))
    return levenshtein(wa, wb) / m if m else 0.0
