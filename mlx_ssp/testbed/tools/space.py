"""The tool testbed's episode record and the space episodes are drawn from: the name pools, the
held-out part of the space (names and paraphrases) and the three disjoint spaces (the overview is
:mod:`mlx_ssp.testbed.tools.episodes`)."""

from __future__ import annotations

import copy
import json
import re
import zlib
from dataclasses import dataclass

from mlx_ssp.agents.calls import Call
from mlx_ssp.testbed.tools.envs import CLASSES

ENV_MODULE = "mlx_ssp.testbed.tools.envs"
BACKENDS = tuple(CLASSES)

WORDS = ("cat", "dog", "sun", "box", "map", "pen", "cup", "owl", "fig", "jam", "hat", "kit", "log", "net", "oak", "ray")
VALUES = ("red", "blue", "gold", "jade", "mint", "rose", "lime", "teal", "plum", "sand", "pink", "navy", "snow",
          "rust", "fern", "sage")
TEXTS = ("buy milk", "call mom", "fix sink", "pay rent", "feed fish", "mow lawn", "bake bread", "wash car", "read book",
         "sort mail", "book flight", "clean desk", "paint fence", "water plants", "plan trip", "iron shirts")
PEOPLE = ("ann", "bob", "cy", "dee", "eve", "fay", "gus", "hal", "ivy", "jo", "kim", "lu", "max", "ned", "oli", "pat")
#: entity and value pools; keys, counter names and file names share ``word`` (interference by design)
POOLS: dict[str, tuple[str, ...]] = {"word": WORDS, "value": VALUES, "text": TEXTS, "person": PEOPLE}
#: every fourth item of each pool never appears outside the held-out space
HELD_OUT_NAMES = frozenset(x for pool in POOLS.values() for x in pool[3::4])
#: every intent's paraphrase of this index never appears outside the held-out space
HELD_OUT_FORM = 3
SEEN_MOD = 8  # 1 in SEEN_MOD episodes outside the held-out space is reserved for in-distribution eval
SPACES = ("train", "seen", "held_out")


@dataclass(frozen=True)
class Link:
    """A chained argument: ``calls[turn][index].arguments[argument]`` is what
    ``calls[source_turn][source_index]`` returned."""

    turn: int
    index: int
    argument: str
    source_turn: int
    source_index: int


@dataclass(frozen=True)
class Episode:
    """One episode on a backend: its initial state, user turns and ground-truth calls per turn."""

    id: str
    backend: str
    level: int
    config: dict
    turns: tuple[str, ...]
    calls: tuple[tuple[Call, ...], ...]
    chained: Link | None = None
    space: str = "train"
    forms: tuple[str, ...] = ()  # the paraphrases used, "backend.intent.index"
    variant: str = "gold"  # gold, an UNRELIABLE kind, or orderN (alternative_orders)

    @property
    def environment(self) -> str:
        return f"{ENV_MODULE}:{CLASSES[self.backend].__name__}"

    def ground_truth(self) -> list[list[str]]:
        return [[c.as_python() for c in turn] for turn in self.calls]

    def row(self) -> dict:
        """The episode as an ``episodes:`` row (:mod:`mlx_ssp.agents.source`); a variant's id is
        ``<id>.<variant>`` and its ``ground_truth`` the variant's calls (an episodes file keeps one row
        per turns and config: a variant goes in another file than its episode)."""
        return {"id": self.id if self.variant == "gold" else f"{self.id}.{self.variant}",
                "environment": self.environment, "config": copy.deepcopy(self.config), "turns": list(self.turns),
                "ground_truth": self.ground_truth(), "domain": self.backend, "level": self.level}


def identity(ep: Episode) -> str:
    """What makes two episodes the same problem: the backend, the turns and the initial state."""
    return json.dumps([ep.backend, list(ep.turns), ep.config], sort_keys=True)


def uses_held_out(ep: Episode) -> bool:
    """Whether the episode uses a held-out name (in its config, turns or calls) or paraphrase."""
    words = set(re.findall(r"\w+", json.dumps([ep.config, ep.turns, ep.ground_truth()])))
    phrases = " ".join([json.dumps(ep.config), *ep.turns])
    return (any(int(f.rsplit(".", 1)[1]) == HELD_OUT_FORM for f in ep.forms)
            or any((x in words) if " " not in x else (x in phrases) for x in HELD_OUT_NAMES))


def space_of(ep: Episode) -> str:
    """``held_out``, ``seen`` or ``train`` (the module docstring)."""
    if uses_held_out(ep):
        return "held_out"
    return "seen" if zlib.crc32(identity(ep).encode()) % SEEN_MOD == 0 else "train"


def allowed_names(space: str) -> frozenset:
    """The pool items an episode of ``space`` may use (the held-out names only in ``held_out``)."""
    items = {x for pool in POOLS.values() for x in pool}
    return frozenset(items if space == "held_out" else items - HELD_OUT_NAMES)
