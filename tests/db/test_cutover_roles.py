"""Shadow mode enforced by the database: deploy/sql/roles.sql reads legacy, never writes it.

`service_role(db_url)` is reusable: it applies the deploy SQL under a role name unique to
this test run and yields the URL of a login user in that role (for running the worker
under it), dropping both roles afterwards.
"""

from __future__ import annotations

import psycopg.errors
import pytest
import sqlalchemy as sa
from tests.support.parity_world import create_sources
from tests.support.roles import apply_roles, service_role

from enrichq_schema.db import create_engine


def _insert_legacy(conn: sa.Connection) -> None:
    conn.execute(sa.text("INSERT INTO legacy.ticket_orders VALUES ('T-1', 'O-1', now())"))


def _insert_shadow(conn: sa.Connection) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.ticket_orders (ticket_id, order_id, looked_up_at, queue_id)"
            " VALUES ('T-1', 'O-1', now(), 1)"
        )
    )


@pytest.fixture
def sources(db_engine: sa.Engine) -> sa.Engine:
    with db_engine.begin() as conn:
        create_sources(conn)
        conn.execute(sa.text("INSERT INTO legacy.ticket_orders VALUES ('T-0', 'O-0', now())"))
    return db_engine


def test_set_role_cannot_write_legacy_but_can_write_enrichq(
    sources: sa.Engine, db_url: str
) -> None:
    with service_role(db_url) as (role, _):
        apply_roles(sources, role)  # idempotent: a second run changes nothing and fails not
        with sources.connect() as conn:
            conn.execute(sa.text(f"SET ROLE {role}"))
            with pytest.raises(sa.exc.ProgrammingError) as refused:
                _insert_legacy(conn)
            assert isinstance(refused.value.orig, psycopg.errors.InsufficientPrivilege)
            conn.rollback()
            conn.execute(sa.text(f"SET ROLE {role}"))
            _insert_shadow(conn)
            assert conn.execute(sa.text("SELECT count(*) FROM legacy.ticket_orders")).scalar() == 1
            conn.execute(sa.text("SELECT count(*) FROM helpdesk.tickets")).scalar_one()
            conn.execute(sa.text("SELECT count(*) FROM warehouse.orders")).scalar_one()
            for statement in (
                "UPDATE legacy.ticket_orders SET order_id = 'X'",
                "DELETE FROM legacy.ticket_orders",
                "TRUNCATE legacy.ticket_orders",
                "CREATE TABLE legacy.sneaky (x int)",
            ):
                conn.rollback()
                conn.execute(sa.text(f"SET ROLE {role}"))
                with pytest.raises(sa.exc.ProgrammingError) as denied:
                    conn.execute(sa.text(statement))
                assert isinstance(denied.value.orig, psycopg.errors.InsufficientPrivilege)
            conn.rollback()


def test_a_login_user_in_the_role_is_refused_too(sources: sa.Engine, db_url: str) -> None:
    with service_role(db_url) as (_, url):
        engine = create_engine(url, pool_size=1)
        try:
            with engine.connect() as conn:
                with pytest.raises(sa.exc.ProgrammingError) as refused:
                    _insert_legacy(conn)
                assert isinstance(refused.value.orig, psycopg.errors.InsufficientPrivilege)
                conn.rollback()
                _insert_shadow(conn)
                conn.execute(
                    sa.text(
                        "INSERT INTO enrichq.queue (kind, key, reason, max_attempts)"
                        " VALUES ('enrich', 'T-1', 'manual', 5)"
                    )
                )
                conn.commit()
        finally:
            engine.dispose()
    with sources.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM legacy.ticket_orders")).scalar() == 1
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.queue")).scalar() == 1


def test_the_service_role_cannot_change_what_consumers_read(
    sources: sa.Engine, db_url: str
) -> None:
    """The staged cutover's tenant list sits beside the consumer view, out of the service's
    reach: a shadow deployment cannot move a tenant, whatever its code does."""
    with service_role(db_url) as (role, _), sources.connect() as conn:
        conn.execute(sa.text(f"SET ROLE {role}"))
        for statement in (
            "SELECT count(*) FROM enrichq_public.cutover_tenants",
            "INSERT INTO enrichq_public.cutover_tenants VALUES ('acme', 1)",
        ):
            with pytest.raises(sa.exc.ProgrammingError) as denied:
                conn.execute(sa.text(statement))
            assert isinstance(denied.value.orig, psycopg.errors.InsufficientPrivilege)
            conn.rollback()
            conn.execute(sa.text(f"SET ROLE {role}"))
        conn.rollback()
