"""Rows become frozen records through one helper (enrichq_schema.db.as_record, and
as_records for a whole result)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import sqlalchemy as sa

from enrichq_schema.db import as_record, as_records


@dataclass(frozen=True, slots=True)
class Claimed:
    id: int
    key: str
    state: str = "leased"
    note: str | None = None


def one(conn: sa.Connection, sql: str) -> sa.Row[object]:
    return conn.execute(sa.text(sql)).one()


def test_each_field_comes_from_the_column_of_its_name_whatever_the_order(
    conn: sa.Connection,
) -> None:
    row = one(conn, "SELECT 'T-1' AS key, 'extra' AS other, 7 AS id, 'queued' AS state")
    assert as_record(Claimed, row) == Claimed(id=7, key="T-1", state="queued")


def test_a_field_the_statement_does_not_return_keeps_its_default(conn: sa.Connection) -> None:
    assert as_record(Claimed, one(conn, "SELECT 1 AS id, 'A' AS key")) == Claimed(1, "A")


def test_what_the_caller_computed_completes_the_row_and_wins_over_a_column(
    conn: sa.Connection,
) -> None:
    row = one(conn, "SELECT 1 AS id, 'A' AS key, 'queued' AS state")
    assert as_record(Claimed, row, state="done", note="n") == Claimed(1, "A", "done", "n")


def test_a_field_without_a_default_that_nothing_gives_is_a_type_error(
    conn: sa.Connection,
) -> None:
    with pytest.raises(TypeError, match="key"):
        as_record(Claimed, one(conn, "SELECT 1 AS id"))


def test_a_row_of_no_field_and_a_row_of_one_make_records(conn: sa.Connection) -> None:
    # none: every field from the caller; one: a single column read (no tuple of one)
    assert as_record(Claimed, one(conn, "SELECT 'x' AS other"), id=1, key="A") == Claimed(1, "A")
    assert as_record(Claimed, one(conn, "SELECT 'T-2' AS key"), id=2) == Claimed(2, "T-2")


def test_a_whole_result_makes_the_same_records_as_its_rows(conn: sa.Connection) -> None:
    sql = "SELECT g AS id, 'T-' || g AS key, 'x' AS other FROM generate_series(1, 3) AS g"
    rows = conn.execute(sa.text(sql)).all()
    assert as_records(Claimed, conn.execute(sa.text(sql))) == [as_record(Claimed, r) for r in rows]
    assert as_records(Claimed, conn.execute(sa.text(sql + " WHERE false"))) == []
