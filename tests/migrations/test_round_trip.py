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
        # sqlalchemy-bigquery's global `unnest` (loaded by other tests in this process)
        # only costs PostgreSQL's reflection its cache; see pyproject's filterwarnings
        warnings.filterwarnings(
            "ignore", "Class unnest will not make use of SQL compilation", sa.exc.SAWarning
        )
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


def test_downgrading_below_the_review_refuses_while_a_cutover_is_staged(
    databases: Databases,
) -> None:
    """The staged view reads enrichq_public.cutover_tenants: dropping it would drop the view
    consumers read, so the downgrade stops and says what to do first."""
    empty_db = databases.create_empty("staged")
    cfg = alembic_config(empty_db)
    command.upgrade(cfg, "head")  # type: ignore[arg-type]
    engine = create_engine(empty_db)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE SCHEMA helpdesk; CREATE TABLE helpdesk.tickets (id text PRIMARY KEY,"
                " tenant text); CREATE SCHEMA legacy; CREATE TABLE legacy.ticket_orders"
                " (ticket_id text, order_id text, looked_up_at timestamptz);"
                " CREATE VIEW enrichq_public.ticket_orders AS SELECT l.ticket_id, l.order_id,"
                " l.looked_up_at FROM legacy.ticket_orders AS l WHERE NOT EXISTS (SELECT 1"
                " FROM helpdesk.tickets AS t JOIN enrichq_public.cutover_tenants AS c"
                " ON c.tenant = t.tenant WHERE t.id = l.ticket_id)"
            )
        with pytest.raises(RuntimeError, match=r"run `enrichq cutover --rollback` before"):
            command.downgrade(cfg, "0002")  # type: ignore[arg-type]
        with engine.connect() as conn:
            # one transaction per revision: the revisions above the refusing one are undone,
            # it and the consumers' view are kept
            assert current_revision(conn) == "0005"
            assert (
                conn.execute(sa.text("SELECT count(*) FROM enrichq_public.ticket_orders")).scalar()
                == 0
            )
    finally:
        engine.dispose()


def test_downgrading_below_the_pauses_refuses_while_claims_are_paused(
    databases: Databases,
) -> None:
    """The older schema cannot keep a pause: dropping it would let every claim through
    again, unannounced, so the downgrade stops and says what to do first."""
    url = databases.create_empty("paused")
    cfg = alembic_config(url)
    command.upgrade(cfg, "head")  # type: ignore[arg-type]
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO enrichq.pauses (kind, tenant, reason, paused_by)"
                " VALUES ('enrich', 'acme', 'warehouse migration', 'ops')"
            )
        with pytest.raises(RuntimeError, match=r"enrichq resume"):
            command.downgrade(cfg, "0006")  # type: ignore[arg-type]
        with engine.connect() as conn:
            assert current_revision(conn) == "0007"
            paused = conn.exec_driver_sql("SELECT kind, tenant FROM enrichq.pauses").all()
            assert [tuple(r) for r in paused] == [("enrich", "acme")]
    finally:
        engine.dispose()
