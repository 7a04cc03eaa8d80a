"""The pretraining corpus of the tool-use testbed model: whole episodes as conversations, with a
designed mix, like the arithmetic testbed's (:mod:`mlx_ssp.testbed.build`):

- **gold episodes** of every backend from the train part of the space (never an eval or probe
  episode's names or paraphrases), levels drawn with weight ``LEVEL_DECAY ** (level - 1)``, so the
  easy levels are learnt and the chained ones partly;
- **several correct call orders with skewed shares**: where a turn's calls may come in another order
  (:func:`~mlx_ssp.testbed.tools.variants.alternative_orders`), the ground truth's order is written
  with weight 1 and the i-th alternative with ``ORDER_DECAY ** i``, so selection has a spectrum;
- **unreliable traces** (share ``unreliable``): a wrong argument value, another backend's tool of
  similar meaning, a guessed instead of a copied chained value, or a state-changing call on a
  request no tool can do (:func:`~mlx_ssp.testbed.tools.variants.unreliable_variants`), as real
  pretraining data hold wrong traces beside right ones: RL has something to fix.

Each conversation is the episode's gold conversation (:func:`mlx_ssp.agents.gold.gold_messages`: the
calls, their real results from the environment, ``Done.`` after each turn) for the chosen calls,
so the tool results a model learns to read are the ones it will see. Deterministic from the seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from mlx_ssp.agents.gold import gold_messages
from mlx_ssp.config import validate
from mlx_ssp.tasks import Task
from mlx_ssp.tasks.build import build_split
from mlx_ssp.tasks.config import TasksConfig
from mlx_ssp.testbed.tools.source import split_episodes
from mlx_ssp.testbed.tools.space import BACKENDS, Episode
from mlx_ssp.testbed.tools.variants import alternative_orders, unreliable_variants

LEVEL_DECAY = 0.6
ORDER_DECAY = 0.4


def train_tasks(n_per_backend: int, seed: int, backends: Sequence[str] = BACKENDS,
                levels: tuple[int, int] = (1, 4)) -> list[tuple[Task, Episode]]:
    """The train split of each backend's ``testbed_tools`` domain (``n_per_backend`` episodes), with
    the episode behind each task: the same tasks a run with these settings trains on."""
    out = []
    for b in backends:
        params = {"levels": list(levels)}
        cfg = validate(TasksConfig, {"seed": seed, "domains": {f"tt_{b}": {
            "source": f"testbed_tools:{b}", "params": params,
            "sizes": {"train": n_per_backend, "probe": 0, "eval": 0}}}})
        tasks = build_split(cfg, "train")
        d = cfg.domains[f"tt_{b}"]
        eps = {e.id: e for e in split_episodes(b, params, d.sizes, seed, f"tt_{b}", "train")}
        out += [(t, eps[t.id.split("-", 1)[1]]) for t in tasks]  # a task's id is <domain>-<episode id>
    return out


def _with_calls(task: Task, ep: Episode) -> Task:
    """``task`` whose ground truth is ``ep``'s calls (a variant's)."""
    t = task.model_copy(deep=True)
    t.metadata["episode"]["ground_truth"] = ep.ground_truth()
    return t


def _level_weighted(pairs: list[tuple[Task, Episode]], rng: random.Random, n: int) -> list[tuple[Task, Episode]]:
    weights = [LEVEL_DECAY ** (ep.level - 1) for _, ep in pairs]
    return rng.choices(pairs, weights, k=n)


def corpus(n_per_backend: int, seed: int, *, backends: Sequence[str] = BACKENDS, levels: tuple[int, int] = (1, 4),
           unreliable: float = 0.25, pool: int = 4) -> list[dict]:
    """Corpus records: ``messages`` (the conversation), ``task`` (for the token ids: the prompt is
    the task's), ``backend``, ``level`` and ``kind`` (``gold``, ``orderN``, or an unreliable kind).
    ``n_per_backend`` records per backend, drawn level-weighted from ``pool`` times as many train
    episodes (so easy episodes repeat, hard ones are seen less)."""
    rng = random.Random(f"tools-corpus:{seed}")
    noise = random.Random(f"tools-unreliable:{seed}")  # its own stream: the gold draws do not depend on it
    out = []
    for b in backends:
        pairs = train_tasks(n_per_backend * pool // 2, seed, (b,), levels)
        for task, ep in _level_weighted(pairs, rng, n_per_backend):
            chosen, kind = ep, "gold"
            if unreliable and noise.random() < unreliable:
                bad = unreliable_variants(ep, seed=noise.randrange(1 << 30))
                if bad:
                    chosen = noise.choice(bad)
                    kind = chosen.variant
            else:
                alts = alternative_orders(ep)
                if alts:
                    options = [ep, *alts]
                    chosen = rng.choices(options, [ORDER_DECAY ** i for i in range(len(options))])[0]
                    kind = chosen.variant
            msgs = gold_messages(_with_calls(task, chosen) if chosen is not ep else task)
            out.append({"messages": msgs, "task": task, "backend": b, "level": ep.level, "kind": kind})
    rng.shuffle(out)
    return out
