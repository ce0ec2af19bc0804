"""Migrations match the declared schema and round-trip: head → check → base → head."""

from __future__ import annotations

import warnings

import pytest
import sqlalchemy as sa
from alembic import command
from tests.support.pg import Databases

from enrichq_schema.db import alembic_config, create_engine, current_revision, head_revision


@pytest.fixture
def empty_db(databases: Databases) -> str:
    return databases.create_empty("empty")


def test_upgrade_check_downgrade_upgrade(empty_db: str) -> None:
    cfg = alembic_config(empty_db)
    command.upgrade(cfg, "head")  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        command.check(cfg)  # type: ignore[arg-type]
    command.downgrade(cfg, "base")  # type: ignore[arg-type]
    engine = create_engine(empty_db)
    with engine.connect() as conn:
        tables = conn.execute(
            sa.text("SELECT count(*) FROM pg_tables WHERE schemaname = 'enrichq'")
        ).scalar()
        assert tables == 1  # only alembic_version is left
    command.upgrade(cfg, "head")  # type: ignore[arg-type]
    command.upgrade(cfg, "head")  # type: ignore[arg-type]  # twice is a no-op
    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()
    engine.dispose()
