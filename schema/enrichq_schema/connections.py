"""How every enrichq process connects: engine options from the settings, the LISTEN
connection, and the checks a long-running process makes before it starts (preflight)."""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa

from enrichq_schema import db
from enrichq_schema.errors import SettingsError
from enrichq_schema.identifiers import qualified, relation_exists
from enrichq_schema.pooling import WITHOUT_SETTINGS, network_params, transaction_pooled
from enrichq_schema.settings import Settings
from enrichq_schema.states import PoolMode

log = logging.getLogger(__name__)


def engine_options(settings: Settings) -> dict[str, Any]:
    """The `enrichq_schema.db.create_engine` options every engine of a process gets."""
    return {
        "pool_mode": settings.pool_mode,
        "network_timeout_seconds": settings.network_timeout_seconds or None,
    }


def engine_from_settings(settings: Settings, url: str, **options: Any) -> sa.Engine:
    """An engine of the queue database (or of parity's replica) as the settings say."""
    return db.create_engine(url, **engine_options(settings), **options)


def warehouse_engine(settings: Settings, url: str, **options: Any) -> sa.Engine:
    """An engine of the warehouse, of any dialect: a PostgreSQL one as the settings say,
    like every enrichq engine (pool mode, network timeouts); see `db.create_warehouse_engine`."""
    return db.create_warehouse_engine(url, **engine_options(settings), **options)


def listen_url(settings: Settings, url: str) -> str | None:
    """Where LISTEN connects, or None for no LISTEN (polling alone)."""
    if settings.listen_database_url:
        return db.normalize_url(settings.listen_database_url).render_as_string(hide_password=False)
    if settings.pool_mode is PoolMode.TRANSACTION:
        return None
    return url


def listen_connect_params(settings: Settings, url: str) -> dict[str, Any]:
    """psycopg.connect() keyword arguments for the LISTEN connection of `url` (a multi-host
    URL included), with the network timeouts."""
    engine = sa.create_engine(db.normalize_url(url))
    try:
        cargs, cparams = engine.dialect.create_connect_args(engine.url)
    finally:
        engine.dispose()
    assert not cargs  # the psycopg dialect passes everything by keyword
    params: dict[str, Any] = {k: v for k, v in cparams.items() if k != "context"}
    if settings.network_timeout_seconds:
        for name, value in network_params(settings.network_timeout_seconds).items():
            params.setdefault(name, value)
    params.setdefault("connect_timeout", 5)
    params.setdefault("application_name", "enrichq-listen")
    return params


def preflight(settings: Settings, url: str, *, mirror: bool = False) -> None:
    """Refuse to start a long-running process on a pool mode its connections contradict.

    SettingsError (exit 2) when session mode meets a transaction pooler, or when the
    LISTEN URL is one; the database's own error (exit 1) when it cannot be reached (or
    refuses the connection: a pooler refusing a startup parameter, a wrong password).
    Transaction mode without a pooler is allowed: it only costs a round trip per
    transaction. With `mirror` (a process that reads the help desk's mirror: the worker,
    serve's worker, the sweeper's refresh and reconcile), a SettingsError too when
    ENRICHQ_TICKETS_TABLE names no table: found before anything starts, not at the first
    lookup or pass.
    """
    # connecting at all is the first check: a refused connection ends the process here;
    # then the pool mode, the LISTEN URL, and last the mirror (a pooler's mismatch is the
    # deeper fault: with it, the mirror's answer would come through the wrong pooler)
    evidence, problem = _probe(settings, url, mirror=mirror)
    if settings.pool_mode is PoolMode.SESSION and evidence is not None:
        raise SettingsError(
            "ENRICHQ_POOL_MODE is session, but ENRICHQ_DATABASE_URL leads to a "
            f"transaction pooler ({evidence}): set ENRICHQ_POOL_MODE=transaction"
        )
    listen = settings.listen_database_url
    if listen:
        listen_evidence, _ = _probe(settings, listen)
        if listen_evidence is not None:
            raise SettingsError(
                "ENRICHQ_LISTEN_DATABASE_URL leads to a transaction pooler "
                f"({listen_evidence}): LISTEN needs a direct connection to the database"
            )
    if problem is not None:
        raise SettingsError(problem)


def mirror_problem(conn: sa.Connection, settings: Settings) -> str | None:
    """One line when the help desk's mirror (ENRICHQ_TICKETS_TABLE) is not a table this
    connection sees, or None."""
    if relation_exists(conn, qualified(conn.dialect, settings.tickets_table)):
        return None
    return (
        f"ENRICHQ_TICKETS_TABLE: table {settings.tickets_table} does not exist in the "
        "database (the help desk's mirror of tickets: check its name, or create it first)"
    )


def _probe(settings: Settings, url: str, *, mirror: bool = False) -> tuple[str | None, str | None]:
    """(evidence of a transaction pooler, the mirror's problem) of `url`, or Nones."""
    engine = db.create_engine(
        url,
        application_name="enrichq-preflight",
        pool_size=2,
        isolation_level="AUTOCOMMIT",
        pool_mode=PoolMode.TRANSACTION,
        network_timeout_seconds=settings.network_timeout_seconds or None,
        # in autocommit nothing is set on the server; this bounds the replies' wait
        statement_timeout_seconds=settings.statement_timeout_seconds,
    ).execution_options(**{WITHOUT_SETTINGS: True})
    try:
        evidence = transaction_pooled(engine)
        if not mirror:
            return evidence, None
        with engine.connect() as conn:
            return evidence, mirror_problem(conn, settings)
    finally:
        engine.dispose()
