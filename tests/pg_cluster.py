"""A throwaway PostgreSQL cluster for the tests: initdb into a temporary folder, trust auth,
listening on a free 127.0.0.1 port and a socket in its own folder; no system service.

`initdb` refuses to run as root: as root, the cluster belongs to the `postgres` system user
(created if missing) and its tools run through `runuser`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from cellswarm.lab import postgres
from cellswarm.swarm.local.pipeline import free_port


def pg_bin() -> Path | None:
    """The folder of initdb / pg_ctl, or None when PostgreSQL is not installed."""
    return postgres.pg_bin("pg_ctl")


def why_not() -> str:
    """Why no cluster can be started here ('' when one can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg 3 is not installed (pip install 'psycopg[binary]')"
    if pg_bin() is None:
        return "no PostgreSQL binaries (initdb, pg_ctl): apt-get install postgresql"
    return ""


@dataclass
class Cluster:
    root: Path
    port: int
    bin: Path
    user: str | None  # run the tools as this user (when we are root)

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def new_database(self) -> str:
        """A fresh empty database; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def _run(self, *args: str) -> None:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "stop", "-D", str(self.root / "data"), "-m", "immediate", "-w")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def start() -> Cluster:
    binary = pg_bin()
    assert binary is not None
    user = None
    root = Path(tempfile.mkdtemp(prefix="cellswarm-pg-"))
    if os.geteuid() == 0:
        user = "postgres"
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", user], check=True)
        pw = pwd.getpwnam(user)
        os.chown(root, pw.pw_uid, pw.pw_gid)
    cluster = Cluster(root, free_port(), binary, user)
    data = root / "data"
    try:
        cluster._run("initdb", "-D", str(data), "-A", "trust", "-U", "postgres",
                     "--no-sync", "-E", "UTF8")  # fmt: skip
        opts = (f"-p {cluster.port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c max_connections=200")  # fmt: skip
        cluster._run("pg_ctl", "start", "-D", str(data), "-w", "-t", "60",
                     "-l", str(root / "log"), "-o", opts)  # fmt: skip
    except subprocess.CalledProcessError as exc:
        log = (root / "log").read_text() if (root / "log").exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"could not start PostgreSQL: {exc.stderr} {log[-2000:]}") from exc
    return cluster
