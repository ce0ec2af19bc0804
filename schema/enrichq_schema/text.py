"""Text from outside (ticket ids, tenants, errors, log arguments) made safe to show.

A ticket id such as ``"w\\x1b[2J\\nFAKE LOG LINE"`` would clear an operator's terminal or
forge a log line wherever it is printed raw. Ingest refuses control (Cc) and format (Cf)
characters in ids and tenants (`unsafe_character`); rows stored before that check, and
text that is not an id (errors, filters), are shown through `printable`, which writes such
characters, and the line and paragraph separators, as Python escapes; every log line of
the command line's processes goes through `EscapingFormatter`.
"""

from __future__ import annotations

import logging
import unicodedata

# Refused in ticket ids, tenants and event ids: control characters (C0, DEL, C1: escapes,
# newlines, NUL) and format characters (zero-width and bidirectional marks, which make
# two different ids look alike or reorder what a terminal shows).
REFUSED_CATEGORIES = frozenset({"Cc", "Cf"})
# Escaped when shown: the refused ones, and the separators some viewers break lines on.
ESCAPED_CATEGORIES = REFUSED_CATEGORIES | {"Zl", "Zp"}


def unsafe_character(value: str) -> str | None:
    """The first control or format character of `value` as ``U+XXXX``, or None."""
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
        message = record.getMessage()
        safe = printable(message)
        if safe == message:
            return super().format(record)
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args = safe, None
        return super().format(copy)
