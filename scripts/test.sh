#!/usr/bin/env bash
# Install mlx_ssp with its test extras into the active Python environment and run the suite.
# Used verbatim by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
# trackers: tests/test_trackers.py runs the real TensorBoard, W&B, Trackio; torch-parity: oneMKL, with which
# the float32 slerp / nuslerp / karcher goldens are plain tests (tests/test_merge_goldens.py, test_torch_math.py)
bash scripts/setup.sh dev,trackers,torch-parity
set +e
python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" = "5" ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
