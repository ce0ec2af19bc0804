"""Alembic environment: migrations are generated from and checked against ``tables.metadata``."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from enrichq_schema.db import create_engine
from enrichq_schema.tables import PUBLIC_SCHEMA, SCHEMA, metadata

config = context.config


def _include_name(name: str | None, type_: str, parent_names: object) -> bool:
    # Only our schemas are ours to compare; the help desk, warehouse and legacy are not.
    # (The consumer view in PUBLIC_SCHEMA is a view: autogenerate compares tables only.)
    if type_ == "schema":
        return name in (SCHEMA, PUBLIC_SCHEMA)
    return True


def run_migrations_online() -> None:
    """Run migrations in one transaction on the configured database."""
    url = config.get_main_option("sqlalchemy.url")
    assert url is not None
    connectable = config.attributes.get("connection") or create_engine(url, pool_size=1)
    if isinstance(connectable, sa.Connection):
        _run(connectable)
        return
    with connectable.connect() as connection:
        _run(connection)
    connectable.dispose()


def _run(connection: sa.Connection) -> None:
    # Two migrators started together (an init container per replica) wait for each other.
    connection.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
    connection.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {PUBLIC_SCHEMA}"))
    connection.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('enrichq.migrate'))"))
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table_schema=SCHEMA,
        include_schemas=True,
        include_name=_include_name,
        compare_type=True,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported: run `enrichq migrate`")
run_migrations_online()
