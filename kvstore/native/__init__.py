"""Native helpers of the store, built from C on first use (``kvstore.native.build``).

The C sources live in ``kvstore/csrc``; each is compiled with the system C compiler into
``$KVCACHE_HOME/native/<digest>/`` the first time a process asks for it and loaded with ctypes.
xxHash comes from the ``xxhash`` wheel the store already depends on: its shared object exports
the XXH3 functions, whose addresses the kernels take as arguments (``xxh3_functions``), so the
hashes are the wheel's own, bit for bit. Every caller keeps a pure-Python path for machines
with no compiler (or ``KVSTORE_NATIVE=0``).
"""

from kvstore.native.build import Library, build_library, native_home, xxh3_functions

__all__ = ["Library", "build_library", "native_home", "xxh3_functions"]
