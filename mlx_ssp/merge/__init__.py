"""Parameter merging of fused specialists (recipe step 4): a native, streaming safetensors merger
that reads mergekit YAML configs. See ``docs/merge.md``.

- :mod:`mlx_ssp.merge.config`: mergekit's YAML, parameter filters/gradients, the ``merge:`` section.
- :mod:`mlx_ssp.merge.sources`: input models (and LoRA adapters fused on read).
- :mod:`mlx_ssp.merge.plan`: every check and every tensor's dtypes and parameters; writes nothing.
- :mod:`mlx_ssp.merge.methods`: the methods' registry; each entry carries its merge function.
- :mod:`mlx_ssp.merge.params`: what a method receives for one tensor (inputs, resolved parameters).
- :mod:`mlx_ssp.merge.task_vectors`: linear and the task-vector steps (task vector, sparsify,
  weight, sign consensus, combine, add back).
- :mod:`mlx_ssp.merge.slerp`, :mod:`mlx_ssp.merge.sphere_means`, :mod:`mlx_ssp.merge.interpolate`,
  :mod:`mlx_ssp.merge.selective`: the other methods (slerp and nuslerp; multislerp and karcher,
  with :mod:`mlx_ssp.merge.sphere_scalars` and :mod:`mlx_ssp.merge.sphere_native`; model_stock,
  nearswap and arcee_fusion; sce and ram).
- :mod:`mlx_ssp.merge.sparsify`: magnitude trim, DARE drop, breadcrumbs, the L1 rescale.
- :mod:`mlx_ssp.merge.kernels`: compute dtypes, rounding, the fused-kernel cache, the slice size.
- :mod:`mlx_ssp.merge.native`: the bf16 passes of karcher, multislerp, nuslerp and model_stock in C
  (``csrc/``), the MLX kernels' bits, on a Linux x86_64 CPU.
- :mod:`mlx_ssp.merge.parallel`: tensors merged side by side, largest first within a memory budget.
- :mod:`mlx_ssp.merge.safetensors_io`: lazy header-based reads, shards written as tensors arrive.
- :mod:`mlx_ssp.merge.outdir`: OUT_DIR safety (never an input; only a previous output replaced).
- :mod:`mlx_ssp.merge.engine`: merge and write tensor by tensor; ``run_merge`` and ``merge_models``.
- :mod:`mlx_ssp.merge.multi`: several merges in one config (mergekit's multimerge), ordered and cached.

The command ``mlx_ssp merge CONFIG.yml OUT_DIR`` is :mod:`mlx_ssp.commands.merge`.
"""
