"""The ``testbed_tools:BACKEND`` task source: generated episodes on one toy backend (``kv``, ``ctr``,
``files``, ``bank``), rendered compact by default.

A procedural source like ``testbed:DOMAIN`` rather than a writer of episodes files: each split draws
from its own seed (:func:`~mlx_ssp.tasks.procedural.split_seed`) in the order eval, probe, train and
skips the episodes of the splits drawn before it, so sizes and seeds work as for every procedural
source and no file has to be written before a run. Every row still goes through
:func:`mlx_ssp.agents.source.episode_item` (one validation and rendering of episodes), and
:func:`split_episodes` hands the :class:`~mlx_ssp.testbed.tools.space.Episode` objects behind a
split's tasks to whoever needs them (variants for a corpus, tests): a task's id is
``<domain>-<episode id>``.

Params: the generator's ``levels`` (``[min, max]`` within 1-4, default ``[1, 4]``), ``irrelevance``
(the share of irrelevance turns, default 0.15), ``train_space`` (``train``, default, or
``held_out``) and ``eval_space`` (eval and probe: ``held_out``, default, or ``seen``: in-distribution
episodes no train draw can produce), then every ``episodes:`` param (``render``, default
``compact``; ``describe``, ``reward``, ``max_steps``, ``call_timeout_s``, ``max_result_chars``).
A task's ``metadata.level`` is its episode's level.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlx_ssp.agents.source import check_params, episode_item
from mlx_ssp.errors import UserError
from mlx_ssp.tasks.item import ORDER, Item
from mlx_ssp.tasks.procedural import split_seed
from mlx_ssp.testbed.tools.episodes import check_options, episodes
from mlx_ssp.testbed.tools.space import BACKENDS, Episode, identity

if TYPE_CHECKING:
    from mlx_ssp.tasks.sources import Source

GENERATOR_PARAMS = ("levels", "irrelevance", "train_space", "eval_space")
TRAIN_SPACES = ("train", "held_out")
EVAL_SPACES = ("held_out", "seen")


def _options(backend: str, params: dict) -> tuple[dict, dict]:
    """(generator options, episode params) of a domain's ``params``, validated."""
    if backend not in BACKENDS:
        raise UserError(f"source testbed_tools:{backend}: unknown backend; valid: {', '.join(BACKENDS)}")
    gen = {k: params[k] for k in GENERATOR_PARAMS if k in params}
    rest = {"render": "compact", **{k: v for k, v in params.items() if k not in GENERATOR_PARAMS}}
    check_params(rest, f"testbed_tools:{backend}")
    check_options(gen.get("levels", (1, 4)), gen.get("irrelevance", 0.15))
    for key, valid in (("train_space", TRAIN_SPACES), ("eval_space", EVAL_SPACES)):
        if gen.get(key, valid[0]) not in valid:
            raise UserError(f"source testbed_tools:{backend}: params.{key} must be one of {', '.join(valid)}")
    return gen, rest


def split_episodes(backend: str, params: dict, sizes: Any, seed: int, domain: str, split: str) -> list[Episode]:
    """The episodes of one split of a ``testbed_tools:BACKEND`` domain (``sizes``: a
    :class:`~mlx_ssp.tasks.config.SplitSizes`), disjoint from the domain's other splits."""
    gen, _ = _options(backend, params)
    taken: set[str] = set()
    for s in ORDER:
        n = sizes.of(s)
        if n is None:
            raise UserError(f"domain '{domain}': sizes.{s} must be a number for testbed_tools sources")
        space = gen.get("train_space", "train") if s == "train" else gen.get("eval_space", "held_out")
        eps = episodes(backend, s, n, split_seed(seed, domain, s), space=space, levels=gen.get("levels", (1, 4)),
                       irrelevance=gen.get("irrelevance", 0.15), exclude=taken)
        if s == split:
            return eps
        taken.update(identity(e) for e in eps)
    raise ValueError(split)  # unreachable


def tools_items(src: Source, arg: str, domain: str, dcfg, seed: int, split: str) -> list[Item]:
    params = dict(dcfg.params or {})
    _, episode_params = _options(arg, params)
    classes: dict[str, type] = {}
    # a domain is one backend already: no <domain>_<backend> sub-domain
    return [episode_item(ep.row(), f"testbed_tools:{arg} {ep.id}", Path.cwd(), episode_params, classes, sub_domain=False)
            for ep in split_episodes(arg, params, dcfg.sizes, seed, domain, split)]
