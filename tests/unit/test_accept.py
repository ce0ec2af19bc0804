"""Accept files: a good file's rules, and every way a file is refused (file:line: what)."""

from __future__ import annotations

import hashlib
import re
from datetime import date
from pathlib import Path

import pytest

from enrichq_parity.accept import AcceptFileError, load, parse
from enrichq_parity.model import TicketClass

GOOD = """\
# reviewed 2024-03-08 for the March cutover

[[rule]]
class = "legacy_missing"
first_day = 2024-03-01
last_day = 2024-03-07
reason = "The legacy flow drops tickets when it restarts (INC-4411)."
author = "alice"

[[rule]]
class = "extra_only"
tenant = "acme"
tickets = ["T-1", "T-2", "T-1"]
reason = "Orders placed while the legacy lookup ran; confirmed with the warehouse team."
author = "bob"

[[rule]]
class = "legacy_missing"
tenant = ""
first_day = "2024-03-02"
last_day = "2024-03-02"
reason = "Tickets without a brand were never routed to the legacy flow."
author = "carol"
"""


def test_a_good_file_gives_its_rules_in_order() -> None:
    accepted = parse(GOOD.encode(), "accept.toml")
    assert accepted.sha256 == hashlib.sha256(GOOD.encode()).hexdigest()
    first, second, third = accepted.rules
    assert (first.number, first.line, first.ticket_class) == (1, 3, TicketClass.LEGACY_MISSING)
    assert (first.first_day, first.last_day, first.tenant, first.tickets) == (
        date(2024, 3, 1), date(2024, 3, 7), None, None,
    )  # fmt: skip
    assert first.author == "alice"
    assert (second.line, second.tenant, second.tickets) == (10, "acme", ("T-1", "T-2"))
    assert second.scope() == "tenant acme, tickets T-1, T-2"
    assert (third.tenant, third.first_day, third.last_day) == (
        "",
        date(2024, 3, 2),
        date(2024, 3, 2),
    )
    assert third.scope() == "tenant (no tenant), created 2024-03-02"
    assert first.scope() == "created 2024-03-01 … 2024-03-07"


def _rule(**keys: str) -> str:
    body = {
        "class": '"legacy_missing"',
        "first_day": "2024-03-01",
        "last_day": "2024-03-07",
        "reason": '"known loss"',
        "author": '"alice"',
    }
    body.update(keys)
    lines = [f"{k} = {v}" for k, v in body.items() if v != "-"]
    return "\n".join(["# a comment", "[[rule]]", *lines]) + "\n"


