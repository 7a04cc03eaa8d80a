"""mlx_ssp: the Spectrum-to-Signal recipe (VibeThinker) on MLX.

Importing the package first loads the system OpenBLAS on Linux (see ``_blas``), so any code
that imports ``mlx_ssp`` before ``mlx.core`` gets fast float32 matmul on CPU, and has glibc keep
freed heap memory for reuse (see ``_malloc``: large per-step buffers without page faults).
"""

from mlx_ssp._blas import preload_openblas as _preload
from mlx_ssp._malloc import keep_freed_memory as _keep_freed_memory

_preload()
_keep_freed_memory()

__version__ = "0.1.0"
