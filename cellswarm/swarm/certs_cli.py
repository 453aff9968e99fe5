"""`cellswarm certs init | node`: a cluster CA and node certificates for `--tls DIR` (tls.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_certs_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("certs", help="TLS: a cluster CA and node certificates for --tls")
    csub = c.add_subparsers(dest="certs_command", required=True)
    i = csub.add_parser("init", help="make the cluster CA: DIR/ca.pem and DIR/ca.key (0600)")
    i.add_argument("--dir", required=True, help="a folder for the CA; keep ca.key private")
    i.set_defaults(func=cmd_init)
    n = csub.add_parser("node", help="a node certificate signed by the cluster CA")
    n.add_argument("name", help="the node's name (also a DNS name in the certificate)")
    n.add_argument("--dir", required=True, help="the CA's folder (from `certs init`)")
    n.add_argument("--out", help="where ca.pem, node.pem, node.key go (default DIR/NAME)")
    n.add_argument("--host", action="append", default=[],
                   help="an IP or DNS name the node is reached at (repeatable)")  # fmt: skip
    n.set_defaults(func=cmd_node)


def cmd_init(args: argparse.Namespace) -> int:
    from cellswarm.swarm.tls import init_ca

    d = init_ca(args.dir)
    print(f"cluster CA in {d} (keep {d / 'ca.key'} off the nodes); "
          f"next: cellswarm certs node NAME --dir {d}")  # fmt: skip
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from cellswarm.swarm.tls import issue

    out = issue(args.dir, args.name, args.out or Path(args.dir) / args.name, args.host)
    print(f"{args.name}: {out}/node.pem, node.key, ca.pem; copy the folder to the node and "
          f"pass --tls {out}")  # fmt: skip
    return 0
