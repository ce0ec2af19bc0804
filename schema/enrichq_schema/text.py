"""Text from outside (ticket ids, tenants, errors, log arguments) made safe to show, and
refused where it enters as an id or tenant."""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

# Refused in ticket ids, tenants and event ids: control characters (C0, DEL, C1: escapes,
# newlines, NUL), format characters (zero-width and bidirectional marks, which make two
# different ids look alike or reorder what a terminal shows) and lone surrogates (what
# `bytes.decode("utf-8", "surrogateescape")` makes of bytes that are not UTF-8: no UTF-8
# text, so no PostgreSQL text, can hold one, and the driver refuses to send it).
REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})
# Escaped when shown: the refused ones, and the separators some viewers break lines on.
ESCAPED_CATEGORIES = REFUSED_CATEGORIES | {"Zl", "Zp"}


def unsafe_character(value: str) -> str | None:
    """The first refused character of `value` (control, format, lone surrogate) as
    ``U+XXXX``, or None."""
    for char in value:
        if unicodedata.category(char) in REFUSED_CATEGORIES:
            return f"U+{ord(char):04X}"
    return None


def printable(value: object) -> str:
    """`value` as text with every control, format and separator character escaped."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    out: list[str] = []
    for char in text:
        if unicodedata.category(char) in ESCAPED_CATEGORIES:
            out.append(char.encode("unicode_escape").decode("ascii"))
        else:
            out.append(char)
    return "".join(out)


class EscapingFormatter(logging.Formatter):
    """A log formatter that shows each message through `printable`: a record is always one
    line, whatever its arguments hold (a ticket id cannot forge a second log line nor send
    escapes to the terminal). A traceback, appended after the message, keeps its lines."""

    def format(self, record: logging.LogRecord) -> str:
        from enrichq_schema.secrets import scrubbed

        message = record.getMessage()
        safe = scrubbed(printable(message))
        if safe == message:
            return scrubbed(super().format(record))
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args = safe, None
        return scrubbed(super().format(copy))


def one_line(text: str, limit: int = 2000) -> str:
    """Several lines of output (a server's log, a tool's stderr) as one, bounded."""
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())[:limit]


def error_line(exc: BaseException, limit: int) -> str:
    """An error as one storable, printable line: its type and first line, bounded, with no
    NUL or control characters left (they reach a row's last_error, logs and terminals). A
    driver error wrapped by SQLAlchemy is shown as the driver's, without the SQL."""
    orig = getattr(exc, "orig", None) or exc
    try:
        lines = str(orig).strip().splitlines()
    except Exception:  # a plug-in's exception whose __str__ itself raises
        lines = ["(its message could not be read)"]
    return printable(f"{type(orig).__name__}: {lines[0] if lines else ''}")[:limit]


def validation_problem(
    errors: Sequence[Mapping[str, Any]], *, field: Callable[[Sequence[Any]], str] | None = None
) -> str:
    """Pydantic's validation errors as one line: the first error's field (`field` names it
    from its location; by default as a path such as ``events[0].key``) and message, never
    the input, and how many more there are."""
    if not errors:
        return "invalid input"
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    name = field(loc) if field is not None else location_path(loc)
    message = " ".join(str(first.get("msg", "invalid")).removeprefix("Value error, ").split())
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{name}: {message}{more}" if name else f"{message}{more}"


def location_path(loc: Sequence[Any]) -> str:
    """A validation error's location as a path: ``events[0].key``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def text_problem(value: str, max_length: int) -> str | None:
    """What is wrong with `value` as a short operator-given text (an actor, a tenant, a
    reason), or None: empty, longer than `max_length`, or holding a refused character."""
    if not value.strip() or len(value) > max_length:
        return f"must be 1 to {max_length} characters"
    if (bad := unsafe_character(value)) is not None:
        return f"must not contain control or format characters ({bad})"
    return None


def id_problem(value: str, max_length: int) -> str | None:
    """What is wrong with `value` as an id or a tenant that ingest stores and others match
    exactly (the CLI and HTTP apply this one rule), or None: blank, padded with whitespace
    (stored so, it would never match its ticket), too long, or holding a refused character
    or a byte that was not UTF-8."""
    if not value.strip():
        return "must not be blank"
    if (bad := unsafe_character(value)) is not None:
        return f"must not contain control or format characters ({bad})"
    if value != value.strip():
        return "must not start or end with whitespace"
    if len(value) > max_length:
        return f"must be at most {max_length} characters"
    return None


def checked_text(value: str, max_length: int, name: str, error: type[Exception]) -> str:
    """`value` stripped, or `error("{name}: {problem}")` when `text_problem` finds one."""
    value = value.strip()
    if (problem := text_problem(value, max_length)) is not None:
        raise error(f"{name}: {problem}")
    return value


def utc_time(value: datetime | None, *, seconds: bool = False, none: str = "—") -> str:
    """`value` as a UTC time, ``YYYY-MM-DD HH:MM`` (``:SS`` with `seconds`), whatever time
    zone it carries (a session's TimeZone is the server's choice); `none` when it is None."""
    if value is None:
        return none
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")
