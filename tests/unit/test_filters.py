"""The filter language of cancel, dlq discard and dlq redrive: parsed once, validated."""

from __future__ import annotations

import pytest

from enrichq_service.controls.errors import FilterError
from enrichq_service.controls.filters import Filter, Scope, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90m", 5400), ("2h", 7200), ("7d", 604_800), ("1h30m", 5400), ("45s", 45), ("2W", 1_209_600)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "5x", "h", "-2h", "2 h", "1.5h", "0m", "4000d"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(FilterError, match="--older-than"):
        parse_duration(text)


def test_no_filter_at_all_is_refused_and_all_stands_alone() -> None:
    with pytest.raises(FilterError, match="give a filter"):
        Filter.build(Scope.OPEN)
    with pytest.raises(FilterError, match="--all selects every row"):
        Filter.build(Scope.DEAD, all_rows=True, tenant="acme")
    assert Filter.build(Scope.DEAD, all_rows=True).params() == {
        "ids": None,
        "keys": None,
        "tenant": None,
        "kind": None,
        "reason": None,
        "older_than_seconds": None,
    }


def test_reason_means_the_enqueue_reason_for_open_rows_and_the_dead_reason_for_dead_ones() -> None:
    assert Filter.build(Scope.OPEN, reason="updated").reason == "updated"
    assert Filter.build(Scope.DEAD, reason="cancelled").reason == "cancelled"
    with pytest.raises(FilterError, match="not an enqueue reason"):
        Filter.build(Scope.OPEN, reason="superseded")
    with pytest.raises(FilterError, match="not a dead reason"):
        Filter.build(Scope.DEAD, reason="updated")


def test_criteria_are_validated_and_normalised() -> None:
    flt = Filter.build(
        Scope.OPEN,
        ids=[3, 1, 3],
        keys=["b", "a", "a"],
        tenant="acme",
        kind="enrich",
        older_than="2H",
    )
    assert (flt.ids, flt.keys, flt.older_than, flt.older_than_seconds) == (
        (1, 3),
        ("a", "b"),
        "2h",
        7200.0,
    )
    assert flt.params() == {
        "ids": [1, 3],
        "keys": ["a", "b"],
        "tenant": "acme",
        "kind": "enrich",
        "reason": None,
        "older_than_seconds": 7200.0,
    }
    assert flt.as_json() == {
        "scope": "open",
        "ids": [1, 3],
        "keys": ["a", "b"],
        "tenant": "acme",
        "kind": "enrich",
        "older_than": "2h",
    }
    assert (
        flt.describe()
        == "--id 1 --id 3 --key a --key b --tenant acme --kind enrich --older-than 2h"
    )
    for bad in (
        {"kind": "teleport"},
        {"ids": [0]},
        {"keys": [""]},
        {"keys": ["x\x00y"]},
        {"tenant": "t" * 201},
    ):
        with pytest.raises(FilterError):
            Filter.build(Scope.OPEN, **bad)


def test_a_key_stored_before_ingest_refused_control_characters_can_still_be_matched() -> None:
    assert Filter.build(Scope.DEAD, keys=["w\x1b[2J\nFAKE"]).keys == ("w\x1b[2J\nFAKE",)
