"""`cellswarm nats config`: nats-server's file for `--control` (transport/beats.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_nats_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    n = sub.add_parser("nats", help="NATS for --control: a nats-server configuration")
    nsub = n.add_subparsers(dest="nats_command", required=True)
    c = nsub.add_parser("config", help="write nats-server's configuration (user and "
                        "password from the cluster token; mutual TLS with --tls)")  # fmt: skip
    c.add_argument("--listen", default="0.0.0.0:4222", help="HOST:PORT it listens on")
    c.add_argument("--token-file", help="the cluster's token (as the coordinator's)")
    c.add_argument("--tls", help="a certificate folder for the NATS host (`cellswarm certs "
                   "node NAME --host ADDRESS`): clients then need the cluster's certificates")
    c.add_argument("--out", required=True, help="the file to write (0600: it holds the "
                   "password); run `nats-server -c FILE`")  # fmt: skip
    c.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    from cellswarm.swarm.auth import load_token, write_secret
    from cellswarm.swarm.transport.beats import server_config

    token = load_token(args.token_file) if args.token_file else None
    write_secret(args.out, server_config(args.listen, token, args.tls))
    scheme = "tls" if args.tls else "nats"
    host, _, port = args.listen.rpartition(":")
    host = "THIS-HOST" if host in ("", "0.0.0.0", "::", "[::]") else host
    print(f"nats-server configuration in {Path(args.out)}; run `nats-server -c {args.out}` "
          f"and give every process --control {scheme}://{host}:{port}"
          + ("" if token else " (no --token-file: anyone who reaches it may publish)"))
    return 0
