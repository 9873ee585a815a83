"""``require_native``: how a test of a native kernel (``kvstore.native``) treats a kernel that
did not build: skipped only where no C compiler exists, failed where one does (a broken build
must not hide behind a skip)."""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["require_native"]


def require_native(available: bool, what: str, why: str | None = None) -> None:
    """Skip a test of a native kernel only where no C compiler exists; where one does, a
    kernel that did not build is a failure (a broken build must not hide behind a skip)."""
    if available:
        return
    if os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"):
        pytest.fail(f"{what} did not build although a C compiler is installed: {why}")
    pytest.skip(f"no C compiler: {what} cannot be built")
