"""Kernel sources (Metal and CUDA), shipped with the package as mlx_ssp.kernels."""
