#!/usr/bin/env bash
# Mooncake Store for `benchmarks/store/store_bench.py --peer mooncake`, in its own venv.
# Idempotent. Never touches the project's .venv: Mooncake is not a project dependency.
#   bash benchmarks/peers/setup_mooncake.sh [VENV_DIR]
# Default VENV_DIR: ~/.cache/kvcache-store/mooncake-venv (store_bench's default --mooncake-python).
set -euo pipefail
venv="${1:-$HOME/.cache/kvcache-store/mooncake-venv}"
# Mooncake's transfer engine links libibverbs even when it only speaks TCP.
if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq libibverbs1
    else
        echo "Mooncake needs Debian's libibverbs1: sudo apt-get install -y libibverbs1" >&2
        exit 1
    fi
fi
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q mooncake-transfer-engine-non-cuda numpy
"$venv/bin/python" -c "from mooncake.store import MooncakeDistributedStore" \
    && echo "mooncake ready: pass --mooncake-python $venv/bin/python (or use the default path)"
