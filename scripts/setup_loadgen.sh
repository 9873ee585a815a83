#!/usr/bin/env bash
# The load generators' environment, .venv-loadgen: GuideLLM 0.8.1 and AIPerf 0.13.0, which pin
# packages of their own (rich, click, pydantic-settings, ...), so they cannot share .venv; they
# resolve together here, with vLLM's own router (vllm-router 0.1.17, a Rust binary; the peer of
# benchmarks/serving/vllm_routing.py). The CPU torch first (GuideLLM requires torch; an unpinned one pulls a
# multi-GB CUDA build). vLLM's own `vllm bench serve` runs from .venv-vllm (scripts/setup_vllm.sh).
# Used by tests/router/test_load_generators.py. Idempotent: a stamp over its inputs skips a
# second run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
ENV=.venv-loadgen
stamp=$ENV/.installed-$(sha1sum scripts/setup_loadgen.sh | cut -c1-12)
if [ -f "$stamp" ]; then
    echo "[setup] $ENV ready (guidellm 0.8.1, aiperf 0.13.0, vllm-router 0.1.17)"
    exit 0
fi
echo "[setup] building $ENV (CPU torch 2.13.0, guidellm 0.8.1, aiperf 0.13.0, vllm-router 0.1.17): a few minutes, once"
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
echo "*" > "$ENV/.gitignore"   # the environment ignores itself, as newer venvs do
step "$ENV/bin/pip" install -q --upgrade pip
step "$ENV/bin/pip" install -q "torch==2.13.0"
step "$ENV/bin/pip" install -q "guidellm==0.8.1" "aiperf==0.13.0" "vllm-router==0.1.17"
step "$ENV/bin/python" -c "import guidellm, aiperf"
step "$ENV/bin/guidellm" --help
step "$ENV/bin/aiperf" --help
step "$ENV/bin/vllm-router" --help
rm -f "$ENV"/.installed-*
touch "$stamp"
