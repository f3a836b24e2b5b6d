#!/usr/bin/env bash
# The test command: installs what the suite needs, then runs it (CPU; GPU tests skip without a device).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# One intra-op thread: on a 2-core CI machine torch's default threads make the small ops of the tiny model 5-20x slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec ${PYTHON:-python3} -m pytest -q "$@"
