"""The version of the ``kvcache-store`` distribution, which ships ``kvstore``, ``engine`` and ``router``.

One source: ``version`` in pyproject.toml's ``[project]`` table, read back from the installed
distribution's metadata. ``kvstore.__version__``, ``engine.__version__``,
``router.__version__`` and the ``--version`` of ``kvstore``, ``kvengine`` and ``kvrouter`` all
come from :func:`installed_version`. A source tree that was never pip-installed reports
``0+unknown``.
"""

from __future__ import annotations

__all__ = ["DISTRIBUTION", "installed_version"]

DISTRIBUTION = "kvcache-store"


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # ~30 ms: only when asked

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "0+unknown"
