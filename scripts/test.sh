#!/usr/bin/env bash
# Set everything up (idempotent), type-check the four packages, and run the whole test suite,
# slow tests included (the import contracts run inside it: tests/test_architecture.py).
# The fast subset for development: .venv/bin/pytest -m "not slow and not integration" (in-process
# only, about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] pyright (basic) over kvstore, engine, router, planner"
.venv/bin/pyright kvstore engine router planner
# The integrations import LMCache, SGLang and vLLM, which only their own environments hold.
for pair in lmcache:lmcache_plugin.py lmcache:lmcache_format.py sglang:sglang_hicache.py vllm:vllm; do
    env=.venv-${pair%%:*} module=kvstore/integrations/${pair##*:}
    if [ -x "$env/bin/python" ]; then
        echo "[test] pyright (basic) over $module against $env"
        .venv/bin/pyright --pythonpath "$env/bin/python" "$module"
    fi
done
echo "[test] ruff (lint and import order)"
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
