"""The named-query loader."""

from __future__ import annotations

from importlib import resources

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


FRAGMENTS = """\
-- fragment: by_owner
-- Comment lines before the text are the fragment's doc, not spliced.
AND owner = :owner
AND (CAST(:since AS timestamptz) IS NULL
     OR at >= CAST(:since AS timestamptz))

-- name: open
-- Open rows of :owner.
SELECT id::text
FROM t
WHERE state = 'open'
  {{by_owner}}
ORDER BY id;

-- name: closed
-- Closed rows of :owner.
SELECT id FROM t WHERE state = 'closed'
{{ by_owner }}
"""


def test_a_fragment_is_spliced_at_the_indentation_of_its_reference() -> None:
    q = parse("t.sql", FRAGMENTS)
    assert list(q) == ["open", "closed"]
    assert q["open"].sql == (
        "SELECT id::text\n"
        "FROM t\n"
        "WHERE state = 'open'\n"
        "  AND owner = :owner\n"
        "  AND (CAST(:since AS timestamptz) IS NULL\n"
        "       OR at >= CAST(:since AS timestamptz))\n"
        "ORDER BY id"
    )
    # at column 0, and the last thing in the statement
    assert q["closed"].sql == (
        "SELECT id FROM t WHERE state = 'closed'\n"
        "AND owner = :owner\n"
        "AND (CAST(:since AS timestamptz) IS NULL\n"
        "     OR at >= CAST(:since AS timestamptz))"
    )
    assert q["open"].doc == "Open rows of :owner."
    assert q["open"].fragments == q["closed"].fragments == ("by_owner",)
    # the fragment's binds are the statement's; the cast is left alone
    assert set(q("open").compile().params) == {"owner", "since"}


def test_a_fragment_may_include_another_but_not_itself() -> None:
    text = (
        "-- fragment: inner\nAND b = :b\n"
        "-- fragment: outer\n    {{inner}}\nAND a = :a\n"
        "-- name: q\nSELECT 1 FROM t WHERE true\n  {{outer}}\n"
    )
    q = parse("t.sql", text)["q"]
    assert q.sql == "SELECT 1 FROM t WHERE true\n      AND b = :b\n  AND a = :a"
    assert q.fragments == ("outer", "inner")
    looped = "-- fragment: a\n{{b}}\n-- fragment: b\n{{a}}\n-- name: q\nSELECT 1\n{{a}}\n"
    with pytest.raises(ValueError, match=r"fragment 'a' includes itself \(a -> b -> a\)"):
        parse("t.sql", looped)


def test_fragment_mistakes_are_errors_when_the_file_is_loaded() -> None:
    used = "-- name: q\nSELECT 1\n{{f}}\n"
    with pytest.raises(ValueError, match=r"t\.sql: query 'q' uses fragment 'f', which is not"):
        parse("t.sql", used)
    with pytest.raises(ValueError, match="fragment 'f' is defined twice"):
        parse("t.sql", "-- fragment: f\nAND a\n-- fragment: f\nAND b\n" + used)
    with pytest.raises(ValueError, match=r"fragments \['g'\] are used by no query"):
        parse("t.sql", "-- fragment: f\nAND a\n-- fragment: g\nAND b\n" + used)
    with pytest.raises(ValueError, match="fragment 'f' is empty"):
        parse("t.sql", "-- fragment: f\n-- only a doc\n" + used)
    with pytest.raises(ValueError, match=r"fragment 'f' takes no flags, got \['prepared'\]"):
        parse("t.sql", "-- fragment: f prepared\nAND a\n" + used)
    with pytest.raises(ValueError, match="'F-1' is not a fragment name"):
        parse("t.sql", "-- fragment: F-1\nAND a\n" + used)
    with pytest.raises(ValueError, match="no '-- name:'"):
        parse("t.sql", "-- fragment: f\nAND a\n")


def test_a_fragment_is_part_of_one_statement_and_has_a_name_of_its_own() -> None:
    used = "-- name: q\nSELECT 1\nWHERE true\n{{f}}\n"
    # a semicolon would end the statement it is spliced into and start another
    with pytest.raises(ValueError, match="fragment 'f' holds a ';'"):
        parse("t.sql", "-- fragment: f\nAND a; DELETE FROM t\n" + used)
    # in a comment or a string literal it is text, not the end of a statement
    q = parse("t.sql", "-- fragment: f\nAND a = 'x;y'  -- a; b\n" + used)
    assert q["q"].sql == "SELECT 1\nWHERE true\nAND a = 'x;y'  -- a; b"
    # a query and a fragment of one name: {{f}} and q("f") would mean different text
    with pytest.raises(ValueError, match="'f' is the name of a query and of a fragment"):
        parse("t.sql", "-- fragment: f\nAND a\n-- name: f\nSELECT 2\n" + used)


def test_a_reference_not_alone_on_its_line_is_an_error_not_sql() -> None:
    fragment = "-- fragment: f\nAND a\n"
    for statement in ("SELECT 1 WHERE true {{f}}", "SELECT 1\n{{F}}", "SELECT 1\n-- see {{f}}"):
        with pytest.raises(ValueError, match="alone on its line"):
            parse(
                "t.sql", fragment + "-- name: q\n" + statement + "\n-- name: r\nSELECT 2\n{{f}}\n"
            )
    # braces that are SQL (an array literal) are not references
    q = parse("t.sql", "-- name: q\nSELECT CAST('{{1,2},{3,4}}' AS int[])")
    assert q["q"].sql == "SELECT CAST('{{1,2},{3,4}}' AS int[])"


@pytest.mark.parametrize(
    "package", ["enrichq_schema", "enrichq_service", "enrichq_sweeper", "enrichq_parity"]
)
def test_every_sql_file_of_the_packages_loads(package: str) -> None:
    names = sorted(f.name for f in resources.files(package).joinpath("sql").iterdir())
    assert any(name.endswith(".sql") for name in names)
    for name in (n for n in names if n.endswith(".sql")):
        for query in load(package, f"sql/{name}").values():
            assert "{{" not in query.sql, query.name
