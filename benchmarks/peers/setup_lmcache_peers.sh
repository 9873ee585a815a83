#!/usr/bin/env bash
# The environment of `python -m benchmarks.peers.lmcache_bench` and its peers, idempotent:
#   - LMCache 0.5.6 (CPU torch 2.13.0), whose `lm://` server (`python -m lmcache.v1.server`)
#     is one peer: the LMCache environment is reused as it is, never changed (tests use it):
#     Mooncake would add packages to it;
#   - a bench venv layered on it (a .pth to its site-packages, nothing copied) holding what
#     LMCache's environment lacks: Mooncake's non-CUDA store (the other peer, imported by
#     LMCache's mooncakestore connector inside LMCache's process; its `mooncake_master` with
#     the HTTP metadata server), and kvstore's client dependencies; the repository on its path.
#   bash benchmarks/peers/setup_lmcache_peers.sh [BENCH_VENV]
# BENCH_VENV: ~/.cache/kvcache-store/lmcache-bench-venv (lmcache_bench's default --python).
# The LMCache environment: $LMCACHE_VENV, else the repository's .venv-lmcache, else
# ~/.cache/kvcache-store/lmcache-venv; none of them: scripts/setup_lmcache.sh builds the first.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cache="$HOME/.cache/kvcache-store"
venv="${1:-$cache/lmcache-bench-venv}"
LMCACHE_VERSION=0.5.6
MOONCAKE_PINS=(mooncake-transfer-engine-non-cuda==0.3.13.post1 msgpack==1.2.4)
KVSTORE_PINS=(xxhash==4.1.0 lmdb==3.0.0)   # kvstore's dependencies LMCache does not bring

has_lmcache() {  # $1: a venv; true when it imports torch and lmcache $LMCACHE_VERSION
    [ -x "$1/bin/python" ] && "$1/bin/python" - "$LMCACHE_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
import torch  # noqa: F401
sys.exit(md.version("lmcache") != sys.argv[1])
EOF
}

# Mooncake's transfer engine links libibverbs even when it only speaks TCP.
if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1
    else
        echo "Mooncake needs Debian's libibverbs1: sudo apt-get install -y libibverbs1" >&2
        exit 1
    fi
fi

base=""
for cand in "${LMCACHE_VENV:-}" "$repo/.venv-lmcache" "$cache/lmcache-venv"; do
    if [ -n "$cand" ] && has_lmcache "$cand"; then base="$cand"; break; fi
done
if [ -z "$base" ]; then   # the project's own LMCache environment, pinned there
    bash "$repo/scripts/setup_lmcache.sh"
    base="$repo/.venv-lmcache"
    has_lmcache "$base" || { echo "LMCache $LMCACHE_VERSION does not import in $base" >&2; exit 1; }
fi
echo "[lmcache-peers] LMCache environment: $base"

# The bench venv: the LMCache environment's interpreter, its packages through a .pth (after
# the bench venv's own), no pip or setuptools of its own (pip runs from LMCache's packages).
base_py="$(sed -n 's/^executable = //p' "$base/pyvenv.cfg")"
base_py="${base_py:-$(readlink -f "$base/bin/python")}"
if [ ! -x "$venv/bin/python" ]; then
    "$base_py" -m venv --without-pip "$venv"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n' "$base_site" > "$site/zz_lmcache_env.pth"
printf '%s\n' "$repo" > "$site/kvstore_repo.pth"
pip=("$venv/bin/python" -m pip install -q --no-deps)
"$venv/bin/python" - "${MOONCAKE_PINS[@]}" "${KVSTORE_PINS[@]}" <<'EOF' > "$venv/.missing" || true
import importlib.metadata as md, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    try:
        ok = md.version(name) == version
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        print(pin)
EOF
if [ -s "$venv/.missing" ]; then
    echo "[lmcache-peers] installing into $venv: $(tr '\n' ' ' < "$venv/.missing")"
    # --no-deps: every dependency of these is already in LMCache's environment (pip check below)
    xargs "${pip[@]}" < "$venv/.missing"
fi
rm -f "$venv/.missing"
"$venv/bin/python" -m pip check >/dev/null || { "$venv/bin/python" -m pip check >&2; exit 1; }
MC_TCP_BIND_ADDRESS=127.0.0.1 "$venv/bin/python" -c "
import importlib.metadata as md, torch, lmcache, kvstore, xxhash
from mooncake.store import MooncakeDistributedStore
print('[lmcache-peers] lmcache', md.version('lmcache'), 'torch', torch.__version__, 'mooncake',
      md.version('mooncake-transfer-engine-non-cuda'), 'kvstore', kvstore.__version__)
" 2>&1 | grep '^\[lmcache-peers\]'
[ -x "$venv/bin/mooncake_master" ] || { echo "no mooncake_master in $venv/bin" >&2; exit 1; }
echo "lmcache peers ready: $venv/bin/python -m benchmarks.peers.lmcache_bench (the default --python)"
