#!/usr/bin/env bash
# The SGLang environment of the HiCache backend's integration test: .venv-sglang.
#
# SGLang pins torch 2.14.1, transformers, flashinfer and flash-attn, so it cannot share the
# project's .venv. This venv holds the CPU build of torch the project tests with, SGLang
# without its dependencies, and exactly the packages that SGLang's HiCache storage interface
# and backend factory need to import on this machine, each pinned, every one installed with
# --no-deps so that nothing pulls another torch or CUDA (SGLang's host KV pools do not import
# on a CPU-only machine: docs/integrations.md, "SGLang HiCache backend"); then
# the project itself (editable, its runtime dependencies pinned the same way).
# Idempotent: a stamp over this script and pyproject.toml makes a second run instant.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${SGLANG_PYTHON:-python3.11}  # SGLang 0.5.23 ships a cp311 wheel
VENV=.venv-sglang
SGLANG=sglang==0.5.23
stamp=$VENV/.installed-$(cat scripts/setup_sglang.sh pyproject.toml | sha1sum | cut -c1-12)
if [ -f "$stamp" ]; then
    echo "[setup] $VENV ready ($SGLANG)"
    exit 0
fi

# What `from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory` needs
# beyond torch (found by trying the import; docs/integrations.md lists the errors), with
# what those packages need in turn.
IMPORT_DEPS=(
    triton==3.8.0 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 packaging==26.4 pillow==13.0.0
    msgspec==0.23.0 pyzmq==27.3.0
    requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3
    starlette==1.10.0 anyio==4.16.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    ipython==9.18.1 ipython-pygments-lexers==1.1.1 pygments==2.21.0 traitlets==5.16.1
    jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 prompt-toolkit==3.0.53 wcwidth==0.9.4
    stack-data==0.6.3 asttokens==3.0.2 executing==2.3.0 pure-eval==0.2.4 pexpect==4.9.0
    ptyprocess==0.7.0
)
# The project's runtime dependencies (pyproject.toml [project] dependencies), pinned.
PROJECT_DEPS=(
    numpy==2.4.6 xxhash==4.1.0 lmdb==3.0.0 tqdm==4.70.1 prometheus-client==0.26.0
    httpx==0.28.1 httpcore==1.0.9 h11==0.16.0
    aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
    multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
)

start=$SECONDS
log=$(mktemp)
trap 'rm -f "$log"' EXIT
step() {  # run quietly; on failure show what it said (less pip's notes on the local indexes)
    if ! "$@" >"$log" 2>&1; then
        grep -v "is ignored: it is neither" "$log" >&2
        echo "[setup] $VENV: failed: $*" >&2
        exit 1
    fi
}
[ -x $VENV/bin/python ] || step "$PY" -m venv $VENV
pip=($VENV/bin/pip install -q --disable-pip-version-check)
# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
$VENV/bin/python -c "import torch" 2>/dev/null || step "${pip[@]}" "torch==2.13.0"
step "${pip[@]}" --no-deps "$SGLANG" "${IMPORT_DEPS[@]}" "${PROJECT_DEPS[@]}"
step "${pip[@]}" --no-deps -e .
# The check that matters: the import the backend is loaded through, on the pinned torch.
step $VENV/bin/python -c "import torch, kvstore.client.node
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
assert torch.__version__.startswith('2.13.0'), torch.__version__"
rm -f $VENV/.installed-*
touch "$stamp"
echo "[setup] $VENV built in $((SECONDS - start)) s ($SGLANG, torch 2.13.0, $(du -sh $VENV | cut -f1))"
