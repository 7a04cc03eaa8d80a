"""The ``testbed:DOMAIN`` task source and the ``testbed`` verifier.

Source params: ``levels: [min, max]`` (terms / numbers per problem; default the domain's range in
:data:`~mlx_ssp.testbed.problems.LEVELS`) and ``max_term`` (default 9). Each split draws uniformly
over the levels from its own seed (as every procedural source: :mod:`mlx_ssp.tasks.procedural`) and
skips problems of the splits drawn before it. Eval and probe draw only from the held-out quarter of
the problem space (:func:`~mlx_ssp.testbed.problems.held_out`), which the testbed's pretraining
corpus never contains; train draws from the rest, or with ``train_space: held_out`` from the
held-out quarter too (problems the model never saw, still disjoint from eval and probe). A task's metadata holds the numbers, the countdown
target and the level; ``answer`` is the number (sum, diff) or None (countdown: any valid expression).

Verifier: the last ``answer X`` line of the completion, checked by
:func:`mlx_ssp.testbed.problems.solve` (countdown expressions are parsed, never evaluated as code);
reason ``correct`` / ``wrong_answer`` / ``no_answer`` / ``bad_expression`` / ``numbers_not_given``.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from mlx_ssp.errors import UserError
from mlx_ssp.tasks.item import ORDER, Item
from mlx_ssp.tasks.procedural import split_seed
from mlx_ssp.testbed.problems import DOMAINS, LEVELS, draw, held_out, problem_from_meta, solve
from mlx_ssp.verify import VerifyResult, register

if TYPE_CHECKING:
    from mlx_ssp.tasks import Task
    from mlx_ssp.tasks.sources import Source


def _levels(domain: str, params: dict) -> tuple[int, int]:
    lo, hi = params.get("levels", LEVELS[domain])
    if not LEVELS[domain][0] <= lo <= hi <= LEVELS[domain][1]:
        raise UserError(f"testbed:{domain}: levels must lie in {list(LEVELS[domain])}, got {[lo, hi]}")
    return int(lo), int(hi)


def _generate(domain: str, params: dict, seed: int, n: int, exclude: set[str], where: str, split: str) -> list[Item]:
    rng = random.Random(seed)
    lo, hi = _levels(domain, params)
    items, seen = [], set()
    for idx in range(max(256, 80 * n)):  # 3 of 4 draws fall in the other part of the space
        if len(items) == n:
            break
        p = draw(domain, rng, rng.randint(lo, hi), int(params.get("max_term", 9)))
        unseen = split != "train" or params.get("train_space") == "held_out"
        if p.prompt in seen or p.prompt in exclude or held_out(p) != unseen:
            continue  # eval and probe: only problems pretraining never saw; train: the others, or unseen ones too
        seen.add(p.prompt)
        meta = {"numbers": list(p.numbers), "target": p.target, "level": p.level, "testbed": domain}
        items.append(Item(f"{split}-{idx}", p.prompt, None if p.answer is None else str(p.answer), meta))
    if len(items) < n:
        raise UserError(f"domain '{where}': testbed:{domain} gave only {len(items)} distinct {split} problems; "
                        f"{n} requested (widen levels or max_term, or lower the sizes)")
    return items


def testbed_items(src: "Source", arg: str, domain: str, dcfg, seed: int, split: str) -> list[Item]:
    if arg not in DOMAINS:
        raise UserError(f"source testbed:{arg}: unknown domain; valid: {', '.join(DOMAINS)}")
    taken: set[str] = set()
    for s in ORDER:
        n = dcfg.sizes.of(s)
        if n is None:
            raise UserError(f"domain '{domain}': sizes.{s} must be a number for testbed sources")
        items = _generate(arg, dict(dcfg.params or {}), split_seed(seed, domain, s), n, taken, domain, s)
        if s == split:
            return items
        taken.update(it.prompt for it in items)
    raise ValueError(split)  # unreachable


def _check(task: "Task") -> None:
    meta = task.metadata
    if meta.get("testbed") not in DOMAINS or not isinstance(meta.get("numbers"), list):
        raise ValueError("metadata needs 'testbed' (the domain) and 'numbers'")
    if meta["testbed"] == "countdown" and not isinstance(meta.get("target"), int):
        raise ValueError("a countdown task needs an integer metadata.target")


@register("testbed", check=_check)
def verify_testbed(completion: str, task: "Task") -> VerifyResult:
    p = problem_from_meta(task.metadata["testbed"], task.metadata)
    ok, reason = solve(p, completion)
    return VerifyResult(1.0 if ok else 0.0, reason)
