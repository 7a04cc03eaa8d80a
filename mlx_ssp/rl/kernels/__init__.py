"""Custom GPU kernels for the MGPO-GRPO hot spots: one dispatcher, each op beside its plain-MLX reference.

Layout (one module per job, the kernel sources as package data beside them):

- :mod:`.dispatch`: the one dispatcher; ``MLX_SSP_KERNELS`` / the ``rl.kernels`` config key
  (:func:`set_mode`) pick ``metal`` | ``cuda`` | ``reference`` (``auto``: the best that runs here);
- :mod:`.sources`: reading ``*.metal`` / ``*.cu`` / ``*.h`` and building each kernel once per process
  with ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``;
- :mod:`.log_softmax`: fused selective log-softmax (cut-cross-entropy's, Wijmans et al., 2024), its
  reference and the ``mx.custom_function`` with the backward kernel as its vjp;
- :mod:`.advantages`: grouped MGPO advantages (VibeThinker-1.5B, arXiv:2511.06221, section 3.4) in one
  launch, beside the reference :func:`mlx_ssp.rl.mgpo.mgpo_advantages`;
- :mod:`.selfcheck`: ``mlx_ssp doctor --kernels``, each kernel against its reference on this machine's
  GPU back-end, forward and backward, with the worst error and the speedup (imported only there).

The pattern is mlx-lm's ``tuner/losses.py`` (kernel body as source, a custom function with an explicit
vjp, plain-MLX fallback). The chunked log-prob op :mod:`mlx_ssp.rl.logprobs` is built on top and imports
from here, never the reverse.

Verified where: see docs/kernels.md. On Linux CPU only the reference and the Python plumbing run (the
plumbing through a plain-MLX statement of the kernel's outputs); the kernel source text is executed by
a CPU thread emulator in tests/test_kernels_emulated.py, and the CUDA text compiles with NVRTC
(scripts/check_cuda_kernels.py). Neither is a run on Metal or CUDA hardware.
"""

from mlx_ssp.rl.kernels.advantages import grouped_advantages, grouped_advantages_on
from mlx_ssp.rl.kernels.dispatch import (
    BACKENDS,
    ENV,
    MODES,
    available,
    backend,
    cuda_available,
    kernel_available,
    metal_available,
    runnable_backends,
    set_mode,
    use_mode,
)
from mlx_ssp.rl.kernels.log_softmax import (
    selective_log_softmax,
    selective_log_softmax_on,
    selective_log_softmax_reference,
)
from mlx_ssp.rl.kernels.sources import KERNELS, SUFFIX, KernelSource, get_kernel, load_source, source_dir

__all__ = [
    "BACKENDS",
    "ENV",
    "KERNELS",
    "MODES",
    "SUFFIX",
    "KernelSource",
    "available",
    "backend",
    "cuda_available",
    "get_kernel",
    "grouped_advantages",
    "grouped_advantages_on",
    "kernel_available",
    "load_source",
    "metal_available",
    "runnable_backends",
    "selective_log_softmax",
    "selective_log_softmax_on",
    "selective_log_softmax_reference",
    "set_mode",
    "source_dir",
    "use_mode",
]
