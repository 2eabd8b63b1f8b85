#!/usr/bin/env bash
# `just gpu-check ARGS`: bench/gpu_check.py ARGS, after installing (on a GPU run, not --dry-run)
# the wheels of .gpu-wheels/ (`just gpu-wheels`) into MLM_GPU_SITE (default /tmp/mlm-gpu-site).
# Python: .venv's when there is one, else $PYTHON or python3 (a GPU image's own, with torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=${PYTHON:-python3}; fi
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
if [ "$dry" = 0 ] && compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    site=${MLM_GPU_SITE:-/tmp/mlm-gpu-site}
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu-wheels/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" bench/gpu_check.py "$@"
