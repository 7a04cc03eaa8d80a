"""The distance registry of selection (:data:`DISTANCES`): name -> (n -> texts -> symmetric
distance matrix in [0, 1]). ``ngram`` (word n-gram Jaccard) and ``edit`` (word Levenshtein / the
longer length) compare wording; ``steps``, ``ast`` and ``calls`` (:mod:`.strategy`) compare what a
solution does."""

from __future__ import annotations

from itertools import combinations
from typing import Callable

import numpy as np

from mlx_ssp.select.strategy import distance_fn
from mlx_ssp.select.text import jaccard_distance, levenshtein, ngrams, words


def ngram_distance_fn(n: int) -> Callable[[list[str]], np.ndarray]:
    def matrix(texts: list[str]) -> np.ndarray:
        feats = [ngrams(t, n) for t in texts]
        return _matrix(feats, jaccard_distance)

    return matrix



def edit_distance_fn(n: int) -> Callable[[list[str]], np.ndarray]:  # n unused: one signature for the registry
    def matrix(texts: list[str]) -> np.ndarray:
        feats = [words(t) for t in texts]

        def d(a, b):
            m = max(len(a), len(b))
            return levenshtein(a, b) / m if m else 0.0

        return _matrix(feats, d)

    return matrix


def _matrix(feats: list, d: Callable) -> np.ndarray:
    m = np.zeros((len(feats), len(feats)))
    for i, j in combinations(range(len(feats)), 2):
        m[i, j] = m[j, i] = d(feats[i], feats[j])
    return m


#: name -> (n -> texts -> symmetric distance matrix)
DISTANCES: dict[str, Callable[[int], Callable[[list[str]], np.ndarray]]] = {
    "ngram": ngram_distance_fn,
    "edit": edit_distance_fn,
    # strategy-level (mlx_ssp.select.strategy): what a solution does, not its wording
    "steps": distance_fn("steps"),
    "ast": distance_fn("ast"),
    "calls": distance_fn("calls"),
}

#: what ``select.distance`` and ``--distance`` accept: a registry name, or ``auto`` (one per prompt,
#: :func:`strategy_kind`)
DISTANCE_CHOICES: tuple[str, ...] = (*DISTANCES, "auto")
