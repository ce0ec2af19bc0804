"""Operator controls without a database: each scope's statements apply its filter, and a
bad filter is one line and exit 2 before any connection is made."""

from __future__ import annotations

import pytest

from enrichq_service.controls import actions as controls
from enrichq_service.controls.filters import Filter, Scope

SCOPE_STATEMENTS = {
    "open_filter": {"controls_page_queued", "controls_page_leased", "controls_cancel_batch"},
    "dead_filter": {"controls_page_dead", "controls_discard_batch", "controls_redrive_batch"},
}
SELECTS = {"controls_page_queued", "controls_page_leased", "controls_page_dead"}
FILTERS = {"open_filter", "dead_filter", "keys_tenant_kind"}


def test_every_statement_of_a_scope_applies_that_scopes_filter() -> None:
    queries = controls.sql()
    criteria = set(Filter.build(Scope.OPEN, all_rows=True).params()) - {"ids"}
    for fragment, names in SCOPE_STATEMENTS.items():
        for name in names:
            # the scope's filter and the criteria it shares with the other scope, nothing else
            assert set(queries[name].fragments) & FILTERS == {fragment, "keys_tenant_kind"}, name
            # every criterion is bound; the `--id` one by the selects only (see controls.sql)
            binds = set(queries[name].text.compile().params)
            assert binds >= criteria, name
            assert ("ids" in binds) == (name in SELECTS), name
    # and no other statement holds a filter
    filtered = {name for name, query in queries.items() if FILTERS & set(query.fragments)}
    assert filtered == set().union(*SCOPE_STATEMENTS.values())


@pytest.mark.parametrize(
    "args",
    [
        ["cancel"],
        ["cancel", "--all", "--tenant", "acme"],
        ["cancel", "--reason", "superseded"],
        ["cancel", "--older-than", "soon"],
        ["cancel", "--kind", "teleport"],
        ["cancel", "--all", "--actor", "bad\nactor"],
        ["dlq", "discard"],
        ["dlq", "discard", "--reason", "created"],
        ["dlq", "redrive", "--older-than", "0d"],
        ["cancel", "--id", "9223372036854775808"],
        ["dlq", "discard", "--id", "99999999999999999999"],
        ["cancel", "--tenant", "acme "],
        ["dlq", "redrive", "--tenant", " acme"],
        ["audit", "--limit", "0"],
        ["audit", "--command", "explode"],
    ],
    ids=" ".join,
)
def test_bad_filters_are_one_line_and_exit_2_before_any_connection(
    args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from enrichq_service.cli import main

    # a database that cannot be reached: the refusal must come first
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("enrichq: ")
    assert err.count("\n") == 1
