"""``python -m mlx_ssp.distributed`` (under ``mlx.launch``): :func:`.check.main`."""

from mlx_ssp.distributed.check import main

main()
