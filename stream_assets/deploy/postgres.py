"""The PostgreSQL host: Dagster's run, event-log and schedule storage.

Dagster's default SQLite storage locks: a run that hangs while it holds a write
lock blocks its own event log and every other writer. A deployment that runs
for weeks keeps its runs in PostgreSQL (``dagster-postgres``), as here: one
server from Debian's ``postgresql`` package, its own data directory and port,
a database and a login role for Dagster, password-authenticated over TCP.

PostgreSQL refuses to run as root; as root, its commands run as the ``postgres``
system user (created by the Debian package) and the data directory is theirs. If
that user cannot reach the deployment's home (a parent directory closed to other
users), the server's directory is ``stream-assets-postgres-<hash of home>`` under
the system temp dir instead, the same one at every ``up``.

Example::

    >>> pg = PostgresHost(Path(".local/prod-like/postgres"), 25432)  # doctest: +SKIP
    >>> pg.start()  # doctest: +SKIP
    >>> pg.ensure_database("dagster", "dagster", SecretStr(password))  # doctest: +SKIP
    >>> pg.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg2
from psycopg2 import sql
from pydantic import SecretStr

from stream_assets.broker.jvm import tail
from stream_assets.deploy.daemons import DeployError

#: The OS user PostgreSQL runs as when we are root (Debian's package creates it).
RUN_AS = "postgres"
#: The server's superuser role (local socket, trust): only this host's admin uses it.
SUPERUSER = "postgres"


def _reachable_by_server_user(path: Path) -> bool:
    """Whether the ``postgres`` user can enter ``path``'s nearest existing ancestor (path
    resolution needs search permission on every directory above it)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    check = ["runuser", "-u", RUN_AS, "--", "test", "-x", str(existing)]
    return subprocess.run(check, capture_output=True, check=False).returncode == 0


def bin_dir() -> Path:
    """Where ``initdb``/``pg_ctl`` are: on PATH, else Debian's newest ``/usr/lib/postgresql``."""
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).resolve().parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3])
    )
    if not versions:
        raise DeployError(
            "PostgreSQL is not installed (no pg_ctl on PATH nor under /usr/lib/postgresql): "
            "`apt-get install postgresql` (bash infra/dev.sh prod-like does), then re-run"
        )
    return versions[-1].parent


class PostgresHost:
    """A PostgreSQL server with its data under ``home/data``, listening on 127.0.0.1:port."""

    def __init__(self, home: Path, port: int, host: str = "127.0.0.1") -> None:
        self.home = self._server_home(home.resolve())
        self.port = port
        self.host = host
        self.data = self.home / "data"
        self.log_file = self.home / "postgres.log"
        # Unix sockets live here, not in /var/run/postgresql (not ours to write).
        self.socket_dir = self.home / "run"

    @staticmethod
    def _server_home(home: Path) -> Path:
        """``home``, or, when we are root and the ``postgres`` user cannot reach it (a
        parent closed to other users, as a mktemp or pytest directory is), a directory
        of its own under the system temp dir, named after ``home`` so every ``up`` of
        this deployment finds the same data again."""
        if os.geteuid() != 0 or _reachable_by_server_user(home):
            return home
        digest = hashlib.sha256(str(home).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"stream-assets-postgres-{digest}"

    def _as_server_user(self, args: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return args
        try:
            pwd.getpwnam(RUN_AS)
        except KeyError as exc:
            raise DeployError(
                f"PostgreSQL will not run as root and there is no '{RUN_AS}' user: "
                f"`apt-get install postgresql` creates it (or `useradd -r {RUN_AS}`)"
            ) from exc
        return ["runuser", "-u", RUN_AS, "--", *args]

    def _run(self, args: list[str]) -> None:
        done = subprocess.run(
            self._as_server_user(args), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise DeployError(
                f"{Path(args[0]).name} failed ({done.returncode}): {done.stderr.strip()}\n"
                f"server log ({self.log_file}):\n{tail(self.log_file, 20)}"
            )

    def _own(self, path: Path) -> None:
        if os.geteuid() == 0:
            entry = pwd.getpwnam(RUN_AS)
            for p in (path, *path.rglob("*")):
                os.chown(p, entry.pw_uid, entry.pw_gid)

    def running(self) -> bool:
        """Whether the server of this data directory runs (``pg_ctl status``)."""
        if not (self.data / "PG_VERSION").exists():
            return False
        args = [str(bin_dir() / "pg_ctl"), "status", "-D", str(self.data)]
        return subprocess.run(self._as_server_user(args), capture_output=True).returncode == 0

    def start(self) -> None:
        """Create the cluster on first use, then start the server and wait until it accepts."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        if not (self.data / "PG_VERSION").exists():
            self.data.mkdir(exist_ok=True)
            self._own(self.home)
            self._run(
                [
                    str(bin_dir() / "initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    SUPERUSER,
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                    "--encoding=UTF8",
                ]
            )
        self._own(self.home)
        if self.running():
            return
        options = f"-p {self.port} -k {self.socket_dir} -h {self.host}"
        self._run(
            [
                str(bin_dir() / "pg_ctl"),
                "start",
                "-D",
                str(self.data),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.log_file),
                "-o",
                options,
            ]
        )

    def stop(self) -> None:
        """Stop the server (fast shutdown: open sessions are ended, nothing is lost)."""
        if self.running():
            self._run([str(bin_dir() / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast"])

    def _superuser(self) -> psycopg2.extensions.connection:
        conn = psycopg2.connect(
            host=str(self.socket_dir), port=self.port, user=SUPERUSER, dbname="postgres"
        )
        conn.autocommit = True
        return conn

    def ensure_database(self, dbname: str, user: str, password: SecretStr) -> None:
        """A login role ``user`` (its password set to ``password``) owning database ``dbname``."""
        with contextlib.closing(self._superuser()) as conn, conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (user,))
            verb = "ALTER" if cur.fetchone() else "CREATE"
            # Client-side interpolation: the password never reaches a log line or the
            # server's statement log as anything but this statement.
            cur.execute(
                sql.SQL(verb + " ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(user)),
                (password.get_secret_value(),),
            )
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
            if not cur.fetchone():
                cur.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(dbname), sql.Identifier(user)
                    )
                )
