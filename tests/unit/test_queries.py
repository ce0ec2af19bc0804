"""The named-query loader."""

from __future__ import annotations

import pytest

from enrichq_schema.queries import parse


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
