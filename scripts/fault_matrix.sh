#!/usr/bin/env bash
# Regenerate docs/reliability.md (scenario x layout). Every layout: about 12 minutes on a
# 2-core machine. Pass --layouts / --scenarios to run a part, e.g.
#   scripts/fault_matrix.sh --layouts TP2.PP2.DP2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OMP_NUM_THREADS=1 exec "$PY" scripts/fault_matrix.py "$@"
