"""Every config choice list that names the entries of a registry equals that registry's keys: adding a
variant to a registry makes it a valid config value, and a config value never names a missing one."""

from __future__ import annotations

import typing

import pytest

from mlx_ssp.finetune.optim import OPTIMIZERS
from mlx_ssp.rl import mgpo, objectives
from mlx_ssp.rl.config import RLConfig
from mlx_ssp.rl.kernels import dispatch
from mlx_ssp.rl.objectives import AGGREGATIONS
from mlx_ssp.select import DISTANCES, POLICIES, SelectConfig
from mlx_ssp.sft.config import SELECT_RULES, SFTConfig
from mlx_ssp.sft.loss import CE_KINDS
from mlx_ssp.tasks.config import DomainConfig
from mlx_ssp.verify.extract import MODES


def choices(model, field: str) -> set:
    """The values a Literal (or Optional[Literal]) field accepts."""
    ann = model.model_fields[field].annotation
    args = set()
    for a in typing.get_args(ann) or ():
        if typing.get_origin(a) is typing.Literal:
            args |= set(typing.get_args(a))
        elif a is not type(None):
            args.add(a)
    if typing.get_origin(ann) is typing.Literal:
        args = set(typing.get_args(ann))
    return args


#: (config model, field, the registry's names)
CASES = [
    (SelectConfig, "policy", set(POLICIES)),
    (SelectConfig, "distance", set(DISTANCES) | {"auto"}),
    (RLConfig, "aggregation", set(AGGREGATIONS)),
    (RLConfig, "loss", set(objectives.SURROGATES)),
    (RLConfig, "importance_sampling_level", set(objectives.RATIOS)),
    (RLConfig, "tis_mode", set(objectives.TIS_MODES)),
    (RLConfig, "scale_rewards", set(mgpo.SCALE_REWARDS)),
    (RLConfig, "optimizer", set(OPTIMIZERS)),
    (RLConfig, "kernels", {"auto", "reference", *dispatch.BACKENDS}),
    (SFTConfig, "optimizer", set(OPTIMIZERS)),
    (SFTConfig, "select", set(SELECT_RULES)),
    (SFTConfig, "loss", set(CE_KINDS)),
    (DomainConfig, "answer_extraction", set(MODES)),
]


@pytest.mark.parametrize("model,field,registry", CASES, ids=[f"{m.__name__}.{f}" for m, f, _ in CASES])
def test_config_choices_equal_the_registry(model, field, registry):
    assert choices(model, field) == registry
