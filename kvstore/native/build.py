"""Build a C source into a shared library on first use, cached by content; load it with ctypes.

``build_library(source, ...)`` compiles ``source`` with ``$CC`` (else ``cc``/``gcc``) into
``native_home()/<digest>/<stem>.so``, the digest covering the source (and the local headers
it includes, ``#include "x.h"`` beside it), the flags, the compiler's version and the CPU
(``-march=native`` code never runs on a different CPU sharing the cache), publishes it
atomically (concurrent builders each write a whole library) and loads it. Nothing is built at
import time. ``Library`` memoizes one attempt per process: ``get()`` is the loaded library or
None, with ``why`` saying what failed (logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Library", "build_library", "native_home", "xxh3_functions"]

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-fPIC", "-std=c11")
LDFLAGS = ("-shared",)


def native_home() -> Path:
    """``$KVCACHE_HOME/native`` (default ``~/.cache/kvcache-store/native``)."""
    env = os.environ.get("KVCACHE_HOME")
    home = Path(env).expanduser() if env else Path.home() / ".cache" / "kvcache-store"
    return home / "native"


def _cpu_tag() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(cc: str, source: Path, out: Path, cflags: Sequence[str],
             ldflags: Sequence[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        for cmd in ([cc, *cflags, "-c", str(source), "-o", str(obj)],
                    [cc, *ldflags, str(obj), "-o", str(lib), "-lm"]):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-2000:]}")
        os.replace(lib, out)


def build_library(source: Path, *, cflags: Sequence[str] = CFLAGS,
                  ldflags: Sequence[str] = LDFLAGS, python_api: bool = False) -> ctypes.CDLL:
    """``source`` built (once per content, flags, compiler and CPU) and loaded. Raises
    RuntimeError when no compiler works. Loaded as ctypes.CDLL, which releases the GIL during
    calls; with ``python_api`` compiled against this interpreter's headers and loaded as
    ctypes.PyDLL (calls hold the GIL and may use the Python C API)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    if python_api:
        include = Path(sysconfig.get_paths()["include"])
        if not (include / "Python.h").exists():
            raise RuntimeError(f"no Python.h in {include} (install the interpreter's headers)")
        cflags = [*cflags, f"-I{include}"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    text = source.read_text()
    headers = [(source.parent / h).read_text() for h in re.findall(r'^#include "([^"]+)"', text, re.M)]
    digest = hashlib.sha256("\0".join([
        text, *headers, " ".join([*cflags, *ldflags]), version, _cpu_tag(), platform.machine(),
        sys.version if python_api else "",
    ]).encode()).hexdigest()[:16]
    path = native_home() / digest / f"{source.stem}.so"
    if not path.exists():
        _compile(cc, source, path, cflags, ldflags)
    return ctypes.PyDLL(str(path)) if python_api else ctypes.CDLL(str(path))


class Library:
    """One build-and-load attempt per process for ``source``; ``disable_env`` set to ``0``
    turns it off. ``setup(lib)`` declares argtypes (and may raise to refuse the library)."""

    def __init__(self, source: Path, *, disable_env: str = "KVSTORE_NATIVE",
                 cflags: Sequence[str] = CFLAGS, ldflags: Sequence[str] = LDFLAGS,
                 python_api: bool = False, setup=None) -> None:
        self.source, self.disable_env, self.python_api = source, disable_env, python_api
        self.cflags, self.ldflags, self._setup = tuple(cflags), tuple(ldflags), setup
        self.why: str | None = None
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        if os.environ.get(self.disable_env, "1") == "0":
                            raise RuntimeError(f"disabled by {self.disable_env}=0")
                        lib = build_library(self.source, cflags=self.cflags, ldflags=self.ldflags,
                                            python_api=self.python_api)
                        if self._setup is not None:
                            self._setup(lib)
                        self._lib = lib
                    except Exception as e:  # noqa: BLE001 - any failure means: the Python path
                        self.why = str(e)
                        log.warning("native %s unavailable, using the Python path: %s",
                                    self.source.name, e)
                    self._tried = True
        return self._lib

    def status(self) -> str:
        """``"native"`` or ``"python (<why>)"``; builds on first call."""
        return "native" if self.get() is not None else f"python ({self.why})"


_xxh: dict[str, int] | None = None


def xxh3_functions() -> dict[str, int]:
    """Addresses of the ``xxhash`` wheel's exported XXH3 functions (``XXH3_64bits``,
    ``XXH3_128bits``, ``XXH3_64bits_reset``/``_update``/``_digest``, ``XXH3_createState``,
    ``XXH3_freeState``), for kernels that take them as function pointers. Raises RuntimeError
    when the wheel's library does not export them."""
    global _xxh
    if _xxh is None:
        import xxhash._xxhash as ext  # the extension module: its .so exports libxxhash

        lib = ctypes.CDLL(ext.__file__)  # already loaded: dlopen hands back the same handle
        names = ("XXH3_64bits", "XXH3_128bits", "XXH3_64bits_reset", "XXH3_64bits_update",
                 "XXH3_64bits_digest", "XXH3_createState", "XXH3_freeState")
        try:
            _xxh = {n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value or 0 for n in names}
        except AttributeError as e:
            raise RuntimeError(f"the xxhash wheel's library does not export {e}") from None
    return _xxh
