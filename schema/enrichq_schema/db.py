"""Database access shared by every process: URLs, engines, migrations."""

from __future__ import annotations

import dataclasses
import logging
import operator
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.engine import URL, ExecutionContext, make_url
from sqlalchemy.engine.default import DefaultDialect

from enrichq_schema.pooling import PoolMode, install, network_params
from enrichq_schema.queries import PREPARED_OPTION

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R", bound="DataclassInstance")
RACE_RERUNS = 5
# psycopg's prepare_threshold: never prepare by itself, yet honour execute(prepare=True)
NEVER_AUTO_PREPARE = 2**31 - 1
# How often the server looks, while a statement runs, whether its client is still there
# (client_connection_check_interval, PostgreSQL 14+). Without it a statement whose process
# was killed runs on to its end: a killed worker's warehouse query beside the lookup that
# took its slot under ENRICHQ_WAREHOUSE_MAX_CONCURRENCY, a killed operator's `cancel` page
# to its commit. Well under the shortest lease, so the query is gone before the slot. A
# safeguard, not a requirement: where the server refuses it (PostgreSQL 14+ on a platform
# without POLLRDHUP: macOS, the BSDs, Windows) sessions go on without it, with a warning.
CLIENT_CHECK_INTERVAL_MS = 500

# `enrichq migrate`: how long a revision may wait for a table lock, how many times it is
# tried, and the pause between tries (in which the writers queued behind it get through).
MIGRATE_LOCK_TIMEOUT_SECONDS = 2.0
MIGRATE_LOCK_TRIES = 3
MIGRATE_RETRY_PAUSE_SECONDS = 1.0
# SQLSTATE of a lock wait that ran out (lock_not_available).
LOCK_NOT_AVAILABLE = "55P03"

MIGRATIONS = Path(__file__).parent / "migrations"


