#!/usr/bin/env bash
# Install dsv41 and what it needs into the current Python (idempotent; quick when already installed).
# torch==2.13.0 is pinned for CPU machines because a local wheel exists there and a newer torch pulls several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
need=()
$PY -c "import torch" 2>/dev/null || need+=("torch==2.13.0")
for m in numpy safetensors tokenizers msgspec starlette uvicorn uvloop zmq:pyzmq llguidance PIL:pillow; do
  mod=${m%%:*}; pkg=${m##*:}
  $PY -c "import $mod" 2>/dev/null || need+=("$pkg")
done
if [ "${1:-}" = "--test" ]; then
  # schemathesis is pinned: tests/test_openapi.py is written against its 4.x API (skipped where it is missing)
  for m in pytest hypothesis jsonschema openai anthropic httpx triton rfc3339_validator:rfc3339-validator \
           schemathesis:schemathesis==4.32.5; do
    mod=${m%%:*}; pkg=${m##*:}
    $PY -c "import $mod" 2>/dev/null || need+=("$pkg")
  done
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}" >&2
  $PY -m pip install -q "${need[@]}"
fi
