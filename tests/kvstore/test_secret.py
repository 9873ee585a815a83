"""The cluster secret's sources, order, file handling and the loopback rule."""

from __future__ import annotations

import argparse
import stat

import pytest

from kvstore import secret as S


def test_resolve_order_file_then_value_then_env(tmp_path) -> None:
    f = tmp_path / "s"
    f.write_text("  from-file\n")
    env = {S.ENV: "from-env", S.ENV_FILE: str(f)}
    assert S.resolve("from-flag", f, env) == "from-file"
    assert S.resolve("from-flag", None, env) == "from-flag"
    assert S.resolve(None, None, env) == "from-env"
    assert S.resolve(None, None, {S.ENV_FILE: str(f)}) == "from-file"
    assert S.resolve(None, None, {}) is None


def test_bad_files_are_clear_errors(tmp_path) -> None:
    with pytest.raises(S.SecretError, match="cannot read"):
        S.resolve(file=tmp_path / "missing", environ={})
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(S.SecretError, match="empty"):
        S.resolve(file=tmp_path / "empty", environ={})


def test_written_file_is_owner_only_and_reads_back(tmp_path) -> None:
    secret = S.generate()
    assert len(secret) >= 40 and secret != S.generate()
    p = S.write_secret_file(tmp_path / "d" / "secret", secret)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert S.read_secret_file(p) == secret


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
                                       ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                       ("", False), ("::", False), ("10.1.2.3", False),
                                       ("example.org", False)])
def test_loopback(host: str, loop: bool) -> None:
    assert S.is_loopback(host) is loop


def test_check_bind_refuses_open_servers_without_a_secret() -> None:
    S.check_bind("127.0.0.1", None)
    S.check_bind("0.0.0.0", "s")
    S.check_bind("0.0.0.0", None, insecure=True)
    with pytest.raises(S.InsecureBind, match="--insecure"):
        S.check_bind("0.0.0.0", None)


def test_bearer() -> None:
    assert S.bearer_headers(None) == {}
    assert S.bearer_headers("abc") == {"Authorization": "Bearer abc"}   # what BearerGate wants


def test_flags() -> None:
    p = argparse.ArgumentParser()
    S.add_secret_flags(p)
    a = p.parse_args(["--cluster-secret", "x", "--insecure"])
    assert (a.cluster_secret, a.cluster_secret_file, a.insecure) == ("x", None, True)
    q = argparse.ArgumentParser()
    S.add_secret_flags(q, server=False)
    assert not hasattr(q.parse_args([]), "insecure")
