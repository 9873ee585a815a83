#!/usr/bin/env bash
# Download, here (with network), the wheels scripts/gpu_check.sh installs offline on a CUDA
# machine: the project's dependencies that the device image lacks, as CPython 3.12
# manylinux x86_64 wheels, into .gpu_wheels/ (git-ignored; copy it with the working tree to the GPU machine).
#
# The GPU image this targets already holds Python 3.12, torch 2.11 for
# CUDA 13, transformers 5.17, Triton, CuPy, numpy, safetensors, tokenizers, jinja2, httpx,
# aiohttp, xxhash, prometheus-client, tqdm, anyio, click, h11, annotated-doc: those are not
# downloaded (the check's venv sees them through --system-site-packages). What is missing, pinned
# to the versions .venv tests with:
#   fastapi, starlette, uvicorn    the worker's HTTP server
#   pydantic, pydantic-core, annotated-types, typing-inspection, opentelemetry-api   fastapi's needs
#   lmdb                           the store's SSD tier
#   typing-extensions              pydantic-core wants a newer one than some images hold
# Each wheel is fetched with --no-deps, so this list is the whole bundle (one version each).
# The bundle must stay under 60 MiB with everything else that travels; it prints its size.
#
#   bash scripts/gpu_wheels.sh          # the check's wheels, into .gpu_wheels/
#   bash scripts/gpu_wheels.sh --ucx    # only ucxx's CUDA 13 closure, into .gpu_wheels_ucx/
#
# --ucx: the ucx_cuda section's own device run (UCX's CUDA transports between two processes).
# ucxx is not in the image and its closure, UCX_WHEELS below (~51 MiB; cuda-core and
# nvidia-ml-py are in the image), does not fit beside the wheels above, so it travels alone:
# carry .gpu_wheels_ucx and run
#   GPU_WHEELS_DIR=.gpu_wheels_ucx bash scripts/gpu_check.sh --sections env ucx_cuda
# (libucxx 0.52 wants libucx <1.22). GPU_WHEELS_DIR, if set, names the directory either way.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    fastapi==0.165.0
    starlette==1.10.0
    uvicorn==0.54.0
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    opentelemetry-api==1.45.2
    typing-extensions==4.16.0
    lmdb==3.0.0
)
UCX_WHEELS=(
    ucxx-cu13==0.52.0
    libucxx-cu13==0.52.0
    libucx-cu13==1.21.0
    rmm-cu13==26.10.0
    librmm-cu13==26.10.0
    rapids-logger==0.3.0
)
DEST=${GPU_WHEELS_DIR:-.gpu_wheels}
case "${1:-}" in
    "") ;;
    --ucx) WHEELS=("${UCX_WHEELS[@]}"); DEST=${GPU_WHEELS_DIR:-.gpu_wheels_ucx} ;;
    *) echo "usage: bash scripts/gpu_wheels.sh [--ucx]" >&2; exit 2 ;;
esac
PIP=${PIP:-python3 -m pip}
if [ -x .venv/bin/pip ]; then PIP=.venv/bin/pip; fi
PLATFORMS=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
mkdir -p "$DEST"
# Only this list: a wheel from an older list would be a second version of a name.
for f in "$DEST"/*.whl; do
    [ -e "$f" ] || continue
    name=$(basename "$f" | cut -d- -f1 | tr '[:upper:]_' '[:lower:]-')
    keep=0
    for w in "${WHEELS[@]}"; do
        want=$(echo "${w%%==*}" | tr '[:upper:]_' '[:lower:]-')
        ver=${w##*==}
        if [ "$name" = "$want" ] && [[ "$(basename "$f")" == *-"$ver"-* ]]; then keep=1; fi
    done
    if [ "$keep" = 0 ]; then echo "[gpu_wheels] removing $f (not in the list)"; rm -f "$f"; fi
done
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" --platform any -d "$DEST" "${WHEELS[@]}"
n=$(ls "$DEST"/*.whl | wc -l)
size=$(du -sb "$DEST" | cut -f1)
echo "[gpu_wheels] $n wheels in $DEST: $((size / 1024)) KiB ($(awk "BEGIN {printf \"%.2f\", $size / 1048576}") MiB)"
if [ "$n" != "${#WHEELS[@]}" ]; then
    echo "[gpu_wheels] expected ${#WHEELS[@]} wheels, found $n" >&2
    exit 1
fi
# What travels to the device: the tracked and untracked-not-ignored files, and the wheels.
tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$((tree + size))
echo "[gpu_wheels] with the working tree ($((tree / 1024)) KiB) the device run carries" \
     "$(awk "BEGIN {printf \"%.2f\", $total / 1048576}") MiB (limit 60 MiB)"
if [ "$total" -gt $((60 * 1048576)) ]; then
    echo "[gpu_wheels] over 60 MiB: carry less" >&2
    exit 1
fi
