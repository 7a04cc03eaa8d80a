"""The tool testbed's episode generator: seeded, pure, graded, with a held-out part of the space.

:func:`episodes` draws episodes on one backend of :mod:`.envs` from ``random.Random(f"{seed}:{backend}:{split}")``.
An episode has 2-3 user turns; each turn is one to three clauses joined into one message, each clause
a paraphrase (four per intent) of one call, planned on the backend's state as the turn reaches it (a
real instance runs every ground-truth call while the episode is drawn, so none fails and every result
is known). Calls in one turn touch distinct entities, so most of them commute
(:func:`.variants.alternative_orders`).

**Levels** (:data:`LEVELS`, level -> most calls in a turn, whether an argument is chained):

- 1: one call per turn; 2: up to two (one turn has two);
- 3: one call per turn, and a *chained* argument: a later turn's call needs what an earlier read
  returned (BFCL's chaining: "look up cat", then "copy cat to dog" is ``put(key='dog', value=<cat's
  value>)``; "find the richest account", then "move 5 from the richest account to bob"); the value
  appears in that earlier tool result and in no user turn (a word-boundary check rejects the draw);
- 4: a chained argument and up to three calls per turn.

**Irrelevance**: a share ``irrelevance`` of all turns (default 0.15, at most 1/3; exact in
expectation) are requests no tool can do ("make cat expire in an hour"), with empty ground truth
(such a turn passes only without a state-changing call). Episodes without a chain have 2 or 3 turns,
at least one of them relevant; chain episodes have 3, at least two of them relevant.

**The held-out part of the space**: every fourth name of each pool (:data:`.space.POOLS`; keys, counters
and files share the word pool, so the backends interfere) and every intent's fourth paraphrase are held
out. Spaces (:data:`.space.SPACES`): ``held_out`` episodes use at least one held-out name or paraphrase;
the others use none and split by a hash of the episode (its turns and config) into ``train`` (7/8) and
``seen`` (1/8: in-distribution episodes no train draw can produce). The three spaces are disjoint by
construction, whatever the seeds; :func:`.space.space_of` names an episode's.

**For pretraining corpora** (:mod:`.variants`): :func:`.variants.unreliable` makes an episode whose
calls fail the checker in one way (:data:`.variants.UNRELIABLE`: a wrong argument value, another
backend's confusable tool, the chained argument guessed instead of copied, a state-changing call on an
irrelevant request), and :func:`.variants.alternative_orders` the other orders of a turn's calls that
pass it. Both are judged by the checker's own turn judge (:mod:`mlx_ssp.agents.checker`) on in-process
twins of the backend, so a variant is kept only if the checker would score it so (tests re-verify them
through the verifier). An :class:`.space.Episode` is an ``episodes:`` row (:meth:`.space.Episode.row`);
a variant's row carries the variant's calls as its ``ground_truth``, so its conversation with real
results is :func:`mlx_ssp.agents.gold.gold_messages` of its task. A variant has its episode's turns and
config, by which an episodes file deduplicates its rows: write each variant kind to a file of its own.

The modules, by job: :mod:`.space` (the episode record, the pools, the held-out part and the
spaces), :mod:`.intents` (each backend's requests and how each is planned as a call), this one
(drawing episodes) and :mod:`.variants` (alternative orders and unreliable variants).
"""

from __future__ import annotations

import copy
import random
import re
from dataclasses import replace
from typing import Any

from mlx_ssp.agents.calls import Call
from mlx_ssp.errors import UserError
from mlx_ssp.testbed.tools.envs import CLASSES
from mlx_ssp.testbed.tools.intents import SPECS, Backend, Ctx
from mlx_ssp.testbed.tools.space import HELD_OUT_FORM, SPACES, Episode, Link, allowed_names, identity, space_of

