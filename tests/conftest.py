"""Fixtures shared by every test folder: real Postgres, isolated per run and per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from enrichq_schema.db import create_engine
from enrichq_schema.settings import Settings
from tests.support.pg import Databases, server_url
from tests.support.pgbouncer import PgBouncer, require
from tests.support.settings import make_settings

FOLDER_MARKERS = {"unit", "db", "concurrent", "e2e", "migrations", "chaos"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by the folder it lives in, so nobody forgets a marker."""
    for item in items:
        parts = Path(str(item.path)).parts
        for folder in FOLDER_MARKERS.intersection(parts):
            item.add_marker(getattr(pytest.mark, folder))


@pytest.fixture(scope="session")
def databases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Databases]:
    """This run's databases on the test server (or an embedded one), dropped at the end."""
    with server_url(tmp_path_factory.mktemp("embedded-pg")) as admin_url:
        dbs = Databases(admin_url)
        dbs.create_template()
        try:
            yield dbs
        finally:
            dbs.drop_all()


@pytest.fixture(scope="session")
def pgbouncer(databases: Databases) -> Iterator[PgBouncer]:
    """A real PgBouncer in transaction pooling in front of the test server, for the run;
    `pgbouncer.url_of(db_url)` is a test database through it."""
    require()
    with PgBouncer(databases.admin_url, pool_mode="transaction") as bouncer:
        yield bouncer


@pytest.fixture(scope="session")
def session_db_url(databases: Databases) -> str:
    """One migrated database for the rollback-per-test fixtures of this run."""
    return databases.clone("session")


@pytest.fixture(scope="session")
def engine(session_db_url: str) -> Iterator[sa.Engine]:
    eng = create_engine(session_db_url, pool_size=2)
    yield eng
    eng.dispose()


@pytest.fixture
def conn(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection inside a transaction that is rolled back after the test."""
    with engine.connect() as connection, connection.begin() as tx:
        yield connection
        tx.rollback()


@pytest.fixture
def db_url(databases: Databases, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database of this test's own, cloned from the migrated template, for tests that commit."""
    url = databases.clone(request.node.name)
    yield url
    databases.drop(url)


@pytest.fixture
def db_engine(db_url: str) -> Iterator[sa.Engine]:
    eng = create_engine(db_url, pool_size=4)
    yield eng
    eng.dispose()


@pytest.fixture
def settings(db_url: str) -> Settings:
    return make_settings(db_url)
