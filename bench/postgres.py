"""A throwaway PostgreSQL server: started for a test session or a soak phase, gone after.

It needs the server binaries (Debian: `apt-get install postgresql`; found in
`/usr/lib/postgresql/*/bin`, on `PATH`, or in `$IOP_TEST_POSTGRES_BIN`) and the psycopg
package. `initdb` refuses to run as root, so as root the cluster runs as the `postgres`
user the package creates. The cluster lives in a temporary directory, listens on
127.0.0.1 on a free port with password authentication (scram-sha-256), and has no fsync
(nothing here must survive a power cut). When it cannot start, `throwaway_postgres`
raises `PostgresUnavailable` saying why and what to install: the test suite turns that
into a skip (a failure under CI), the soak into a phase reported as skipped.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Postgres", "PostgresUnavailable", "create_database", "throwaway_postgres"]


class PostgresUnavailable(Exception):
    """The throwaway server cannot run here; the message says why and what to install."""


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int
    superuser_password: str
    password: str
    """The `iop` role's password (an Edge reads it from its `ledger_password_env`)."""
    cluster: _Cluster | None = field(default=None, compare=False, repr=False)
    options: str = ""
    """`pg_ctl -o` options it was started with (it restarts with the same)."""

    def stop(self) -> None:
        """Stop the server as an outage does (fast shutdown: every session is cut).
        Blocking; whoever stops it starts it again before it ends (`start`)."""
        assert self.cluster is not None
        self.cluster.run("pg_ctl", "-D", "data", "-m", "fast", "-w", "stop")

    def start(self) -> None:
        """Start the stopped server again, on the same port. Blocking."""
        assert self.cluster is not None
        self.cluster.run("pg_ctl", "-D", "data", "-o", self.options, "-l", "log", "-w", "start")

    def url(self, database: str) -> str:
        return f"postgresql://iop@{self.host}:{self.port}/{database}"

    def admin_url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres:{self.superuser_password}@{self.host}:{self.port}/{database}"


def _bin_dir() -> Path | None:
    configured = os.environ.get("IOP_TEST_POSTGRES_BIN")
    if configured:
        return Path(configured)
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda path: int(path.split("/")[-2])
    )
    if candidates:
        return Path(candidates[-1])
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class _Cluster:
    bin_dir: Path
    root: Path
    user: str | None

    def run(self, *argv: str) -> None:
        subprocess.run(
            [str(self.bin_dir / argv[0]), *argv[1:]],
            check=True,
            capture_output=True,
            user=self.user,
            cwd=self.root,
        )


@contextmanager
def throwaway_postgres() -> Iterator[Postgres]:
    """Start the server; yields it; stops it and removes its files (module docstring).
    Blocking: from Trio, enter it in a worker thread or accept the second it takes."""
    try:
        import psycopg
    except ImportError:
        raise PostgresUnavailable(
            "the psycopg package is not installed (pip install -e '.[dev]')"
        ) from None
    bin_dir = _bin_dir()
    if bin_dir is None or not (bin_dir / "initdb").exists():
        raise PostgresUnavailable(
            "no PostgreSQL server binaries (Debian: apt-get install postgresql)"
        )
    user = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise PostgresUnavailable(
                "running as root, and there is no `postgres` user to run the server: "
                "apt-get install postgresql creates it (or run as another user)"
            ) from None
        user = "postgres"
    root = Path(tempfile.mkdtemp(prefix="iop-pg-"))
    cluster = _Cluster(bin_dir, root, user)
    superuser_password = secrets.token_hex(12)
    password = secrets.token_hex(12)
    port = _free_port()
    (root / "pw").write_text(superuser_password)
    if user is not None:
        account = pwd.getpwnam(user)
        os.chown(root, account.pw_uid, account.pw_gid)
        os.chown(root / "pw", account.pw_uid, account.pw_gid)
    try:
        cluster.run(
            "initdb", "-D", "data", "-U", "postgres", "-A", "scram-sha-256", "--pwfile", "pw"
        )
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
        cluster.run("pg_ctl", "-D", "data", "-o", options, "-l", "log", "-w", "start")
    except subprocess.CalledProcessError as exc:
        output = (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
        shutil.rmtree(root, ignore_errors=True)
        raise PostgresUnavailable(f"the server did not start: {output.strip()[-500:]}") from None
    server = Postgres(
        "127.0.0.1", port, superuser_password, password, cluster=cluster, options=options
    )
    try:
        with psycopg.connect(server.admin_url(), autocommit=True) as admin:
            admin.execute(f"CREATE ROLE iop LOGIN PASSWORD '{password}'")
        yield server
    finally:
        try:
            cluster.run("pg_ctl", "-D", "data", "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def create_database(server: Postgres, name: str) -> str:
    """A fresh database owned by `iop`; its URL (no password in it)."""
    import psycopg

    with psycopg.connect(server.admin_url(), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}" OWNER iop')
    return server.url(name)
