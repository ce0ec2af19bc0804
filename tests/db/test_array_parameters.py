"""The batch statements' list parameters reach the server as they were, in the binary format.

Every batch statement (claim, settle, the result writes, the lookup log) passes its rows as
arrays. enrichq's engines send lists in PostgreSQL's binary format, 4-15x cheaper to build
in Python than array literals (`enrichq_schema.db._binary_lists`); these tests hold that
nothing a statement reads changes with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from psycopg.adapt import PyFormat
from psycopg.types.array import ListBinaryDumper

from enrichq_schema.db import create_engine

AWARE = datetime(2026, 12, 6, 4, 30, 15, 123456, tzinfo=UTC)
CASES: list[tuple[str, list[object], list[object]]] = [
    (
        "text[]",
        ["T-1", None, "Ünïcødé ✓", "", 'a,b{c}"d\\'],
        ["T-1", None, "Ünïcødé ✓", "", 'a,b{c}"d\\'],
    ),
    ("bigint[]", [1, None, 2**31, 2**63 - 1, -(2**63)], [1, None, 2**31, 2**63 - 1, -(2**63)]),
    (
        "numeric[]",
        [Decimal("12.30"), None, Decimal("-0.001"), Decimal(7)],
        [Decimal("12.30"), None, Decimal("-0.001"), Decimal(7)],
    ),
    ("timestamptz[]", [AWARE, None], [AWARE, None]),
    # a time without an offset is read in the session's TimeZone, which is UTC
    ("timestamptz[]", [AWARE.replace(tzinfo=None)], [AWARE]),
    ("timestamptz[]", [AWARE.astimezone(ZoneInfo("Asia/Kolkata"))], [AWARE]),
    ("int[]", [], []),
    ("text[]", [None, None], [None, None]),
    ("interval[]", [timedelta(seconds=90)], [timedelta(seconds=90)]),
]


@pytest.fixture
def lists(db_url: str) -> Iterator[sa.Engine]:
    """An engine as enrichq's processes make them."""
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


@pytest.mark.parametrize(("sql_type", "sent", "read"), CASES)
def test_a_list_reaches_the_server_as_it_was(
    lists: sa.Engine, sql_type: str, sent: list[object], read: list[object]
) -> None:
    with lists.connect() as conn:
        got = conn.execute(sa.text(f"SELECT CAST(:v AS {sql_type})"), {"v": sent}).scalar_one()
    assert got == read


def test_lists_go_in_the_binary_format(lists: sa.Engine) -> None:
    with lists.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        dumper = raw.adapters.get_dumper(list, PyFormat.AUTO)
    assert dumper is ListBinaryDumper


@pytest.mark.parametrize(
    ("sql_type", "sent"),
    [("text[]", ["ok", "nul\x00byte"]), ("bigint[]", [1, 2**64]), ("int[]", [2**31])],
)
def test_a_value_the_server_refuses_is_still_a_data_error(
    lists: sa.Engine, sql_type: str, sent: list[object]
) -> None:
    with lists.connect() as conn, pytest.raises(sa.exc.DataError):
        conn.execute(sa.text(f"SELECT CAST(:v AS {sql_type})"), {"v": sent})