def normalize_url(url: str | URL) -> URL:
    """Use psycopg 3 for every ``postgresql://`` URL, whatever driver it names or omits."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() != "psycopg":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def redact(url: str | URL) -> str:
    """The URL with its password and secret options hidden, for logs and messages."""
    from enrichq_schema.secrets import redacted_url

    return redacted_url(url)


def create_engine(
    url: str | URL,
    *,
    application_name: str = "enrichq",
    pool_size: int = 5,
    statement_timeout_seconds: float | None = None,
    idle_in_transaction_timeout_seconds: float | None = None,
    isolation_level: str | None = None,
    pre_ping: bool = True,
    generic_plans: bool = False,
    asynchronous_commit: bool = False,
    pool_mode: PoolMode = PoolMode.SESSION,
    network_timeout_seconds: float | None = None,
) -> sa.Engine:
    """An engine whose pool checks connections before use, so a restarted server is survived.

    `idle_in_transaction_timeout_seconds` makes the server end a session whose transaction
    sits idle that long: a frozen process must not hold row locks that others wait on.
    `pre_ping=False` skips that check (a round trip per checkout) for callers that retry a
    failed transaction anyway; the first use after a restart then fails once and the pool
    reconnects. `generic_plans=True` makes the prepared statements of this engine's
    sessions keep one generic plan instead of planning again with each call's values; give
    it only to an engine that runs statements whose generic plans are tested.
    `asynchronous_commit=True` returns from COMMIT before its WAL reaches the disk
    (`synchronous_commit=off`): a server crash may then undo the last fraction of a second
    of this engine's commits. Only for work whose loss is harmless.

    `pool_mode` says how the settings reach the server (`enrichq_schema.pooling`): once per
    connection, or in every transaction behind a transaction pooler, where nothing is
    prepared server-side either (`generic_plans` then has nothing to act on).
    `network_timeout_seconds` turns on TCP keepalives, `tcp_user_timeout` and
    `connect_timeout` (options the URL sets itself win) and bounds every wait for a reply
    by the statement timeout plus this: a statement may run that long, its reply may take
    this long on top. Without a statement timeout only the TCP-level options apply.
    """
    parsed = normalize_url(url)
    postgres = parsed.get_backend_name() == "postgresql"
    transaction = pool_mode is PoolMode.TRANSACTION
    # Every session reads and writes times in UTC, whatever the server's or the database's
    # TimeZone: a time enrichq shows as UTC is UTC, and a date cut from a timestamptz is a
    # UTC day.
    settings: dict[str, str] = {
        "TimeZone": "UTC",
        "client_connection_check_interval": str(CLIENT_CHECK_INTERVAL_MS),
    }
    if statement_timeout_seconds is not None:
        settings["statement_timeout"] = str(int(statement_timeout_seconds * 1000))
    if idle_in_transaction_timeout_seconds is not None:
        ms = int(idle_in_transaction_timeout_seconds * 1000)
        settings["idle_in_transaction_session_timeout"] = str(ms)
    if generic_plans and not transaction:
        settings["plan_cache_mode"] = "force_generic_plan"
    if asynchronous_commit:
        settings["synchronous_commit"] = "off"
    # Server-side prepared statements only where a statement's header asks for them (the
    # claim loop's hot statements): psycopg would otherwise prepare any statement run five
    # times, and Postgres would then switch it to a generic plan, which for some batch
    # statements (array parameters, the optional :now) was 5-20x slower than a plan made
    # with the real values. A threshold nobody reaches keeps `prepare=True` working, which
    # None would not; behind a transaction pooler None is what we want: nothing prepared.
    connect_args: dict[str, object] = {
        "application_name": application_name,
        "prepare_threshold": None if transaction else NEVER_AUTO_PREPARE,
    }
    reply_timeout: float | None = None
    if network_timeout_seconds and postgres:
        for name, value in network_params(network_timeout_seconds).items():
            if name not in parsed.query:
                connect_args[name] = value
        if statement_timeout_seconds is not None:
            reply_timeout = statement_timeout_seconds + network_timeout_seconds
    kwargs: dict[str, Any] = {}
    if isolation_level is not None:
        kwargs["isolation_level"] = isolation_level
    engine = sa.create_engine(
        parsed,
        pool_pre_ping=pre_ping,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_recycle=1800,
        connect_args=connect_args,
        **kwargs,
    )
    if postgres:
        install(
            engine,
            pool_mode,
            settings,
            reply_timeout_seconds=reply_timeout,
            optional=frozenset({"client_connection_check_interval"}),
        )
    if postgres:
        sa.event.listen(engine, "connect", _binary_lists)
    if not transaction:
        sa.event.listen(engine, "do_execute", _execute_prepared, retval=True)
    return engine


def _binary_lists(dbapi_connection: Any, record: Any) -> None:
    """Send list parameters (the batch statements' arrays) in PostgreSQL's binary format.

    psycopg's text format builds an array literal in Python, quoting each element: 1 µs a
    text and 3 µs a timestamp, where the binary format takes 0.2 µs. A settle group of 400
    jobs passes a few thousand elements, and the worker's Python time, not the database,
    is what bounds its throughput (tests/bench/bench_e2e.py). The values reach the server
    unchanged: a time without an offset is still read in the session's TimeZone (UTC), a
    NULL element stays NULL, a value the server refuses still fails as a DataError.
    """
    from psycopg.types.array import ListBinaryDumper

    dbapi_connection.adapters.register_dumper(list, ListBinaryDumper)


# warehouses whose every statement is a billed job: no pre-ping before each checkout
NO_PING_BACKENDS = frozenset({"bigquery"})


def create_warehouse_engine(
    url: str | URL,
    *,
    application_name: str = "enrichq-warehouse",
    pool_size: int = 5,
    **postgres_options: Any,
) -> sa.Engine:
    """An engine for the warehouse, of any SQLAlchemy dialect.

    A PostgreSQL warehouse gets what `create_engine` gives every enrichq engine, with
    `postgres_options` (the pool mode's and the network timeouts', say). Any other
    dialect (DuckDB through duckdb-engine, BigQuery through sqlalchemy-bigquery) gets its
    driver's own connection arguments, a checked pool of `pool_size` (where the dialect
    pools at all) and nothing PostgreSQL-specific: its URL's query carries its options
    (`duckdb:///w.duckdb?access_mode=read_only`).
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        return create_engine(
            parsed, application_name=application_name, pool_size=pool_size, **postgres_options
        )
    dialect = cast("type[DefaultDialect]", parsed.get_dialect())
    # no ping where a ping is a billed, quota-counted query job (BigQuery): its "connection"
    # is an HTTP client, which a failed request does not break
    kwargs: dict[str, Any] = {"pool_pre_ping": parsed.get_backend_name() not in NO_PING_BACKENDS}
    if parsed.get_backend_name() == "bigquery":
        # enrichq reads a lookup's few rows through the query job itself
        # (enrichq_service.bigquery), never through the Storage Read API
        kwargs["connect_args"] = {"prefer_bqstorage_client": False}
    if issubclass(dialect.get_pool_class(parsed), sa.pool.QueuePool):
        kwargs.update(pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800)
    return sa.create_engine(parsed, **kwargs)


