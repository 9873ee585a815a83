"""Operator commands over a cluster in etcd: ``kvstore nodes``, ``kvstore drain``, ``kvstore config``.

- ``kvstore nodes [--json]``: the registered store nodes (from etcd) with address, state
  (``up``, ``draining``, ``unreachable``: asked for its stats over the wire), tiers and
  occupancy per tier, and the cluster's R. A table by default; ``--json`` also has each
  node's ``transports`` (``"ucx"`` among them under ``kvstore serve --ucx``).
- ``kvstore drain NODE``: asks NODE to drain (``kvstore.daemon.drain``: it stops taking new
  blocks, hands what it holds to the new owners, deregisters and exits) and waits, printing
  progress, until it has left: exit 0; 1 if the drain failed or ``--timeout`` passed (the
  node goes on draining then); ``--no-wait`` returns once the request is in etcd.
- ``kvstore config get [--json]`` / ``kvstore config set replicas N``: the cluster settings
  (``kvstore.coord.settings``). Every client and daemon follows a change within its watch
  latency; the daemons' repair passes then add the copies a larger R needs.

``kvstore serve``'s flags for these (``add_serve_flags``): ``--node-id``, ``--replicas`` (seeds R
when the cluster has none: the first daemon of a cluster sets it, a later ``kvstore config set``
wins over any daemon's flag), ``--repair-rate``, ``--repair-interval``, ``--repair-settle``.
Imports stay lazy so that ``kvstore --help`` stays quick.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvstore import secret, tls

__all__ = ["add_serve_flags", "add_commands"]


def add_serve_flags(s: argparse.ArgumentParser) -> None:
    """``kvstore serve``'s identity, replication and repair flags."""
    s.add_argument("--node-id", metavar="ID",
                   help="this node's id in the cluster; default: the id kept in --ssd-path "
                        "(written there on first start), else a random one. An id that "
                        "differs from the kept one is refused")
    s.add_argument("--replicas", type=int, metavar="N",
                   help="copies of each block; seeds the cluster's setting in etcd only when it "
                        "has none (`kvstore config set replicas N` changes it; default 1)")
    s.add_argument("--repair-rate", default="64M", metavar="BYTES_PER_S",
                   help="re-replication bandwidth this node may use to push copies other nodes "
                        "lack, e.g. 64M (bytes/s; default 64M); 0 turns background passes off")
    s.add_argument("--repair-interval", type=float, default=600.0, metavar="SECONDS",
                   help="also run a re-replication pass this often, not only after membership "
                        "changes (default 600; 0: only after changes)")
    s.add_argument("--repair-settle", type=float, default=0.5, metavar="SECONDS",
                   help="wait this long after the last membership change before a pass "
                        "(default 0.5)")


def _cluster_flags(c: argparse.ArgumentParser, secrets: bool = False) -> None:
    c.add_argument("--etcd", default="http://127.0.0.1:2379",
                   help="etcd endpoints URL (default http://127.0.0.1:2379)")
    c.add_argument("--cluster", default="kvstore", help="cluster name (etcd key prefix)")
    c.add_argument("--json", action="store_true", help="one JSON object instead of text")
    tls.add_tls_flags(c)
    if secrets:
        secret.add_secret_flags(c, server=False)
        c.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS",
                       help="bound on reaching each node (default 2)")


def add_commands(sub: Any) -> None:
    """Add ``nodes``, ``drain`` and ``config`` to ``kvstore``'s subcommands."""
    n = sub.add_parser("nodes", help="list the cluster's store nodes (address, tiers, "
                                     "occupancy, health)")
    _cluster_flags(n, secrets=True)
    n.set_defaults(fn=_nodes, log_level="WARNING")

    d = sub.add_parser("drain", help="move a node's blocks to the other nodes, then stop it")
    d.add_argument("node", help="the node id to drain (see `kvstore nodes`)")
    _cluster_flags(d)
    d.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up waiting after this long (the drain goes on; default 600)")
    d.add_argument("--no-wait", action="store_true",
                   help="return once the request is in etcd")
    d.set_defaults(fn=_drain, log_level="WARNING")

    c = sub.add_parser("config", help="read or change the cluster's settings in etcd")
    csub = c.add_subparsers(dest="action", required=True)
    g = csub.add_parser("get", help="print the settings in force")
    _cluster_flags(g)
    s = csub.add_parser("set", help="change one setting, e.g. `kvstore config set replicas 2`")
    s.add_argument("name", choices=("replicas",), help="the setting")
    s.add_argument("value", help="its new value")
    _cluster_flags(s)
    for p in (g, s):
        p.set_defaults(fn=_config, log_level="WARNING")


# -- config ----------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> int:
    from kvstore.coord import settings
    from kvstore.coord.etcd import EtcdClient

    with EtcdClient(args.etcd) as etcd:
        if args.action == "set":
            stored = settings.update(etcd, args.cluster, **{args.name: args.value})
        else:
            stored = settings.read(etcd, args.cluster)
    in_force = {"replicas": settings.replicas_of(stored)}
    if args.json:
        print(json.dumps(in_force))
    else:
        for name, value in in_force.items():
            note = "" if name in stored else " (default)"
            print(f"{name} = {value}{note}")
    return 0


