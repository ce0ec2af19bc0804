"""A MODEL of BigQuery's cost and latency, laid over a real warehouse engine (PostgreSQL or
DuckDB): for benchmarks and tests. It is not BigQuery and claims nothing about it beyond
the three rules below.

`attach(engine, tables, latency_seconds=...)` makes every query on `engine` that reads one
of `tables`:

- wait `latency_seconds` before it runs (a BigQuery query job takes 0.5-2 s however small);
- bill, as BigQuery does for tables that are not partitioned or clustered, every row of
  every column the query references in each table it reads, by BigQuery's logical sizes
  (STRING 2 + UTF-8 bytes, INT64 / FLOAT64 / TIMESTAMP 8, NUMERIC 16, BOOL 1, NULL 0),
  and at least 10 MB a query;
- leave the job (`job_id`, `total_bytes_billed`) on its DB-API cursor as `query_job`,
  where BigQuery's DB-API cursor keeps it, so the built-in lookup reads it as it would
  from BigQuery.

Which columns of which tables a query references is read from its text by sqlglot's
parser and qualifier (star expansion included), never guessed from the query's name.
Statements that read none of `tables` (a `set_config`, the dialect's own start-up
queries) run as they are: no wait, no bill, no job.
"""

from __future__ import annotations

import functools
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import psycopg
import sqlalchemy as sa

MIN_BYTES_BILLED = 10 * 1024 * 1024  # BigQuery bills at least 10 MB a query
LATENCY_SECONDS_DEFAULT = 0.8
# bound parameters as each driver writes them, replaced by NULL before parsing
PLACEHOLDER = re.compile(r"%\(\w+\)s|\$\d+|\?")


@dataclass(frozen=True, slots=True)
class QueryJob:
    """What the model says one query cost (the attributes BigQuery's QueryJob has)."""

    job_id: str
    total_bytes_billed: int
    tables: tuple[str, ...]


class JobCursor(psycopg.Cursor[Any]):
    """psycopg's cursor with room for a `query_job` (its own class has no __dict__)."""


def logical_bytes(value: object) -> int:
    """BigQuery's logical size of one value."""
    if value is None:
        return 0
    if isinstance(value, str):
        return 2 + len(value.encode())
    if isinstance(value, bytes):
        return 2 + len(value)
    if isinstance(value, bool):
        return 1
    if isinstance(value, Decimal):
        return 16
    if isinstance(value, int | float | datetime | date):
        return 8
    return 2 + len(str(value).encode())


@dataclass
class CostModel:
    """The model attached to one engine: column sizes, and every job it billed."""

    tables: dict[str, dict[str, int]]  # "schema.table" -> column -> bytes of the column
    latency_seconds: float
    dialect: str
    jobs: list[QueryJob] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def bytes_billed(self) -> int:
        with self._lock:
            return sum(j.total_bytes_billed for j in self.jobs)

    @property
    def queries(self) -> int:
        with self._lock:
            return len(self.jobs)

    def scanned(self, statement: str) -> dict[str, frozenset[str]]:
        """The columns `statement` references in each modelled table it reads."""
        return _scanned(statement, self.dialect, _frozen_schema(self.tables))

    def bill(self, statement: str) -> QueryJob | None:
        """The job of one query (None: it reads no modelled table)."""
        scanned = self.scanned(statement)
        if not scanned:
            return None
        scanned_bytes = sum(
            self.tables[table][column] for table, columns in scanned.items() for column in columns
        )
        job = QueryJob(
            f"model-{uuid.uuid4().hex[:16]}",
            max(MIN_BYTES_BILLED, scanned_bytes),
            tuple(sorted(scanned)),
        )
        with self._lock:
            self.jobs.append(job)
        return job


def _frozen_schema(tables: dict[str, dict[str, int]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((name, tuple(columns)) for name, columns in sorted(tables.items()))


@functools.lru_cache(maxsize=512)
def _scanned(
    statement: str, dialect: str, schema: tuple[tuple[str, tuple[str, ...]], ...]
) -> dict[str, frozenset[str]]:
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError
    from sqlglot.optimizer.qualify import qualify

    nested: dict[str, object] = {}
    for name, columns in schema:
        db, table_name = name.split(".")
        tables = nested.setdefault(db, {})
        assert isinstance(tables, dict)
        tables[table_name] = dict.fromkeys(columns, "text")
    try:
        tree = sqlglot.parse_one(PLACEHOLDER.sub("NULL", statement), read=dialect)
        tree = qualify(tree, schema=nested, dialect=dialect, validate_qualify_columns=False)
    except SqlglotError:
        return {}
    modelled = {name for name, _ in schema}
    aliases = {
        t.alias_or_name: f"{t.db}.{t.name}"
        for t in tree.find_all(exp.Table)
        if f"{t.db}.{t.name}" in modelled
    }
    out: dict[str, set[str]] = {}
    for column in tree.find_all(exp.Column):
        read = aliases.get(column.table)
        if read is not None:
            out.setdefault(read, set()).add(column.name)
    for read in aliases.values():
        out.setdefault(read, set())  # read, with no column named (count(*)): still billed
    return {t: frozenset(c) for t, c in out.items()}


def column_sizes(engine: sa.Engine, tables: Sequence[str]) -> dict[str, dict[str, int]]:
    """Each column's logical bytes, summed over the rows of each table (read once)."""
    sizes: dict[str, dict[str, int]] = {}
    with engine.connect() as conn:
        for name in tables:
            quoted = ".".join(conn.dialect.identifier_preparer.quote(p) for p in name.split("."))
            result = conn.execute(sa.text(f"SELECT * FROM {quoted}"))
            columns = list(result.keys())
            totals = dict.fromkeys(columns, 0)
            for row in result:
                for column, value in zip(columns, row, strict=True):
                    totals[column] += logical_bytes(value)
            sizes[name] = totals
    return sizes


def attach(
    engine: sa.Engine,
    tables: Sequence[str] = ("warehouse.customers", "warehouse.orders"),
    *,
    latency_seconds: float = LATENCY_SECONDS_DEFAULT,
) -> CostModel:
    """Lay the model over `engine` (before it has handed out a connection); the model."""
    dialect = "postgres" if engine.dialect.name == "postgresql" else engine.dialect.name
    model = CostModel(column_sizes(engine, tables), latency_seconds, dialect)
    engine.pool.dispose()  # connections made before the model have no room for a job
    if engine.dialect.name == "postgresql":

        @sa.event.listens_for(engine, "connect")
        def _room_for_a_job(dbapi_connection: Any, record: Any) -> None:
            dbapi_connection.cursor_factory = JobCursor

    @sa.event.listens_for(engine, "before_cursor_execute")
    def _wait(conn: sa.Connection, cursor: Any, statement: str, *rest: Any) -> None:
        if model.latency_seconds > 0 and model.scanned(statement):
            time.sleep(model.latency_seconds)

    @sa.event.listens_for(engine, "after_cursor_execute")
    def _bill(conn: sa.Connection, cursor: Any, statement: str, *rest: Any) -> None:
        job = model.bill(statement)
        if job is not None:
            cursor.query_job = job

    return model
