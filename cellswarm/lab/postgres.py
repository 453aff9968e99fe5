"""The lab's database host: a PostgreSQL server of its own in host `db`, shared by the
coordinators (as a real two-coordinator swarm runs it). Debian's server binaries are used
as they are; `initdb` refuses root, so the cluster belongs to the `postgres` user."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cellswarm.errors import LabError

if TYPE_CHECKING:
    from cellswarm.lab.lab import Lab

USER = "postgres"


def pg_bin(tool: str = "postgres") -> Path | None:
    """The folder of initdb and `tool` (on PATH, or Debian's /usr/lib/postgresql/N/bin),
    or None when PostgreSQL's server is not installed."""
    found = shutil.which("initdb")
    if found and shutil.which(tool):
        return Path(os.path.realpath(found)).parent
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(d, "initdb").exists() and Path(d, tool).exists():
            return Path(d)
    return None


def _as_postgres(binary: Path, *args: str) -> list[str]:
    return ["runuser", "-u", USER, "--", str(binary), *args]


def start_postgres(lab: Lab, host: str) -> None:
    binary = pg_bin()
    if binary is None:
        raise LabError("--coordinators 2 needs PostgreSQL's server binaries on this machine "
                       "(Debian: apt-get install postgresql)")  # fmt: skip
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", USER], check=True)
    pw = pwd.getpwnam(USER)
    root = data_root(lab)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    os.chown(root, pw.pw_uid, pw.pw_gid)
    (lab.host_dir(host) / "pg").unlink(missing_ok=True)
    (lab.host_dir(host) / "pg").symlink_to(root)  # the host's folder shows where it is
    data = root / "data"
    done = subprocess.run(_as_postgres(binary / "initdb", "-D", str(data), "-A", "trust",
                                       "-U", USER, "--no-sync", "-E", "UTF8"),
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise LabError(f"initdb failed: {done.stderr.strip()[-300:]}")
    with (data / "pg_hba.conf").open("a") as f:  # the lab's hosts, no password (a lab)
        f.write("host all all 10.77.0.0/16 trust\n")
    address = lab.topology.host(host).address
    lab.spawn(host, "postgres", _as_postgres(
        binary / "postgres", "-D", str(data), "-k", str(root), "-p", "5432",
        "-c", f"listen_addresses={address}", "-c", "max_connections=200"))  # fmt: skip
    _wait_ready(lab, host, binary, address)
    created = subprocess.run(
        [*lab.enter(host), *_as_postgres(
            binary / "createdb" if (binary / "createdb").exists() else Path("createdb"),
            "-h", address, "-p", "5432", "-U", USER, "cellswarm")],
        capture_output=True, text=True)  # fmt: skip
    if created.returncode != 0:
        raise LabError(f"createdb failed: {created.stderr.strip()[-300:]}")


def _wait_ready(lab: Lab, host: str, binary: Path, address: str, timeout_s: float = 60) -> None:
    isready = binary / "pg_isready"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ok = subprocess.run([*lab.enter(host), str(isready), "-U", USER, "-h", address,
                             "-p", "5432"], capture_output=True)  # fmt: skip
        if ok.returncode == 0:
            return
        lab.raise_if_exited(host, "postgres", "before accepting connections")
        time.sleep(0.2)
    raise LabError(f"PostgreSQL on {host} did not start: {lab.output(host, 'postgres')[-300:]}")


def data_root(lab: Lab) -> Path:
    """The server's folder: outside the lab's state folder, whose parents the `postgres`
    user may not be allowed to enter (a 0700 home or temporary folder)."""
    return Path("/var/tmp") / f"cellswarm-lab-{lab.prefix}-pg"


def stop_postgres(lab: Lab) -> None:
    """The db host's processes are killed by `down`; its data goes with the lab."""
    shutil.rmtree(data_root(lab), ignore_errors=True)
