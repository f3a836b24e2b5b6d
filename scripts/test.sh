#!/usr/bin/env bash
# The test command: sets up .venv with the test extra (scripts/setup.sh --test), then runs the suite in it (CPU;
# GPU tests skip without a device). About 25 minutes on a 2-core machine, plus the first set-up's downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test              # PYTHON=... : that Python as it is, with the checkout on PYTHONPATH
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  PY="${DSV41_VENV:-$PWD/.venv}/bin/python"
fi
# One intra-op thread: on a 2-core CI machine torch's default threads make the small ops of the tiny model 5-20x slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec $PY -m pytest -q "$@"
