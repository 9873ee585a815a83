"""The digest of a checkpoint's weight files: the ``weights`` fact of a namespace id
(``kvstore.keys.namespace_id``), so two engines that load the same bytes share blocks and two
fine-tunes of one architecture never do.

``files_digest(paths)`` is the hex XXH3-128 over each file's name, size and the XXH3-128 of its
full contents, in the order given; a file's digest is memoized per process by (path, size,
mtime), so a second engine in the process pays nothing.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from pathlib import Path

import xxhash

__all__ = ["files_digest"]

_CHUNK = 64 << 20
_memo: dict[tuple[str, int, int], str] = {}


def files_digest(paths: Iterable[str | Path]) -> str:
    """Hex XXH3-128 over ``paths`` (module docstring)."""
    h = xxhash.xxh3_128()
    for path in map(Path, paths):
        st = path.stat()
        memo_key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        digest = _memo.get(memo_key)
        if digest is None:
            fh = xxhash.xxh3_128()
            if st.st_size:
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    view = memoryview(mm)
                    for off in range(0, len(view), _CHUNK):
                        fh.update(view[off : off + _CHUNK])
                    view.release()
            digest = _memo[memo_key] = fh.hexdigest()
        h.update(f"{path.name}\0{st.st_size}\0{digest}\0".encode())
    return h.hexdigest()