BAD = {
    "not toml": ("[[rule]]\nclass = \n", r"accept\.toml:2: not valid TOML: "),
    "not utf-8": (b"# \xff\n".decode("latin-1"), None),
    "no rules": ("# nothing here\n", r"accept\.toml:1: no \[\[rule\]\] table: nothing to accept"),
    "unknown top key": (
        "owner = 'x'\n" + _rule(),
        r"accept\.toml:1: unknown key 'owner': an accept file holds \[\[rule\]\] tables only",
    ),
    "rule is not a table array": (
        "rule = 'x'\n",
        r"accept\.toml:1: 'rule' must be an array of tables",
    ),
    "unknown rule key": (
        _rule(ticket='"T-1"'),
        r"accept\.toml:8: rule 1: unknown key 'ticket' \(expected class, tenant, tickets",
    ),
    "class missing": (
        _rule(**{"class": "-"}),
        r"accept\.toml:2: rule 1: class is missing \(legacy_missing or extra_only\)",
    ),
    "class not a string": (
        _rule(**{"class": "3"}),
        r"accept\.toml:3: rule 1: class must be a string",
    ),
    "unknown class": (
        _rule(**{"class": '"bogus"'}),
        r"accept\.toml:3: rule 1: class 'bogus' is not a legacy fault",
    ),
    "a shadow fault": (
        _rule(**{"class": '"partial"'}),
        r"accept\.toml:3: rule 1: class 'partial' is a shadow fault: enrichq's own differences "
        r"are fixed, not accepted",
    ),
    "unverified is a shadow fault": (
        _rule(**{"class": '"unverified"'}),
        r"rule 1: class 'unverified' is a shadow fault",
    ),
    "drift is no fault": (
        _rule(**{"class": '"drift_only"'}),
        r"accept\.toml:3: rule 1: class 'drift_only' is not a fault, there is nothing to accept",
    ),
    "no scope": (
        _rule(first_day="-", last_day="-"),
        r"accept\.toml:2: rule 1: say which tickets it covers: tickets = \[\.\.\.\] or first_day",
    ),
    "both scopes": (
        _rule(tickets='["T-1"]'),
        r"accept\.toml:8: rule 1: give tickets or a day range, not both",
    ),
    "half a range": (
        _rule(last_day="-"),
        r"accept\.toml:4: rule 1: a day range needs both first_day and last_day \(last_day is missing\)",
    ),
    "range backwards": (
        _rule(first_day="2024-03-09"),
        r"accept\.toml:5: rule 1: last_day 2024-03-07 is before first_day 2024-03-09",
    ),
    "a time, not a day": (
        _rule(first_day="2024-03-01T10:00:00Z"),
        r"accept\.toml:4: rule 1: first_day must be a day \(YYYY-MM-DD\), not a time",
    ),
    "not a day": (
        _rule(last_day='"next week"'),
        r"accept\.toml:5: rule 1: last_day must be a day \(YYYY-MM-DD\)",
    ),
    "empty ticket list": (
        _rule(first_day="-", last_day="-", tickets="[]"),
        r"accept\.toml:6: rule 1: tickets must be a non-empty list of ticket ids",
    ),
    "a ticket id that is not a string": (
        _rule(first_day="-", last_day="-", tickets='["T-1", 7]'),
        r"accept\.toml:6: rule 1: ticket id 7 is not a non-empty string",
    ),
    "reason missing": (_rule(reason="-"), r"accept\.toml:2: rule 1: reason is missing"),
    "reason empty": (_rule(reason='"   "'), r"accept\.toml:6: rule 1: reason is empty"),
    "author missing": (_rule(author="-"), r"accept\.toml:2: rule 1: author is missing"),
    "author not a string": (
        _rule(author="true"),
        r"accept\.toml:7: rule 1: author must be a string",
    ),
    "author too long": (
        _rule(author='"' + "a" * 201 + '"'),
        r"accept\.toml:7: rule 1: author is longer than 200 characters",
    ),
    "control characters": (
        _rule(author='"al\\u0007ice"'),
        r"accept\.toml:7: rule 1: author has control characters",
    ),
    "tenant not a string": (
        _rule(tenant="[1]"),
        r"accept\.toml:8: rule 1: tenant must be a string",
    ),
    "second rule wrong": (
        _rule() + _rule(**{"class": '"exact"'}),
        r"accept\.toml:10: rule 2: class 'exact' is not a fault",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_file_says_where_and_what(case: str) -> None:
    text, message = BAD[case]
    data = text.encode("latin-1") if case == "not utf-8" else text.encode()
    with pytest.raises(AcceptFileError) as refused:
        parse(data, "accept.toml")
    said = str(refused.value)
    assert len(said.splitlines()) == 1
    if message is None:
        assert said == "accept.toml:1: not UTF-8 text"
    else:
        assert re.search(message, said), said


def test_load_reads_a_file_and_names_the_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "accept.toml"
    path.write_text(GOOD, encoding="utf-8")
    assert len(load(path).rules) == 3
    assert load(path).path == str(path)
    with pytest.raises(AcceptFileError, match=r"nowhere\.toml: no such file"):
        load(tmp_path / "nowhere.toml")
    with pytest.raises(AcceptFileError, match=r": is a directory"):
        load(tmp_path)
