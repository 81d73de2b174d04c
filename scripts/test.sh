#!/usr/bin/env bash
# Runs the CPU test suite (GPU tests are deselected; they run on the device machine).
# pytest's exit 5 ("no tests collected") is a failure here, like any other non-zero exit.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
python -m pytest -m "not gpu" "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
