#!/usr/bin/env bash
# The GPU check, on a CUDA machine with no network: a venv over the machine's own torch
# (--system-site-packages), the wheels scripts/gpu_wheels.sh downloaded into .gpu_wheels/
# installed offline, then `python -m gpucheck` (every CUDA path and the GPU figures
# in capped sections, at most 5 minutes; gpucheck/__init__.py lists them).
#
#   bash scripts/gpu_check.sh [--out DIR] [--budget S] [--sections ...]   # flags go to the driver
#   bash scripts/gpu_check.sh --cpu-selftest                              # the same, here, on CPU
#   bash scripts/gpu_check.sh --install-only        # only the venv and the wheels, then exit
#
# Writes DIR/gpu_check.json and DIR/gpu_check.log (DIR: --out, default results/gpu_check, or
# $OUT/gpu_check when $OUT is set). Environment: PYTHON (default python3, the
# interpreter that holds the machine's torch), GPU_CHECK_VENV (default /tmp/gpu-check-venv),
# GPU_WHEELS_DIR (default .gpu_wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

for a in "$@"; do
    if [ "$a" = "-h" ] || [ "$a" = "--help" ]; then
        sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
        echo
        exec "${PYTHON:-python3}" -m gpucheck --help
    fi
done

SELFTEST=0 INSTALL_ONLY=0
ARGS=()
for a in "$@"; do
    case "$a" in
        --cpu-selftest) SELFTEST=1; ARGS+=("$a") ;;
        --install-only) INSTALL_ONLY=1 ;;
        *) ARGS+=("$a") ;;
    esac
done
OUT_ARGS=()
if ! printf '%s\n' "${ARGS[@]}" | grep -qx -- "--out" && [ -n "${OUT:-}" ]; then
    OUT_ARGS=(--out "$OUT/gpu_check")
fi

if [ "$SELFTEST" = 1 ] && [ "$INSTALL_ONLY" = 0 ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python  # the project's own environment already holds everything
else
    BASE=${PYTHON:-python3}
    VENV=${GPU_CHECK_VENV:-/tmp/gpu-check-venv}
    WHEELS=${GPU_WHEELS_DIR:-.gpu_wheels}
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[gpu_check] venv $VENV over $("$BASE" -c 'import sys; print(sys.executable)')"
        # No pip inside (ensurepip may be missing there); the base's pip installs into it.
        "$BASE" -m venv --system-site-packages --without-pip "$VENV"
        # A base python that is itself a venv (e.g. an image's /opt/torch/.venv): the new venv's
        # "system" packages are the base interpreter's, not that venv's; a .pth adds that venv's
        # site directories (their own .pth files processed), after the new venv's own, so the
        # wheels of GPU_WHEELS_DIR come first.
        outer=$("$BASE" -c 'import site, sys; print("".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()) if sys.prefix != sys.base_prefix else "", end="")')
        if [ -n "$outer" ]; then
            printf '%s\n' "$outer" > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_gpu_check_base.pth"
        fi
    fi
    PY=$VENV/bin/python
    SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "[gpu_check] installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $VENV (offline)"
        "$BASE" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --disable-pip-version-check --upgrade --target "$SITE" "$WHEELS"/*.whl
    else
        echo "[gpu_check] no wheels in $WHEELS (run scripts/gpu_wheels.sh where there is network)" >&2
    fi
    # The project from this tree, without a build (no network for build dependencies).
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$INSTALL_ONLY" = 1 ]; then
    "$PY" -c "import fastapi, uvicorn, lmdb, pydantic, starlette; print('[gpu_check] installed: fastapi', fastapi.__version__, 'pydantic', pydantic.__version__, 'lmdb', lmdb.__version__)"
    exit 0
fi
echo "[gpu_check] $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
exec "$PY" -m gpucheck "${OUT_ARGS[@]}" "${ARGS[@]}"