#: level -> (most calls in a turn, a chained argument)
LEVELS: dict[int, tuple[int, bool]] = {1: (1, False), 2: (2, False), 3: (1, True), 4: (3, True)}
#: the highest share of irrelevance turns every level can have (a chain episode: 3 turns, 2 of them relevant)
MAX_IRRELEVANCE = 1 / 3
JOINERS = (" and ", ", then ", ", and ", ", also ")


class _Redraw(Exception):
    """This draw cannot be completed (no entity fits, a reference moved): draw again."""



def _form(spec: Backend, c: Ctx, owner: str, forms: tuple[str, ...], held_out: bool, slots: dict,
          used: list[str], fresh: bool = False) -> str:
    """A paraphrase of ``owner``'s clause (``fresh``: one the episode has not used yet), filled in."""
    ids = [j for j in range(len(forms)) if held_out or j != HELD_OUT_FORM]
    ids = [j for j in ids if not fresh or f"{spec.name}.{owner}.{j}" not in used]
    if not ids:
        raise _Redraw
    i = c.rng.choice(ids)
    used.append(f"{spec.name}.{owner}.{i}")
    return forms[i].format(**slots)


def _run(env: Any, call: Call) -> Any:
    try:
        return getattr(env, call.name)(**call.arguments)
    except Exception:  # noqa: BLE001 - a ground-truth call must not fail: the plan did not fit this state
        raise _Redraw from None


def _draw(spec: Backend, rng: random.Random, level: int, irrelevance: float, space: str) -> Episode:
    """One episode (raises :class:`_Redraw` when this draw does not work out)."""
    held_out = space == "held_out"
    c = Ctx(CLASSES[spec.name](), rng, allowed_names(space))
    config = spec.config(c)
    c.env.reset(copy.deepcopy(config))
    most, chained = LEVELS[level]
    n_turns = 3 if chained else rng.choice((2, 3))
    free = n_turns - (2 if chained else 1)  # turns that may be irrelevant: a chain needs two relevant ones
    # each free turn is irrelevant with the probability that makes `irrelevance` the expected share of all turns
    k = sum(rng.random() < irrelevance * n_turns / free for _ in range(free))
    skip = set(rng.sample(range(n_turns), k))
    irrelevant = [i in skip for i in range(n_turns)]
    relevant = [i for i, x in enumerate(irrelevant) if not x]
    counts = {t: rng.randint(1, most) for t in relevant}
    counts[rng.choice(relevant)] = most
    chain = rng.choice(spec.chains) if chained else None
    target = relevant[-1]
    source = rng.choice(relevant[:-1]) if chained else -1
    turns, calls, forms, link = [], [], [], None
    src_call = src_result = src_index = None
    for t in range(n_turns):
        c.busy = set()
        if irrelevant[t]:
            _, slots = spec.irrelevant.plan(c) or (None, None)
            if slots is None:
                raise _Redraw
            clause = _form(spec, c, "irrelevant", spec.irrelevant.forms, held_out, slots, forms, fresh=True)
            turns.append(_sentence([clause], rng))
            calls.append(())
            continue
        clauses, turn_calls = [], []
        if chain is not None and t == target:
            if chain.now(c.env, src_call) != src_result:
                raise _Redraw  # the earlier read's answer has moved: "it" would be ambiguous
            planned = chain.plan(c, src_call, src_result)
            if planned is None:
                raise _Redraw
            call, slots, arg = planned
            link = Link(t, 0, arg, source, src_index)
            clauses.append(_form(spec, c, f"chain_{chain.name}", chain.forms, held_out, slots, forms))
            turn_calls.append(call)
            _run(c.env, call)
        n_rest = counts[t] - len(turn_calls)
        src_at = rng.randrange(n_rest) if t == source else -1
        for j in range(n_rest):
            intent = chain.source if j == src_at else rng.choice(spec.intents)
            planned = intent.plan(c)
            if planned is None:
                raise _Redraw
            call, slots = planned
            clauses.append(_form(spec, c, intent.name, intent.forms, held_out, slots, forms))
            turn_calls.append(call)
            result = _run(c.env, call)
            if j == src_at:
                src_call, src_result, src_index = call, result, len(turn_calls) - 1
        turns.append(_sentence(clauses, rng))
        calls.append(tuple(turn_calls))
    if link is not None and any(re.search(rf"(?<!\w){re.escape(str(src_result))}(?!\w)", x) for x in turns):
        raise _Redraw  # the chained value must come from the tool result, not from the user
    return Episode("", spec.name, level, config, tuple(turns), tuple(calls), link, space, tuple(forms))


