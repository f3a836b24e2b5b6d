#!/usr/bin/env bash
# Serve dsv41 (OpenAI-compatible). Installs what it needs, then `python -m dsv41 serve "$@"`.
# No arguments: the built-in tiny checkpoint (made once, cached under ${XDG_CACHE_HOME:-~/.cache}/dsv41/) on
# 127.0.0.1:8000, on the GPU when there is one. `--model DIR`, `--host`, `--port`, all flags: docs/server.md.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec ${PYTHON:-python3} -m dsv41 serve "$@"
