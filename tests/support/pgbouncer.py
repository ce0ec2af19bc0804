"""A real PgBouncer (Debian's `pgbouncer` package) in front of a test server, for the
tests and chaos scenarios that run enrichq behind a transaction pooler."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

import pytest
from sqlalchemy.engine import make_url

from enrichq_schema.db import normalize_url
from tests.support.procs import stop, wait_for
from tests.support.web import accepting, free_port

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
NOT_INSTALLED = "pgbouncer is not installed (Debian package pgbouncer; .ci/run installs it)"
START_TIMEOUT_SECONDS = 15.0


def missing() -> str | None:
    """Why PgBouncer cannot run here, or None."""
    if Path(PGBOUNCER).is_file() and os.access(PGBOUNCER, os.X_OK):
        return None
    return NOT_INSTALLED


def require() -> None:
    """Skip the calling test when the pgbouncer package is not installed (CI installs it)."""
    why = missing()
    if why:
        pytest.skip(why)


def _run_as(socket_dir: str | None) -> pwd.struct_passwd | None:
    """Who PgBouncer runs as: it refuses root. Behind a Unix socket, its owner (the socket
    is private to the server's user); else Debian's `postgres` user, or `nobody`."""
    if os.geteuid() != 0:
        return None
    if socket_dir is not None:
        return pwd.getpwuid(Path(socket_dir).stat().st_uid)
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and there is no postgres or nobody user for pgbouncer")


class PgBouncer:
    """One pgbouncer process, `pool_mode` pooling, forwarding every database name to the
    server of `upstream_url` as that URL's user (`auth_type = any`)."""

    def __init__(
        self,
        upstream_url: str,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 8,
        workdir: Path | None = None,
    ) -> None:
        self.upstream = make_url(normalize_url(upstream_url))
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.port = free_port()
        self._own_dir = workdir is None
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="enrichq-pgbouncer-", dir="/tmp"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.dir / "pgbouncer.log"

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of `database` through this pooler."""
        return (
            make_url("postgresql+psycopg://127.0.0.1")
            .set(
                username=self.upstream.username or "postgres",
                port=self.port,
                database=database,
            )
            .render_as_string(hide_password=False)
        )

    def url_of(self, direct_url: str) -> str:
        """The URL of the database that `direct_url` names, through this pooler."""
        database = make_url(direct_url).database
        assert database
        return self.url(database)

    def start(self) -> PgBouncer:
        host = self.upstream.host or str(self.upstream.query.get("host", ""))
        socket_dir = host if host.startswith("/") else None
        port = self.upstream.port or int(str(self.upstream.query.get("port", "5432")))
        user = self.upstream.username or "postgres"
        server = f"host={host or '127.0.0.1'} port={port} user={user}"
        if self.upstream.password:
            server += f" password={self.upstream.password}"
        config = self.dir / "pgbouncer.ini"
        config.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = {server}",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    f"unix_socket_dir = {socket_dir or ''}",
                    "auth_type = any",
                    f"pool_mode = {self.pool_mode}",
                    f"default_pool_size = {self.pool_size}",
                    "max_client_conn = 1000",
                    f"logfile = {self.log}",
                    f"pidfile = {self.dir / 'pgbouncer.pid'}",
                    "admin_users = postgres",
                    "",
                ]
            ),
            encoding="utf-8",
        )
        runner = _run_as(socket_dir)
        uid = gid = None
        if runner is not None:
            uid, gid = runner.pw_uid, runner.pw_gid
            os.chown(self.dir, uid, gid)
            os.chown(config, uid, gid)
        self.proc = subprocess.Popen(
            [PGBOUNCER, "-q", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.dir,
            start_new_session=True,
            user=uid,
            group=gid,
            extra_groups=[] if runner is not None else None,
        )
        proc = self.proc
        # up once it accepts on its port, or done trying once it has exited
        wait_for(
            lambda: proc.poll() is not None or accepting(self.port),
            timeout=START_TIMEOUT_SECONDS,
            what="pgbouncer to accept connections",
        )
        if proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            self.stop()
            raise RuntimeError(f"pgbouncer did not start: {tail}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, timeout=10)
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
