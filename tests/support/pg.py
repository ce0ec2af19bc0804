"""Test databases: one migrated template per run, cheap clones of it per test."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from enrichq_schema.db import create_engine, migrate, normalize_url

TEST_URL_VARIABLE = "ENRICHQ_TEST_DATABASE_URL"


@contextmanager
def server_url(tmp_dir: Path) -> Iterator[str]:
    """The server named by ENRICHQ_TEST_DATABASE_URL, else an embedded one in `tmp_dir`."""
    configured = os.environ.get(TEST_URL_VARIABLE)
    if configured:
        yield normalize_url(configured).render_as_string(hide_password=False)
        return
    from enrichq_service.embedded_postgres import EmbeddedPostgres

    if os.geteuid() == 0:
        # As root the server runs as `nobody`, which cannot enter pytest's 0700 temp tree:
        # use a directory of our own under /tmp that it can traverse.
        tmp_dir = Path(tempfile.mkdtemp(prefix="enrichq-test-pg-", dir="/tmp"))
        tmp_dir.chmod(0o711)
    try:
        with EmbeddedPostgres(tmp_dir) as server:
            yield server.url
    finally:
        if os.geteuid() == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)


class Databases:
    """Creates and drops this run's databases on one server; every name carries the run id."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.run_id = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.template = f"enrichq_t_{self.run_id}_tpl"
        self._admin = create_engine(admin_url, isolation_level="AUTOCOMMIT", pool_size=1)
        self._made: list[str] = []
        self._counter = 0

    def url(self, name: str) -> str:
        return make_url(self.admin_url).set(database=name).render_as_string(hide_password=False)

    def _exec(self, sql: str) -> None:
        with self._admin.connect() as conn:
            conn.execute(sa.text(sql))

    def create_template(self) -> None:
        self._exec(f'CREATE DATABASE "{self.template}"')
        self._made.append(self.template)
        migrate(self.url(self.template))

    def create_empty(self, label: str) -> str:
        """A new database with nothing in it (for migration tests); its URL."""
        name = f"enrichq_t_{self.run_id}_{label}"
        self._exec(f'CREATE DATABASE "{name}"')
        self._made.append(name)
        return self.url(name)

    def clone(self, label: str = "db") -> str:
        """A new database copied from the migrated template; its URL."""
        self._counter += 1
        safe = "".join(c if c.isalnum() else "_" for c in label.lower())[:20]
        name = f"enrichq_t_{self.run_id}_{self._counter}_{safe}"
        self._exec(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        self._made.append(name)
        return self.url(name)

    def drop(self, url: str) -> None:
        name = make_url(url).database
        self._exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if name in self._made:
            self._made.remove(name)

    def drop_all(self) -> None:
        for name in reversed(list(self._made)):
            self._exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self._made.clear()
        self._admin.dispose()
