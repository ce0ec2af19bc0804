"""Accept files: the differences a reviewer accepts, with a reason and an author, in TOML;
parsed strictly and applied to every run."""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any

from enrichq_parity.errors import ParityError
from enrichq_parity.model import (
    ACCEPTABLE,
    SHADOW_FAULTS,
    AcceptFile,
    AcceptRule,
    TicketClass,
)
from enrichq_schema.states import TENANT_MAX_LENGTH

MAX_RULES = 1000
MAX_TICKETS_PER_RULE = 100_000
REASON_MAX_LENGTH = 2000
AUTHOR_MAX_LENGTH = 200
TICKET_ID_MAX_LENGTH = 200
KEYS = ("class", "tenant", "tickets", "first_day", "last_day", "reason", "author")

_RULE_HEADER = re.compile(r"^\s*\[\[\s*(rule|\"rule\"|'rule')\s*\]\]")
_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column \d+\)$")


class AcceptFileError(ParityError):
    """The accept file is not valid."""


def load(path: Path) -> AcceptFile:
    """Read and check the accept file at `path`; AcceptFileError says where and what is wrong."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise AcceptFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise AcceptFileError(f"{path}: is a directory") from None
    except OSError as exc:
        raise AcceptFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return parse(data, str(path))


def parse(data: bytes, name: str) -> AcceptFile:
    """Check the bytes of an accept file called `name` (for messages) and return its rules."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise AcceptFileError(f"{name}:{line}: not UTF-8 text") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        found = _TOML_POSITION.search(message)
        where = f"{name}:{found.group(1)}" if found else name
        what = _TOML_POSITION.sub("", message) if found else message
        raise AcceptFileError(f"{where}: not valid TOML: {what}") from None
    lines = _Lines(text)
    for key in doc:
        if key != "rule":
            raise AcceptFileError(
                f"{name}:{lines.top_level(key)}: unknown key {key!r}: an accept file holds "
                "[[rule]] tables only"
            )
    raw_rules = doc.get("rule")
    if raw_rules is None:
        raise AcceptFileError(f"{name}:1: no [[rule]] table: nothing to accept")
    if not isinstance(raw_rules, list) or not all(isinstance(r, dict) for r in raw_rules):
        raise AcceptFileError(
            f"{name}:{lines.top_level('rule')}: 'rule' must be an array of tables ([[rule]])"
        )
    if len(raw_rules) > MAX_RULES:
        raise AcceptFileError(f"{name}:{lines.header(MAX_RULES + 1)}: more than {MAX_RULES} rules")
    rules = tuple(
        _Rule(name, number, raw, lines).check() for number, raw in enumerate(raw_rules, start=1)
    )
    return AcceptFile(path=name, sha256=hashlib.sha256(data).hexdigest(), rules=rules)


class _Lines:
    """Line numbers of a TOML text's [[rule]] headers and their keys, for messages.

    tomllib reports no positions for values, so they are found again in the text: the n-th
    ``[[rule]]`` header, and the first ``key =`` line after it. A rule written as an inline
    table falls back to the line of its array.
    """

    def __init__(self, text: str) -> None:
        self._lines = text.splitlines()
        self._headers = [i + 1 for i, line in enumerate(self._lines) if _RULE_HEADER.match(line)]

    def header(self, number: int) -> int:
        """The line of rule `number`'s header (1 if it has none)."""
        if 0 < number <= len(self._headers):
            return self._headers[number - 1]
        return self.top_level("rule")

    def key(self, number: int, key: str) -> int:
        """The line that sets `key` in rule `number` (its header line if not found)."""
        start = self.header(number)
        end = self._headers[number] if number < len(self._headers) else len(self._lines) + 1
        pattern = re.compile(rf"^\s*({re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')\s*=")
        for i in range(start, end - 1):
            if pattern.match(self._lines[i]):
                return i + 1
        return start

    def top_level(self, key: str) -> int:
        """The first line that sets or opens `key` at the top level (1 if not found)."""
        pattern = re.compile(rf"^\s*(\[+\s*)?{re.escape(key)}\b")
        for i, line in enumerate(self._lines):
            if pattern.match(line):
                return i + 1
        return 1


