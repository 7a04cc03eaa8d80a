"""Pure metric functions shared by eval, SFT probing, selection and reports."""

from __future__ import annotations

import math
from typing import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al. 2021, "Evaluating LLMs trained on code", eq. 1):
    1 - C(n - c, k) / C(n, k), for n samples of which c are correct. Requires 1 <= k <= n."""
    if not (0 <= c <= n):
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not (1 <= k <= n):
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    # numerically stable product form: prod_{i=n-c+1}^{n} (1 - k / i)
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan
