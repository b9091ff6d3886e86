#!/usr/bin/env bash
# The prepared GPU check (issue 36): a report of one GPU's numbers in at most 8 minutes, to stdout and
# to $OUT/gpu_check.out (else benchmarks/gpu_check.out). benchmarks/gpu_check.py says what it measures.
#   bash benchmarks/gpu_check.sh              # needs CUDA: without it, one line and exit status 2
#   bash benchmarks/gpu_check.sh --dry-run    # the same code path on CPU, tiny sizes (under a minute)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
exec "$PY" benchmarks/gpu_check.py "$@"
