#!/usr/bin/env bash
# Install mlx_ssp and run the whole SSP loop on the bundled demo model (configs/quickstart.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mlx_ssp doctor
mlx_ssp run configs/quickstart.yaml "$@"
