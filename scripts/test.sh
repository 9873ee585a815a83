#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite, slow tests included.
# A fast subset for development: .venv/bin/pytest -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
