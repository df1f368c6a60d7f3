#!/usr/bin/env bash
# The test command (README, .ci/run): the fast default suite, then the representative
# subset of slow multiprocess tests (marked both `slow` and `ci`).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
status=0
"$PY" -m pytest -q tests -m "not slow" || status=$?
if [ "$status" -ne 0 ]; then
  echo "default suite failed (pytest exit $status; 5 means no tests ran)"; exit 1
fi
"$PY" -m pytest -q tests -m "slow and ci" || status=$?
if [ "$status" -ne 0 ]; then
  echo "slow CI subset failed (pytest exit $status; 5 means no tests ran)"; exit 1
fi