def _sentence(clauses: list[str], rng: random.Random) -> str:
    text = clauses[0] + "".join(rng.choice(JOINERS) + x for x in clauses[1:])
    return text[0].upper() + text[1:] + "."


def _spec(backend: str) -> Backend:
    if backend not in SPECS:
        raise UserError(f"unknown tool testbed backend {backend!r}; valid: {', '.join(SPECS)}")
    return SPECS[backend]


def check_options(levels: Any = (1, 4), irrelevance: Any = 0.15, space: Any = "train") -> tuple[int, int]:
    """Validated ``levels`` as (min, max); a UserError names the bad option."""
    ok = (isinstance(levels, (list, tuple)) and len(levels) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in levels))
    if not ok or not min(LEVELS) <= levels[0] <= levels[1] <= max(LEVELS):
        raise UserError(f"tool testbed: levels must be [min, max] within {min(LEVELS)}-{max(LEVELS)}, got {levels!r}")
    number = isinstance(irrelevance, (int, float)) and not isinstance(irrelevance, bool)
    if not number or not 0 <= irrelevance <= MAX_IRRELEVANCE:
        raise UserError(f"tool testbed: irrelevance must be a number in [0, {MAX_IRRELEVANCE:.3g}], "
                        f"got {irrelevance!r}")
    if space not in SPACES:
        raise UserError(f"tool testbed: space must be one of {', '.join(SPACES)}, got {space!r}")
    return int(levels[0]), int(levels[1])


def episodes(backend: str, split: str, n: int, seed: int, *, space: str | None = None, levels: Any = (1, 4),
             irrelevance: float = 0.15, exclude: Any = ()) -> list[Episode]:
    """``n`` distinct episodes of ``backend`` in ``space`` (default: ``train`` for the train split,
    else ``held_out``), levels drawn uniformly from ``levels``, none whose :func:`identity` is in
    ``exclude``; ids ``<backend>-<split>-L<level>-<index>``. Pure: the same arguments give the same
    episodes, and the first ``n`` of a larger draw are these."""
    spec = _spec(backend)
    space = space or ("train" if split == "train" else "held_out")
    lo, hi = check_options(levels, irrelevance, space)
    rng = random.Random(f"{seed}:{backend}:{split}")
    out: list[Episode] = []
    seen = set(exclude)
    budget = 200 + 60 * n  # draws: held_out accepts most, train 7/8, seen 1/8
    while len(out) < n and budget > 0:
        level = rng.randint(lo, hi)
        for _ in range(min(budget, 64)):  # redraw at this level: levels stay uniform whatever their rejection rates
            budget -= 1
            try:
                ep = _draw(spec, rng, level, irrelevance, space)
            except _Redraw:
                continue
            key = identity(ep)
            if key not in seen and space_of(ep) == space:
                seen.add(key)
                out.append(replace(ep, id=f"{backend}-{split}-L{level}-{len(out):04d}"))
                break
    if len(out) < n:
        raise UserError(f"tool testbed {backend}: only {len(out)} distinct {space} episodes for {split}; "
                        f"{n} requested (widen levels or lower the sizes)")
    return out


def episode_rows(backend: str, split: str, n: int, seed: int, **options: Any) -> list[dict]:
    """:func:`episodes` as ``episodes:`` rows (one JSON object per line of an episodes file)."""
    return [ep.row() for ep in episodes(backend, split, n, seed, **options)]

