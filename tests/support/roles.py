"""The shadow role of deploy/sql/roles.sql, applied to a test database."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from enrichq_schema.db import create_engine

ROLES_SQL = Path(__file__).resolve().parents[2] / "deploy" / "sql" / "roles.sql"
TEMPLATE_ROLE = "enrichq_service"


def roles_sql(role: str) -> str:
    """deploy/sql/roles.sql for role `role` instead of enrichq_service."""
    return ROLES_SQL.read_text(encoding="utf-8").replace(TEMPLATE_ROLE, role)


def apply_roles(engine: sa.Engine, role: str) -> None:
    """Run the deploy SQL as the schemas' owner (the external schemas must exist)."""
    with engine.begin() as conn:
        conn.exec_driver_sql(roles_sql(role))


@contextmanager
def service_role(db_url: str) -> Iterator[tuple[str, str]]:
    """(role, login URL): the shadow role applied to `db_url` and a login user in it."""
    suffix = uuid.uuid4().hex[:10]
    role, user = f"enrichq_service_t{suffix}", f"enrichq_app_t{suffix}"
    password = secrets.token_hex(16)
    admin = create_engine(db_url, pool_size=1)
    try:
        apply_roles(admin, role)
        with admin.begin() as conn:
            q = conn.dialect.identifier_preparer.quote
            conn.exec_driver_sql(
                f"CREATE ROLE {q(user)} LOGIN PASSWORD '{password}' IN ROLE {q(role)}"
            )
        url = make_url(db_url).set(username=user, password=password)
        yield role, url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            q = conn.dialect.identifier_preparer.quote
            for name in (user, role):
                exists = conn.execute(
                    sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": name}
                ).first()
                if exists:
                    # Privileges and default privileges in this database go first.
                    conn.exec_driver_sql(f"DROP OWNED BY {q(name)}")
                    conn.exec_driver_sql(f"DROP ROLE {q(name)}")
        admin.dispose()
