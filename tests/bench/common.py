"""Helpers shared by the benchmarks: scratch databases on the test server, rich tables, stats."""

from __future__ import annotations

import math
import os
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table
from sqlalchemy.engine import make_url

from enrichq_schema.db import create_engine, migrate, normalize_url

SERVER_URL_VARIABLE = "ENRICHQ_TEST_DATABASE_URL"
SERVER_URL_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"

# wide enough for the benchmark tables when the output goes to a file
console = Console(width=None if sys.stdout.isatty() else 160)


def server_url() -> str:
    """The admin URL of the benchmark server (ENRICHQ_TEST_DATABASE_URL or the local default)."""
    configured = os.environ.get(SERVER_URL_VARIABLE) or SERVER_URL_DEFAULT
    return normalize_url(configured).render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """The same URL without the SQLAlchemy driver suffix, for psycopg/asyncpg directly."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def scratch_database(label: str, *, migrated: bool = True) -> Iterator[str]:
    """A new database on the benchmark server (migrated unless told otherwise), dropped after.

    Yields its SQLAlchemy URL (postgresql+psycopg://...).
    """
    admin = server_url()
    safe = "".join(c if c.isalnum() else "_" for c in label.lower())[:24]
    name = f"enrichq_bench_{safe}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    url = make_url(admin).set(database=name).render_as_string(hide_password=False)
    engine = create_engine(admin, isolation_level="AUTOCOMMIT", pool_size=1)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            if migrated:
                migrate(url)
            yield url
        finally:
            with engine.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


def print_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[object]], *, note: str = ""
) -> None:
    """Print one rich table (numbers right-aligned), with an optional note under it."""
    table = Table(title=title, title_justify="left", caption=note or None, caption_justify="left")
    first = rows[0] if rows else []
    for i, header in enumerate(headers):
        numeric = i < len(first) and isinstance(first[i], int | float)
        table.add_column(header, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    console.print(table)


def fmt(value: object) -> str:
    """A cell: thousands separators for counts, two significant decimals for small floats."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
