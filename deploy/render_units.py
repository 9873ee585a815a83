"""Render the systemd unit templates of deploy/systemd/ with real paths.

    python3 deploy/render_units.py --prefix /opt/kvcache --out /etc/systemd/system

``--prefix`` is the virtual environment (or install prefix) the package is installed in: its
``bin/`` must hold ``kvstore``, ``kvengine`` and ``kvrouter`` (default: the prefix of the
Python running this script). Writes ``kvstore.service``, ``kvengine@.service`` and
``kvrouter.service`` into ``--out`` and prints what to do next. Only the standard library:
it runs with any Python 3.9+.

Placeholders: ``@BIN@`` (PREFIX/bin), ``@USER@``/``@GROUP@`` (``--user``/``--group``),
``@CONFIG_DIR@`` (``--config-dir``: the env files and the cluster secret), ``@DOCS@``
(docs/deployment.md beside this script) and ``@PROTECT_HOME@`` (``yes``, or ``read-only``
when the prefix lives under /home or /root, which ``ProtectHome=yes`` would hide).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "systemd"
UNITS = ("kvstore.service", "kvengine@.service", "kvrouter.service")
EXECUTABLES = ("kvstore", "kvengine", "kvrouter")
_LEFT = re.compile(r"@[A-Z_]+@")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 deploy/render_units.py",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--prefix", default=sys.prefix,
                    help="the venv or install prefix whose bin/ holds kvstore, kvengine and "
                         "kvrouter (default: %(default)s)")
    ap.add_argument("--out", required=True, help="directory to write the unit files to")
    ap.add_argument("--user", default="kvcache", help="User= of every unit (default %(default)s)")
    ap.add_argument("--group", default=None, help="Group= of every unit (default: --user)")
    ap.add_argument("--config-dir", default="/etc/kvcache",
                    help="where the env files and the cluster secret live (default %(default)s)")
    ap.add_argument("--no-check", action="store_true",
                    help="write the units even when an executable is missing under PREFIX/bin")
    return ap


def values(prefix: str, user: str, group: str | None, config_dir: str) -> dict[str, str]:
    """What each placeholder becomes."""
    root = Path(os.path.abspath(prefix))
    under_home = any(root == Path(h) or Path(h) in root.parents for h in ("/home", "/root"))
    return {
        "@BIN@": str(root / "bin"),
        "@USER@": user,
        "@GROUP@": group or user,
        "@CONFIG_DIR@": os.path.abspath(config_dir),
        "@DOCS@": str(HERE.parent / "docs" / "deployment.md"),
        "@PROTECT_HOME@": "read-only" if under_home else "yes",
    }


def render(text: str, subst: dict[str, str]) -> str:
    for key, value in subst.items():
        text = text.replace(key, value)
    left = sorted(set(_LEFT.findall(text)))
    if left:
        raise ValueError(f"placeholders left unfilled: {', '.join(left)}")
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    subst = values(args.prefix, args.user, args.group, args.config_dir)
    missing = [e for e in EXECUTABLES if not os.access(Path(subst["@BIN@"]) / e, os.X_OK)]
    if missing and not args.no_check:
        print(f"render_units: no {', '.join(missing)} in {subst['@BIN@']}: install the package "
              "there (pip install -e '.[engine,router]') or pass --prefix", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in UNITS:
        (out / name).write_text(render((TEMPLATES / name).read_text(), subst))
        print(f"wrote {out / name}")
    cfg = subst["@CONFIG_DIR@"]
    print(f"next: the env files in {cfg} (examples: {TEMPLATES / 'env'}), the cluster secret in "
          f"{cfg}/cluster-secret (root, 0600), user {subst['@USER@']}, then `systemctl "
          "daemon-reload` and `systemctl enable --now kvstore kvengine@prefill-0 kvrouter` "
          "(see docs/deployment.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
