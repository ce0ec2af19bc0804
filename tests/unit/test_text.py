"""Outside text made safe to show, and refused where it enters as an id or tenant."""

from __future__ import annotations

import io
import logging

import pytest

from enrichq_schema.text import EscapingFormatter, printable, unsafe_character
from enrichq_service.queue import EnqueueRequest, QueueInputError


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("T-1", "T-1"),
        ("tëst 票", "tëst 票"),
        ("w\x1b[2J\nFAKE LOG LINE", "w\\x1b[2J\\nFAKE LOG LINE"),
        ("a\x00b\x7fc\x85", "a\\x00b\\x7fc\\x85"),
        ("zero\u200bwidth\u202eflip", "zero\\u200bwidth\\u202eflip"),
        ("line\u2028para\u2029", "line\\u2028para\\u2029"),
        # a lone surrogate (surrogateescape decoding): no UTF-8 text can hold it
        ("not \udcff utf-8", "not \\udcff utf-8"),
        (42, "42"),
    ],
)
def test_printable_escapes_control_format_and_separator_characters(
    value: object, shown: str
) -> None:
    assert printable(value) == shown


def test_unsafe_character_names_the_first_cc_or_cf_character() -> None:
    assert unsafe_character("T-1 tëst") is None
    assert unsafe_character("a\tb\x1b") == "U+0009"
    assert unsafe_character("acme\u200b") == "U+200B"
    assert unsafe_character("\U000e0001") == "U+E0001"  # a tag character (Cf)
    assert unsafe_character("T-\udcff") == "U+DCFF"  # a lone surrogate (Cs)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"key": "w\x1b[2J\nFAKE LOG LINE"},
            "key: must not contain control or format characters (U+001B)",
        ),
        ({"key": "T\x00"}, "key: must not contain control or format characters (U+0000)"),
        ({"key": "T-\udcff"}, "key: must not contain control or format characters (U+DCFF)"),
        (
            {"key": "T-1", "tenant": "ac\u00adme"},
            "tenant: must not contain control or format characters (U+00AD)",
        ),
    ],
)
def test_enqueue_refuses_control_and_format_characters(
    fields: dict[str, str], message: str
) -> None:
    with pytest.raises(QueueInputError) as info:
        EnqueueRequest.build(key=fields["key"], tenant=fields.get("tenant"))
    assert str(info.value) == message


def test_log_records_stay_one_line_and_tracebacks_keep_theirs() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EscapingFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("tests.text")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("gave up on %s", "w\x1b[2J\nFAKE LOG LINE")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("hook failed for %s", "T-\n2")
    finally:
        log.removeHandler(handler)
        log.propagate = True
    lines = stream.getvalue().splitlines()
    assert lines[0] == "WARNING gave up on w\\x1b[2J\\nFAKE LOG LINE"
    assert lines[1] == "ERROR hook failed for T-\\n2"
    assert lines[2] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: boom"


@pytest.mark.parametrize(
    "fields",
    [
        {"key": "   "},
        {"key": " T-1"},
        {"key": "T-1", "tenant": "  "},
        {"key": "T-1", "tenant": "a "},
    ],
)
def test_one_rule_for_ids_in_the_cli_and_http(fields: dict[str, str]) -> None:
    from pydantic import ValidationError

    from enrichq_service.http import Event

    with pytest.raises(QueueInputError):
        EnqueueRequest.build(key=fields["key"], tenant=fields.get("tenant"))
    body = {
        "id": "E-1",
        "ticket_id": fields["key"],
        "type": "updated",
        "occurred_at": "2024-05-01T12:00:00Z",
    }
    if "tenant" in fields:
        body["tenant"] = fields["tenant"]
    with pytest.raises(ValidationError):
        Event.model_validate(body)