@dataclass
class _Rule:
    """One [[rule]] table being checked."""

    file: str
    number: int
    raw: dict[str, Any]
    lines: _Lines

    def fail(self, key: str | None, message: str) -> AcceptFileError:
        line = self.lines.header(self.number) if key is None else self.lines.key(self.number, key)
        return AcceptFileError(f"{self.file}:{line}: rule {self.number}: {message}")

    def check(self) -> AcceptRule:
        for key in self.raw:
            if key not in KEYS:
                raise self.fail(key, f"unknown key {key!r} (expected {', '.join(KEYS)})")
        ticket_class = self._class()
        tenant = self._text("tenant", TENANT_MAX_LENGTH, empty_ok=True)
        tickets = self._tickets()
        first_day, last_day = self._day("first_day"), self._day("last_day")
        if (first_day is None) != (last_day is None):
            missing = "last_day" if last_day is None else "first_day"
            raise self.fail(
                "first_day" if first_day is not None else "last_day",
                f"a day range needs both first_day and last_day ({missing} is missing)",
            )
        if first_day is not None and last_day is not None and first_day > last_day:
            raise self.fail("last_day", f"last_day {last_day} is before first_day {first_day}")
        if tickets is None and first_day is None:
            raise self.fail(
                None,
                "say which tickets it covers: tickets = [...] or first_day and last_day",
            )
        if tickets is not None and first_day is not None:
            raise self.fail("tickets", "give tickets or a day range, not both")
        return AcceptRule(
            number=self.number,
            line=self.lines.header(self.number),
            ticket_class=ticket_class,
            reason=self._required("reason", REASON_MAX_LENGTH),
            author=self._required("author", AUTHOR_MAX_LENGTH),
            tenant=tenant,
            tickets=tickets,
            first_day=first_day,
            last_day=last_day,
        )

    def _class(self) -> TicketClass:
        value = self.raw.get("class")
        allowed = " or ".join(c.value for c in ACCEPTABLE)
        if value is None:
            raise self.fail(None, f"class is missing ({allowed})")
        if not isinstance(value, str):
            raise self.fail("class", f"class must be a string ({allowed})")
        try:
            ticket_class = TicketClass(value)
        except ValueError:
            raise self.fail("class", f"class {value!r} is not a legacy fault ({allowed})") from None
        if ticket_class in SHADOW_FAULTS:
            raise self.fail(
                "class",
                f"class {value!r} is a shadow fault: enrichq's own differences are fixed, "
                f"not accepted ({allowed})",
            )
        if ticket_class not in ACCEPTABLE:
            raise self.fail(
                "class", f"class {value!r} is not a fault, there is nothing to accept ({allowed})"
            )
        return ticket_class

    def _required(self, key: str, limit: int) -> str:
        """A text key every rule has (reason, author): missing is an error, never None."""
        value = self._text(key, limit)
        if value is None:
            raise self.fail(None, f"{key} is missing")
        return value

    def _text(self, key: str, limit: int, *, empty_ok: bool = False) -> str | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(key, f"{key} must be a string")
        stripped = value.strip()
        if not stripped and not empty_ok:
            raise self.fail(key, f"{key} is empty")
        if len(stripped) > limit:
            raise self.fail(key, f"{key} is longer than {limit} characters")
        if not stripped.replace("\n", " ").isprintable():
            raise self.fail(key, f"{key} has control characters")
        return stripped

    def _tickets(self) -> tuple[str, ...] | None:
        value = self.raw.get("tickets")
        if value is None:
            return None
        if not isinstance(value, list) or not value:
            raise self.fail("tickets", "tickets must be a non-empty list of ticket ids")
        if len(value) > MAX_TICKETS_PER_RULE:
            raise self.fail("tickets", f"more than {MAX_TICKETS_PER_RULE:,} ticket ids")
        for item in value:
            if not isinstance(item, str) or not item.strip() or len(item) > TICKET_ID_MAX_LENGTH:
                raise self.fail(
                    "tickets",
                    f"ticket id {item!r} is not a non-empty string of at most "
                    f"{TICKET_ID_MAX_LENGTH} characters",
                )
        return tuple(dict.fromkeys(v.strip() for v in value))

    def _day(self, key: str) -> date | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if isinstance(value, datetime):
            raise self.fail(key, f"{key} must be a day (YYYY-MM-DD), not a time")
        if isinstance(value, date):
            return value
        if isinstance(value, str):
            try:
                return date.fromisoformat(value)
            except ValueError:
                pass
        raise self.fail(key, f"{key} must be a day (YYYY-MM-DD)")
