"""Private PostgreSQL servers from Debian's `postgresql-15` binaries: a primary with a
streaming standby made by `pg_basebackup`, on free loopback ports, for the replica and
failover tests. Run as the `postgres` user (the server refuses root)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from enrichq_schema.db import create_engine
from tests.support.procs import wait_for
from tests.support.tcpproxy import TcpProxy
from tests.support.web import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")
NOT_INSTALLED = (
    "PostgreSQL 15 server binaries are not installed (Debian package postgresql-15, "
    "/usr/lib/postgresql/15/bin; .ci/run installs it)"
)
SERVER_USER = "postgres"
START_TIMEOUT_SECONDS = 60
SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "200",
    "shared_buffers": "64MB",
    "wal_level": "replica",
    "max_wal_senders": "10",
    "hot_standby": "on",
    # a test server: the standby holds the only copy that matters, the primary is never
    # started again after its crash; durability to disk buys nothing here
    "fsync": "off",
    "full_page_writes": "off",
    "wal_keep_size": "256MB",
    "logging_collector": "off",
}


def missing() -> str | None:
    """Why these servers cannot run here, or None."""
    needed = ("initdb", "pg_ctl", "pg_basebackup", "postgres")
    if all((PG_BIN / name).is_file() for name in needed):
        return None
    return NOT_INSTALLED


def require() -> None:
    why = missing()
    if why:
        pytest.skip(why)


def _as_server_user() -> dict[str, Any]:
    if os.geteuid() != 0:
        return {}
    user = pwd.getpwnam(SERVER_USER)
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _run(args: list[str], *, cwd: Path, timeout: float = 120) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    result = subprocess.run(
        args,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **_as_server_user(),
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.strip() or result.stdout}")


class Node:
    """One server: its data directory, port and log under `base`."""

    def __init__(self, base: Path, name: str) -> None:
        self.name = name
        self.dir = base / name
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = free_port()
        self.dir.mkdir(parents=True)
        if os.geteuid() == 0:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(self.dir, user.pw_uid, user.pw_gid)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _configure(self) -> None:
        lines = [f"{k} = {v}" for k, v in {**SETTINGS, "port": str(self.port)}.items()]
        lines.append(f"unix_socket_directories = '{self.dir}'")
        with (self.data / "postgresql.auto.conf").open("a", encoding="utf-8") as conf:
            conf.write("\n".join(lines) + "\n")
        (self.data / "pg_hba.conf").write_text(
            "local all all trust\n"
            "host all all 127.0.0.1/32 trust\n"
            "host replication all 127.0.0.1/32 trust\n",
            encoding="utf-8",
        )

    def initdb(self) -> Node:
        _run(
            [
                str(PG_BIN / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-instructions",
            ],
            cwd=self.dir,
        )
        self._configure()
        return self

    def basebackup_of(self, primary: Node, *, port: int | None = None) -> Node:
        """Make this node a streaming standby of `primary` (standby.signal, primary_conninfo),
        connecting to it on `port` (a proxy in front of it) if given."""
        _run(
            [
                str(PG_BIN / "pg_basebackup"),
                "-h",
                "127.0.0.1",
                "-p",
                str(port or primary.port),
                "-U",
                "postgres",
                "-D",
                str(self.data),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
            ],
            cwd=self.dir,
        )
        self._configure()
        return self

    def start(self) -> Node:
        _run(
            [
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-w",
                "-t",
                str(START_TIMEOUT_SECONDS),
                "start",
            ],
            cwd=self.dir,
            timeout=START_TIMEOUT_SECONDS + 30,
        )
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; `immediate` is a crash (no checkpoint, no goodbye to clients)."""
        if not (self.data / "postmaster.pid").exists():
            return
        _run(
            [str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"],
            cwd=self.dir,
        )

    def promote(self) -> None:
        _run(
            [str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote"],
            cwd=self.dir,
        )


class Cluster:
    """A primary and its streaming standby; with `proxied_replication`, the standby streams
    through a TcpProxy (`replication`) that a test can blackhole, so commits on the primary
    stop reaching the standby."""

    def __init__(self, base: Path, *, proxied_replication: bool = False) -> None:
        self.base = base
        self.primary = Node(base, "primary")
        self.standby = Node(base, "standby")
        self.replication: TcpProxy | None = None
        self._proxied = proxied_replication
        self._engines: dict[str, sa.Engine] = {}

    def start(self) -> Cluster:
        self.primary.initdb().start()
        port = None
        if self._proxied:
            self.replication = TcpProxy(("127.0.0.1", self.primary.port)).start()
            port = self.replication.port
        self.standby.basebackup_of(self.primary, port=port).start()
        return self

    def multi_host_url(self, database: str) -> str:
        """Both servers, the writable one chosen at each connection (libpq's failover)."""
        return (
            f"postgresql+psycopg://postgres@/{database}?host=127.0.0.1:{self.primary.port}"
            f"&host=127.0.0.1:{self.standby.port}&target_session_attrs=read-write"
        )

    def engine(self, url: str) -> sa.Engine:
        if url not in self._engines:
            self._engines[url] = create_engine(url, pool_size=2)
        return self._engines[url]

    def caught_up(self, database: str = "postgres") -> bool:
        """Whether the standby has replayed everything the primary has written so far."""
        with self.engine(self.primary.url(database)).connect() as conn:
            target = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
        return self.replayed(target, database)

    def replayed(self, lsn: str, database: str = "postgres") -> bool:
        with self.engine(self.standby.url(database)).connect() as conn:
            return bool(
                conn.execute(
                    sa.text("SELECT pg_last_wal_replay_lsn() >= CAST(:lsn AS pg_lsn)"),
                    {"lsn": lsn},
                ).scalar_one()
            )

    def wait_caught_up(self, database: str = "postgres", timeout: float = 60) -> None:
        wait_for(lambda: self.caught_up(database), timeout=timeout, what="the standby to catch up")

    def close(self) -> None:
        for engine in self._engines.values():
            engine.dispose()
        self._engines.clear()
        if self.replication is not None:
            self.replication.close()
        for node in (self.standby, self.primary):
            with suppress(RuntimeError, subprocess.TimeoutExpired):
                node.stop("immediate")


@contextmanager
def cluster(*, proxied_replication: bool = False) -> Iterator[Cluster]:
    """A primary and a standby for the block, in a directory of their own under /tmp."""
    base = Path(tempfile.mkdtemp(prefix="enrichq-cluster-", dir="/tmp"))
    base.chmod(0o755)
    made = Cluster(base, proxied_replication=proxied_replication)
    try:
        yield made.start()
    finally:
        made.close()
        shutil.rmtree(base, ignore_errors=True)
