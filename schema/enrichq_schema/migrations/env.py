"""Alembic environment: migrations are generated from and checked against ``tables.metadata``."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from enrichq_schema.db import create_engine
from enrichq_schema.queries import load
from enrichq_schema.tables import PUBLIC_SCHEMA, SCHEMA, metadata

config = context.config
MIGRATE_SQL = load("enrichq_schema", "sql/migrate.sql")


def _include_name(name: str | None, type_: str, parent_names: object) -> bool:
    # Only our schemas are ours to compare; the help desk, warehouse and legacy are not.
    # (The consumer view in PUBLIC_SCHEMA is a view: autogenerate compares tables only.)
    if type_ == "schema":
        return name in (SCHEMA, PUBLIC_SCHEMA)
    return True


def run_migrations_online() -> None:
    """Run the migrations on the configured database, one transaction per revision."""
    url = config.get_main_option("sqlalchemy.url")
    assert url is not None
    connectable = config.attributes.get("connection") or create_engine(url, pool_size=1)
    if isinstance(connectable, sa.Connection):
        _run(connectable)
        return
    try:
        with connectable.connect() as connection:
            _run(connection)
    finally:
        connectable.dispose()


def _run(connection: sa.Connection) -> None:
    # Two migrators started together (an init container per replica) wait for each other:
    # a session lock, since every revision commits on its own.
    connection.execute(MIGRATE_SQL("migrate_lock"))
    connection.commit()
    try:
        connection.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        connection.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {PUBLIC_SCHEMA}"))
        timeout_ms = config.attributes.get("lock_timeout_ms")
        if timeout_ms is not None:
            # a revision waits this long at most for a table lock, so the writers that
            # queue behind its pending lock wait no longer either (enrichq_schema.db.migrate
            # tries again, then names who holds the lock)
            connection.execute(MIGRATE_SQL("migrate_lock_timeout"), {"timeout_ms": str(timeout_ms)})
        connection.commit()
        context.configure(
            connection=connection,
            target_metadata=metadata,
            version_table_schema=SCHEMA,
            include_schemas=True,
            include_name=_include_name,
            compare_type=True,
            # each revision commits on its own: one that cannot get its lock keeps the
            # revisions before it, and no lock is held across the whole upgrade
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    finally:
        connection.rollback()
        connection.execute(MIGRATE_SQL("migrate_unlock"))
        connection.commit()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported: run `enrichq migrate`")
run_migrations_online()
