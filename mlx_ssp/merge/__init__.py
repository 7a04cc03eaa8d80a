"""Parameter merging of fused specialists (recipe step 4): a native, streaming safetensors merger
that reads mergekit YAML configs. See ``docs/merge.md``.

- :mod:`mlx_ssp.merge.methods`: the methods as pure functions over MLX arrays, and their registry.
- :mod:`mlx_ssp.merge.config`: mergekit's YAML, parameter filters/gradients, the ``merge:`` section.
- :mod:`mlx_ssp.merge.safetensors_io`: lazy header-based reads, shards written as tensors arrive.
- :mod:`mlx_ssp.merge.engine`: plan + validate, then stream; ``run_merge`` and ``merge_models``.
- :mod:`mlx_ssp.merge.cli`: ``mlx_ssp merge CONFIG.yml OUT_DIR``.
"""

from __future__ import annotations


def __getattr__(name):  # lazy: importing the package must not import mlx
    if name in ("run_merge", "merge_models", "plan_merge"):
        from mlx_ssp.merge import engine

        return getattr(engine, name)
    raise AttributeError(name)
