#!/usr/bin/env bash
# Make and fill the project's virtual environment (scripts/serve.sh and scripts/test.sh run this first).
#
#   scripts/setup.sh           the server's packages: `pip install -e .` into .venv (the checkout's, ignored by git)
#   scripts/setup.sh --test    the same with the test extra: `pip install -e .[test]`
#
# Every package but torch and triton is pinned by constraints.txt (`-c`). Quick when nothing changed: a stamp in the
# venv records the pyproject.toml, constraints.txt and extras it was filled from. pip's own output is shown (what it
# downloads, with sizes and progress), so a first run that takes minutes says why.
#
# torch: a venv made here sees the system Python's packages only when that Python already has a CUDA build of torch
# (a GPU machine's image, e.g. the H200's torch 2.11+cu130 and its triton): then that torch is used as it is and
# nothing of it is downloaded. Otherwise the venv is isolated and gets torch==2.13.0 (on this project's CPU machines
# pip takes it from a local wheel; elsewhere PyPI's 2.13.0, a CUDA build of a few GB on Linux) and triton==3.9.0
# for --test (the Triton kernels' tests run under its interpreter without a GPU). A newer torch is not taken on
# purpose: an unpinned torch pulls several GB of CUDA packages.
#
# Knobs: DSV41_VENV (the venv's folder; .venv), DSV41_BASE_PYTHON (the Python the venv is made from; python3),
# DSV41_VENV_SYSTEM_SITE (1 / 0: see the system's packages or not; default as above). PYTHON=/path/to/python skips
# all of this: serve.sh and test.sh then use that Python as it is (a machine with no package registry, such as the
# GPU host of scripts/h200/, brings its own packages).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${PYTHON:-}" ] && exit 0
t0=$(date +%s)
venv=${DSV41_VENV:-$PWD/.venv}
base=${DSV41_BASE_PYTHON:-python3}
extra=serve
[ "${1:-}" = "--test" ] && extra=test
say() { echo "setup: $*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  site=${DSV41_VENV_SYSTEM_SITE:-}
  if [ -z "$site" ]; then
    site=0
    "$base" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null && site=1
  fi
  if [ "$site" = 1 ]; then
    say "creating $venv from $("$base" -c 'import sys; print(sys.executable)'), with the system's packages" \
        "(its CUDA torch is used as it is)"
    "$base" -m venv --system-site-packages "$venv"
  else
    say "creating $venv from $("$base" -c 'import sys; print(sys.executable)') (isolated)"
    "$base" -m venv "$venv"
  fi
fi
py="$venv/bin/python"
key="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
stamp="$venv/.dsv41-setup"
if [ -f "$stamp" ] && { grep -qx "$key test" "$stamp" || grep -qx "$key $extra" "$stamp"; }; then
  exit 0
fi
pip=("$py" -m pip install --disable-pip-version-check)
need=()
"$py" -c "import torch" 2>/dev/null || need+=("torch==2.13.0")
if [ "$extra" = test ]; then
  "$py" -c "import triton" 2>/dev/null || need+=("triton==3.9.0")
fi
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]} into $venv"
  "${pip[@]}" -c constraints.txt "${need[@]}"
fi
target="."
[ "$extra" = test ] && target=".[test]"
say "installing dsv41 (pip install -e '$target', versions from constraints.txt) into $venv"
"${pip[@]}" -c constraints.txt -e "$target"
echo "$key $extra" > "$stamp"
say "ready in $(( $(date +%s) - t0 )) s: $py"