def _execute_prepared(
    cursor: Any, statement: str, parameters: Any, context: ExecutionContext
) -> bool:
    """Run a statement marked `prepared` as a server-side prepared statement (psycopg
    prepares it on the connection's first use and reuses it); leave the rest to SQLAlchemy.
    Errors still pass through SQLAlchemy's handling (disconnects invalidate the pool)."""
    if not context.execution_options.get(PREPARED_OPTION):
        return False
    cursor.execute(statement, parameters, prepare=True)
    return True


def ensure_database(admin_url: str, name: str) -> str:
    """Create database `name` on the server of `admin_url` unless it exists; its URL."""
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT", pool_size=1)
    try:
        with engine.connect() as conn:
            exists = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            ).scalar()
            if not exists:
                ident = conn.dialect.identifier_preparer.quote(name)
                conn.execute(sa.text(f"CREATE DATABASE {ident}"))
    finally:
        engine.dispose()
    return normalize_url(admin_url).set(database=name).render_as_string(hide_password=False)


def alembic_config(url: str) -> object:
    """An Alembic config for our migrations against `url` (no alembic.ini needed)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    # Alembic interpolates '%' in options; escape it so passwords with '%' survive.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(
    url: str,
    revision: str = "head",
    *,
    lock_timeout_seconds: float = MIGRATE_LOCK_TIMEOUT_SECONDS,
    tries: int = MIGRATE_LOCK_TRIES,
) -> None:
    """Upgrade the database to `revision`, one transaction per revision; a no-op when it
    is already there.

    A revision waits at most `lock_timeout_seconds` for a table lock: while it waits,
    every claim, heartbeat and settle that needs the table queues behind its pending lock.
    It is tried `tries` times (the revisions already committed stay), then MigrationLocked
    names the session holding the lock.
    """
    import sqlalchemy.exc as sa_exc
    from alembic import command

    from enrichq_schema.errors import MigrationLocked

    config = alembic_config(url)
    config.attributes["lock_timeout_ms"] = max(1, int(lock_timeout_seconds * 1000))  # type: ignore[attr-defined]  # alembic's Config, typed object here
    for attempt in range(1, tries + 1):
        try:
            command.upgrade(config, revision)  # type: ignore[arg-type]  # alembic's stubs want its own Config subclass
            return
        except sa_exc.OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                raise
            holder = _lock_holder(url)
            log.info(
                "migrate: try %d of %d waited %g s for a lock (%s)",
                attempt,
                tries,
                lock_timeout_seconds,
                holder,
            )
            if attempt == tries:
                raise MigrationLocked(
                    f"gave up after {tries} waits of {lock_timeout_seconds:g} s for a table "
                    f"lock held by {holder}; the schema is at revision "
                    f"{_revision_of(url) or 'none'} (end that session, or run migrate again)"
                ) from None
            time.sleep(MIGRATE_RETRY_PAUSE_SECONDS)


def _lock_holder(url: str) -> str:
    """Who holds a lock on enrichq's tables, oldest transaction first, in a phrase."""
    from enrichq_schema.queries import load

    engine = create_engine(url, application_name="enrichq-migrate", pool_size=1)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                load("enrichq_schema", "sql/migrate.sql")("migrate_lock_holders"), {"limit": 1}
            ).first()
    finally:
        engine.dispose()
    if row is None:
        return "a session that has ended since"
    started = row.query_start.isoformat(timespec="seconds") if row.query_start else "unknown"
    return (
        f"pid {row.pid} (application_name {row.application_name!r}, {row.mode} on "
        f"{row.relation}, query started {started}, {row.state})"
    )


def _revision_of(url: str) -> str | None:
    engine = create_engine(url, application_name="enrichq-migrate", pool_size=1)
    try:
        with engine.connect() as conn:
            return current_revision(conn)
    finally:
        engine.dispose()


