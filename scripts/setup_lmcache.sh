#!/usr/bin/env bash
# The LMCache integration's own environment, .venv-lmcache: LMCache 0.5.6 downgrades numpy,
# fastapi and prometheus_client and adds ~50 packages, so it cannot share .venv. The CPU torch
# first (an unpinned torch pulls a multi-GB CUDA build), then LMCache, then this project
# (editable, with its [lmcache] extra). Used only by tests/integrations/test_lmcache.py and
# benchmarks/peers/lmcache_bench.py. Idempotent: a stamp over its inputs skips a second run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
ENV=.venv-lmcache
stamp=$ENV/.installed-$(cat pyproject.toml scripts/setup_lmcache.sh | sha1sum | cut -c1-12)
if [ -f "$stamp" ]; then
    echo "[setup] $ENV ready (lmcache 0.5.6)"
    exit 0
fi
echo "[setup] building $ENV (CPU torch 2.13.0, lmcache 0.5.6, this project): a few minutes, once"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
step() {  # quiet; on failure show what it said (less pip's notes on the local indexes)
    if ! "$@" >"$log" 2>&1; then
        grep -v "is ignored: it is neither" "$log" >&2
        echo "[setup] $ENV: failed: $*" >&2
        exit 1
    fi
}
[ -x "$ENV/bin/python" ] || step "$PY" -m venv "$ENV"
step "$ENV/bin/pip" install -q --upgrade pip
step "$ENV/bin/pip" install -q "torch==2.13.0"
step "$ENV/bin/pip" install -q "lmcache==0.5.6" "pytest>=8"
step "$ENV/bin/pip" install -q -e ".[lmcache]"
LMCACHE_LOG_LEVEL=WARNING "$ENV/bin/python" -c "import lmcache.v1.storage_backend.abstract_backend, kvstore.integrations.lmcache_plugin"
rm -f "$ENV"/.installed-*
touch "$stamp"
