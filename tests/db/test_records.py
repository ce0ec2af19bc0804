"""Rows become frozen records through one helper (enrichq_schema.db.as_record)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import sqlalchemy as sa

from enrichq_schema.db import as_record


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
