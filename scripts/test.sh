#!/usr/bin/env bash
# The test command: installs what the suite needs, then runs it (CPU; GPU tests skip without a device).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec ${PYTHON:-python3} -m pytest -q "$@"
