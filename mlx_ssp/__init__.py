"""mlx_ssp: the Spectrum-to-Signal recipe (VibeThinker) on MLX.

Importing the package first loads the system OpenBLAS on Linux (see ``_blas``), so any code
that imports ``mlx_ssp`` before ``mlx.core`` gets fast float32 matmul on CPU.
"""

from mlx_ssp._blas import preload_openblas as _preload

_preload()

__version__ = "0.1.0"
