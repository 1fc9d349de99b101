#!/usr/bin/env bash
# GPU check: the CUDA/NCCL and bf16 paths in one short run (< 5 minutes), one JSON object
# on stdout (scripts/gpu_check.py says what it runs). Exit 0 on a machine without a GPU
# (the JSON says {"gpu": false, "reason": "no CUDA device", ...}); on a GPU machine exit 0
# when every check passes, 1 otherwise.
#
#   scripts/gpu_check.sh            # uses .venv/bin/python, creating the venv as `make` does
#   PYTHON=/path/to/python scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
if [ -z "${PYTHON:-}" ] && [ ! -f .venv/.installed ]; then
    # same recipe as the Makefile's .venv/.installed target; its output goes to stderr so
    # stdout stays one JSON object
    make .venv/.installed >&2
fi
exec timeout 300 "$PY" scripts/gpu_check.py "$@"
