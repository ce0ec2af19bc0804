"""The named-query loader."""

from __future__ import annotations

import pytest

from enrichq_schema.queries import PREPARED_OPTION, load, parse


def test_parse_splits_named_queries_with_their_docs() -> None:
    q = parse(
        "t.sql",
        "-- name: one\n-- Returns one.\nSELECT 1;\n\n-- name: two\n-- Two\n-- lines.\nSELECT :x\n",
    )
    assert list(q) == ["one", "two"]
    assert q["one"].doc == "Returns one."
    assert q["one"].sql == "SELECT 1"
    assert q["two"].doc == "Two lines."
    assert "x" in q("two").compile().params


def test_duplicate_and_empty_and_missing_names_are_errors() -> None:
    with pytest.raises(ValueError, match="defined twice"):
        parse("t.sql", "-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")
    with pytest.raises(ValueError, match="empty"):
        parse("t.sql", "-- name: a\n-- nothing\n")
    with pytest.raises(ValueError, match="no '-- name:'"):
        parse("t.sql", "SELECT 1")
    with pytest.raises(KeyError, match=r"no query named 'b' in t\.sql"):
        parse("t.sql", "-- name: a\nSELECT 1;\n")["b"]


def test_a_prepared_header_marks_the_statement_for_server_side_preparing() -> None:
    q = parse("t.sql", "-- name: hot prepared\nSELECT :x;\n\n-- name: cold\nSELECT :x;\n")
    assert q["hot"].prepared
    assert q("hot").get_execution_options() == {PREPARED_OPTION: True}
    assert not q["cold"].prepared
    assert PREPARED_OPTION not in q("cold").get_execution_options()


def test_a_misspelt_header_is_an_error_not_a_comment() -> None:
    with pytest.raises(ValueError, match=r"unknown flags \['prepard'\]"):
        parse("t.sql", "-- name: a prepard\nSELECT 1;\n")
    with pytest.raises(ValueError, match="is not a query name"):
        parse("t.sql", "-- name: Bad-Name\nSELECT 1;\n")
    with pytest.raises(ValueError, match="is not a query name"):
        parse("t.sql", "-- name:\nSELECT 1;\n")


def test_only_the_claim_loop_statements_are_prepared() -> None:
    queue_sql = load("enrichq_service", "sql/queue.sql")
    prepared = {name for name, query in queue_sql.items() if query.prepared}
    assert prepared == {"queue_claim_batch", "queue_heartbeat", "queue_settle"}
