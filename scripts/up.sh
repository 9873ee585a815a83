#!/usr/bin/env bash
# Set everything up (idempotent) and run the main job: the local disaggregated cluster
# (etcd, a store daemon, prefill and decode workers, the router on http://127.0.0.1:8000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvrouter up "$@"
