"""The ``instruct`` source: small procedural instruction-following tasks for the ``instruct`` verifier.

Each task is a short request whose prompt states its constraints in words and whose
``metadata["constraints"]`` states the same constraints for :mod:`mlx_ssp.verify.instruct` (format,
item count, ordering, required / forbidden words, length, case): a domain an RL phase can join
(VibeThinker-3B technical report, section 2.4, the instruct pass), at demo scale. No answer: the
constraints are the reference.

``instruct`` draws from every template; ``instruct:NAME,NAME`` from the named ones
(:data:`TEMPLATES`). Splits as for reasoning-gym (:mod:`mlx_ssp.tasks.procedural`): each split draws
from its own seed and skips prompts of the splits drawn before it (eval, probe, train).

Deviation: the report's instruct data are format-sensitive, long-context and general prompts; these
are templated toy requests (a few hundred distinct prompts), meant to exercise the verifier and the
RL wiring, not to measure instruction following.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Callable

from mlx_ssp.errors import UserError
from mlx_ssp.tasks.item import ORDER, Item
from mlx_ssp.tasks.procedural import split_seed

if TYPE_CHECKING:
    from mlx_ssp.tasks.sources import Source

TOPICS = ("fruits", "colours", "animals", "countries", "planets", "programming languages", "musical instruments",
          "vegetables", "sports", "metals", "rivers", "birds", "flowers", "board games", "tools", "trees")
WORDS = ("water", "light", "time", "green", "small", "river", "stone", "music", "winter", "quick", "gold", "paper")


def _bullets(rng: random.Random, topic: str) -> tuple[str, list[dict]]:
    n = rng.randint(2, 6)
    return (f"List {n} {topic}. Write each on its own line as a bullet starting with '- ', and nothing else.",
            [{"kind": "bullet_list", "marker": "-"}, {"kind": "item_count", "min": n, "max": n}])


def _numbered(rng: random.Random, topic: str) -> tuple[str, list[dict]]:
    n = rng.randint(2, 6)
    return (f"Name {n} {topic} as a numbered list (1., 2., ...), one per line, and nothing else.",
            [{"kind": "numbered_list"}, {"kind": "item_count", "min": n, "max": n}])


def _json(rng: random.Random, topic: str) -> tuple[str, list[dict]]:
    keys = rng.sample(["name", "reason", "example", "colour", "size"], 2)
    return (f"Reply with only a JSON object with the keys \"{keys[0]}\" and \"{keys[1]}\", about one of the {topic}.",
            [{"kind": "json", "type": "object", "keys": keys}])


def _keywords(rng: random.Random, topic: str) -> tuple[str, list[dict]]:
    good, bad = rng.sample(WORDS, 2)
    return (f"Write one sentence about {topic} that uses the word '{good}' and does not use the word '{bad}'.",
            [{"kind": "include", "keywords": [good]}, {"kind": "forbid", "keywords": [bad]},
             {"kind": "length", "unit": "words", "max": 40}])


def _short_lower(rng: random.Random, topic: str) -> tuple[str, list[dict]]:
    w = rng.choice((10, 15, 20, 30))
    return (f"Describe {topic} in at most {w} words, all in lower case.",
            [{"kind": "length", "unit": "words", "min": 1, "max": w}, {"kind": "case", "case": "lower"}])


def _order(rng: random.Random, topic: str) -> tuple[str, list[dict]]:
    a, b, c = rng.sample(WORDS, 3)
    return (f"Write a short paragraph about {topic} that mentions '{a}', then '{b}', then '{c}', in that order.",
            [{"kind": "order", "keywords": [a, b, c]}])


def _prefix(rng: random.Random, topic: str) -> tuple[str, list[dict]]:
    n = rng.randint(2, 4)
    return (f"Start your reply with 'Sure:' and then name {n} {topic}, separated by commas, on one line.",
            [{"kind": "starts_with", "text": "Sure:", "case_sensitive": True},
             {"kind": "length", "unit": "lines", "max": 1}])


#: name -> fn(rng, topic) -> (prompt, constraints)
TEMPLATES: dict[str, Callable[[random.Random, str], tuple[str, list[dict]]]] = {
    "bullets": _bullets, "numbered": _numbered, "json": _json, "keywords": _keywords,
    "short_lower": _short_lower, "order": _order, "prefix": _prefix,
}


def _templates(arg: str) -> list[str]:
    names = [a.strip() for a in arg.split(",") if a.strip()] if arg else list(TEMPLATES)
    bad = [n for n in names if n not in TEMPLATES]
    if bad:
        raise UserError(f"source instruct:{arg}: unknown template(s) {', '.join(bad)}; valid: {', '.join(TEMPLATES)}")
    return names


def _generate(names: list[str], seed: int, n: int, exclude: set[str], domain: str, split: str) -> list[Item]:
    rng = random.Random(seed)
    cap = max(64, 20 * n)
    items, seen = [], set()
    for idx in range(cap):
        if len(items) == n:
            break
        name = names[rng.randrange(len(names))]
        prompt, constraints = TEMPLATES[name](rng, rng.choice(TOPICS))
        if prompt in seen or prompt in exclude:
            continue
        seen.add(prompt)
        items.append(Item(f"{split}-{idx}", prompt, None, {"constraints": constraints, "template": name}))
    if len(items) < n:
        raise UserError(f"domain '{domain}': the instruct source gave only {len(items)} distinct {split} prompts "
                        f"(not in earlier splits) out of {cap} draws; {n} requested. Lower the sizes.")
    return items


def instruct_items(src: Source, arg: str, domain: str, dcfg, seed: int, split: str) -> list[Item]:
    """Draw the splits in ORDER, each from its own seed, skipping prompts of the splits before it."""
    names = _templates(arg)
    taken: set[str] = set()
    for s in ORDER:
        n = dcfg.sizes.of(s)
        if n is None:
            raise UserError(f"domain '{domain}': sizes.{s} must be a number for {src.kind} sources")
        items = _generate(names, split_seed(seed, domain, s), n, taken, domain, s)
        if s == split:
            return items
        taken.update(it.prompt for it in items)
    raise ValueError(split)  # unreachable: split is one of ORDER
