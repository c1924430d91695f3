"""A throwaway PostgreSQL server for the tests: `initdb` + `pg_ctl` in a temporary directory, on a free loopback
port, with trust authentication. Uses the machine's PostgreSQL binaries (Debian: /usr/lib/postgresql/<v>/bin);
as root, the server runs as the `postgres` user, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_databases = itertools.count()


def postgres_bin() -> Path | None:
    """The folder holding initdb and pg_ctl: on PATH, else the newest Debian install; None if there is none."""
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    installed = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    return Path(installed[-1]).parent if installed else None


@dataclass
class PostgresServer:
    bin_dir: Path
    data_dir: Path
    port: int
    user: str | None  # the OS user the server runs as, when not the current one

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """Create an empty database and return its URL (each gateway under test gets its own)."""
        import psycopg

        name = f"ladle_test_{os.getpid()}_{next(_databases)}"
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        self._run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"],
                  check=False)
        shutil.rmtree(self.data_dir.parent, ignore_errors=True)

    def _run(self, command: Sequence[str], check: bool = True) -> None:
        full = ["runuser", "-u", self.user, "--", *command] if self.user else list(command)
        subprocess.run(full, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_postgres() -> PostgresServer:
    """initdb and start a server; RuntimeError if PostgreSQL is not installed."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL is not installed (no pg_ctl on PATH or in /usr/lib/postgresql)")
    root = Path(tempfile.mkdtemp(prefix="ladle-pg-"))
    user = None
    if os.geteuid() == 0:
        user = "postgres"
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    server = PostgresServer(bin_dir, root / "data", _free_port(), user)
    server._run([str(bin_dir / "initdb"), "-D", str(server.data_dir), "-U", "postgres", "--auth=trust",
                 "--no-sync", "-E", "UTF8"])
    options = f"-c listen_addresses=127.0.0.1 -p {server.port} -k {root} -c fsync=off -c max_connections=200"
    server._run([str(bin_dir / "pg_ctl"), "-D", str(server.data_dir), "-o", options, "-l", str(root / "log"),
                 "-w", "start"])
    return server
