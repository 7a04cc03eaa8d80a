"""Package discovery only; all metadata lives in pyproject.toml.

``[tool.setuptools.packages.find]`` cannot discover ``mlx_ssp.kernels``: its sources sit in the
top-level ``kernels/`` folder (mapped by ``package-dir`` in pyproject.toml), which a directory scan
names ``kernels``. So the list is every ``mlx_ssp`` package found on disk plus that one.
"""

from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["mlx_ssp", "mlx_ssp.*"]) + ["mlx_ssp.kernels"])