def current_revision(conn: sa.Connection) -> str | None:
    """The revision the database is at, or None before the first migration."""
    from alembic.runtime.migration import MigrationContext

    from enrichq_schema.tables import SCHEMA

    context = MigrationContext.configure(conn, opts={"version_table_schema": SCHEMA})
    return context.get_current_revision()


def head_revision() -> str | None:
    """The newest revision that ships with this version of enrichq."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS)).get_current_head()


SCHEMA_WAIT_LOG_SECONDS = 5.0
"""While a process waits for `enrichq migrate`, it says so this often."""


def schema_problem(engine: sa.Engine) -> str | None:
    """Why this database cannot be worked on by this enrichq, or None when it is at head."""
    with engine.connect() as conn:
        current = current_revision(conn)
    head = head_revision()
    if current == head:
        return None
    if current is not None and not _known_revision(current):
        return (
            f"the database is at revision {current}, newer than this enrichq's {head}: run the "
            "enrichq release that migrated it"
        )
    return f"the database is at revision {current or 'none'}, not {head} (run `enrichq migrate`)"


def _known_revision(revision: str) -> bool:
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        return ScriptDirectory(str(MIGRATIONS)).get_revision(revision) is not None
    except CommandError:
        return False


def await_schema(
    engine: sa.Engine,
    *,
    wait: bool,
    stop: threading.Event,
    what: str,
    poll_seconds: float = 1.0,
) -> bool:
    """Return True once the database is at head. Not there: with `wait`, say so in one log
    line every SCHEMA_WAIT_LOG_SECONDS and look again until it is (False if `stop` is set
    first); without, SettingsError (exit 2). A database newer than this enrichq never
    becomes right by waiting: SettingsError either way."""
    from enrichq_schema.errors import SettingsError

    said_at = -SCHEMA_WAIT_LOG_SECONDS
    while True:
        problem = schema_problem(engine)
        if problem is None:
            return True
        if not wait or "newer than" in problem:
            raise SettingsError(f"{what}: {problem}")
        now = time.monotonic()
        if now - said_at >= SCHEMA_WAIT_LOG_SECONDS:
            log.info("%s waits for the schema: %s", what, problem)
            said_at = now
        if stop.wait(poll_seconds):
            return False


def rerun_lost_races(conn: sa.Connection, statement: Callable[[], T]) -> T:
    """Run `statement` in a savepoint; run it again when it lost the queued-key race.

    A statement that puts a row back in the queue (a retry, a defer, a promotion, a
    redrive) sees the key's queued row when that row was committed before the statement's
    snapshot; one committed after shows up as a violation of the queued-key index instead.
    A new statement has a snapshot that sees it, and supersedes instead.
    """
    import sqlalchemy.exc as sa_exc

    from enrichq_schema.errors import constraint_name
    from enrichq_schema.tables import QUEUED_KEY_INDEX

    for attempt in range(RACE_RERUNS):
        try:
            with conn.begin_nested():
                return statement()
        except sa_exc.IntegrityError as exc:
            if constraint_name(exc) != QUEUED_KEY_INDEX or attempt == RACE_RERUNS - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


@cache
def _columns_of(
    cls: type[DataclassInstance], columns: tuple[str, ...]
) -> tuple[tuple[str, ...], Callable[[sa.Row[Any]], tuple[Any, ...]]]:
    """The fields of `cls` that a row of `columns` holds, and what reads them from one."""
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init and f.name in columns)
    at = [columns.index(name) for name in names]
    # by position: on the claim's hot path, faster than the row's attributes or mapping
    if len(at) > 1:
        return names, operator.itemgetter(*at)
    return names, lambda row: tuple(row[i] for i in at)


def as_record(cls: type[R], row: sa.Row[Any], **values: Any) -> R:
    """The frozen record `cls` made from `row`: each field from the column of its name, or
    from `values` (what the caller computed; it wins over a column of the same name).

    A field found in neither keeps its default (and one without a default is a TypeError
    naming it); columns that are not fields are left out.
    """
    names, read = _columns_of(cls, row._fields)
    found = dict(zip(names, read(row), strict=True))
    return cls(**(found | values if values else found))


def as_records(cls: type[R], rows: sa.Result[Any]) -> list[R]:
    """`as_record` of every row of `rows`, their columns matched to `cls` once."""
    names, read = _columns_of(cls, tuple(rows.keys()))
    return [cls(**dict(zip(names, read(row), strict=True))) for row in rows]
