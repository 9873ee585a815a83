"""The ``hosts`` fixture: ``hosts(n)`` makes N hosts (``router.cluster.hosts.Hosts``), torn
down with everything in them at the end of the test.

Making them needs root and a kernel with network, mount and UTS namespaces. Where they cannot
be made the test is skipped with the reason ("cannot make network namespaces: <error>"),
except under ``CI=true``: CI runs as root, so there it is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from router.cluster.hosts import Hosts, HostsError

__all__ = ["hosts"]


@pytest.fixture
def hosts() -> Iterator[Callable[..., Hosts]]:
    made: list[Hosts] = []

    def make(n: int, **kw: str) -> Hosts:
        h = Hosts(n, **kw)
        try:
            h.__enter__()
        except (HostsError, OSError) as e:
            reason = f"cannot make network namespaces: {e}"
            if os.environ.get("CI") == "true":
                pytest.fail(reason)
            pytest.skip(reason)
        made.append(h)
        return h

    try:
        yield make
    finally:
        for h in reversed(made):
            h.close()