# -- nodes -----------------------------------------------------------------------------------


def _tier_rows(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    store = stats.get("store", {})
    return {tier: {"used_bytes": int(t.get("used_bytes", 0)),
                   "capacity_bytes": int(t.get("capacity_bytes", 0)),
                   "blocks": int(t.get("blocks", 0))}
            for tier, t in store.items() if isinstance(t, dict)}


def node_table(args: argparse.Namespace) -> dict[str, Any]:
    """What ``kvstore nodes`` prints, as one object."""
    from kvstore.client.cluster import ClusterClient

    token = secret.resolve(args.cluster_secret, args.cluster_secret_file)
    with ClusterClient(args.etcd, args.cluster, auth_token=token, timeout=args.timeout,
                       read_repair=False) as cc:
        members = cc.members
        stats = cc.stats()
    rows = []
    for node, entry in stats["nodes"].items():
        value = members.get(node, {})
        if "error" in entry:
            state = "unreachable"
        else:
            state = "draining" if entry["draining"] else "up"
        row: dict[str, Any] = {"node_id": node, "address": entry["address"], "state": state,
                               "host_id": value.get("host_id"),
                               "tiers": value.get("tiers", []),
                               "transports": value.get("transports", ["tcp", "shm"]),
                               "capacity": value.get("capacity", {})}
        if "error" in entry:
            row["error"] = entry["error"]
        else:
            row["occupancy"] = _tier_rows(entry["stats"])
        rows.append(row)
    return {"cluster": args.cluster, "replicas": stats["replicas"],
            "etcd_healthy": stats["etcd_healthy"], "nodes": rows}


def _nodes(args: argparse.Namespace) -> int:
    from kvstore.daemon.config import format_size

    table = node_table(args)
    if args.json:
        print(json.dumps(table))
        return 0
    print(f"cluster {table['cluster']}: {len(table['nodes'])} store node(s), replicas "
          f"{table['replicas']}")
    header = f"{'NODE':<34} {'ADDRESS':<22} {'STATE':<12} {'TIERS':<13} OCCUPANCY"
    print(header)
    for row in table["nodes"]:
        occ = row.get("occupancy")
        if occ is None:
            used = row.get("error", "")[:60]
        else:
            used = "  ".join(f"{t} {format_size(o['used_bytes'])}/{format_size(o['capacity_bytes'])}"
                             f" ({o['blocks']} blocks)" for t, o in occ.items())
        print(f"{row['node_id']:<34} {row['address']:<22} {row['state']:<12} "
              f"{','.join(row['tiers']):<13} {used}")
    return 0


# -- drain -----------------------------------------------------------------------------------


def _drain(args: argparse.Namespace) -> int:
    from kvstore.coord import layout
    from kvstore.coord.etcd import EtcdClient

    key = layout.drain_key(args.cluster, args.node)
    with EtcdClient(args.etcd) as etcd:
        if etcd.get(layout.store_key(args.cluster, args.node)) is None:
            print(f"kvstore drain: no store node {args.node} is registered in cluster "
                  f"{args.cluster!r} (see `kvstore nodes`)", file=sys.stderr)
            return 1
        etcd.put(key, json.dumps({"state": "requested", "at": time.time()}))
        if args.no_wait:
            print(f"drain of {args.node} requested")
            return 0
        deadline = time.monotonic() + args.timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            raw = etcd.get(key)
            record = json.loads(raw) if raw else {}
            if record != last and not args.json and record.get("state") == "draining":
                print(f"draining {args.node}: {record.get('pushed_blocks', 0)} blocks pushed, "
                      f"{record.get('pending', '?')} pending", flush=True)
            last = record
            state = record.get("state")
            gone = etcd.get(layout.store_key(args.cluster, args.node)) is None
            if state == "failed" or (state == "done" and gone):
                etcd.delete(key)
                if args.json:
                    print(json.dumps({"node_id": args.node, **record}))
                elif state == "done":
                    print(f"drained {args.node}: {record.get('pushed_blocks', 0)} blocks "
                          f"({record.get('pushed_bytes', 0)} bytes) handed over; it left the "
                          f"cluster")
                else:
                    print(f"kvstore drain: {args.node} could not drain: {record.get('error')}",
                          file=sys.stderr)
                return 0 if state == "done" else 1
            if raw is None or (gone and state not in ("done",)):
                print(f"kvstore drain: {args.node} left before it finished draining "
                      f"(state {state!r})", file=sys.stderr)
                etcd.delete(key)
                return 1
            time.sleep(0.1)
    print(f"kvstore drain: {args.node} has not finished after {args.timeout:g} s; it goes on "
          f"draining (`kvstore nodes` shows it)", file=sys.stderr)
    return 1
