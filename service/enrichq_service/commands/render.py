"""How commands show records: rich tables and JSON lines, written to the command's writer.
Text from outside (keys, tenants, errors, actors) is shown escaped (`shown`), so no
terminal escape or rich markup it holds reaches the screen."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from typing import TYPE_CHECKING, TextIO

from enrichq_schema.text import printable

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from rich.console import Console
    from rich.table import Table


def console(out: TextIO, *, width: int | None = None) -> Console:
    """A rich console writing to `out` (`width` when `out` is not a terminal)."""
    from rich.console import Console

    made = Console(file=out)
    if width is not None and not made.is_terminal:
        made = Console(file=out, width=width)
    return made


def json_lines(records: Iterable[DataclassInstance], out: TextIO) -> None:
    """Each record as one line of JSON (its fields; times and the like as text).
    json.dumps escapes every control character, so the lines are safe to print."""
    for record in records:
        print(json.dumps(asdict(record), default=str), file=out)


def shown(value: object) -> str:
    """`value` as rich markup that shows its `printable` form and nothing else (no style)."""
    from rich.markup import escape

    return escape(printable(value))


def newest_first(what: str, count: int, *, none: str, out: TextIO) -> Table | None:
    """An empty rich table for `count` rows of `what`, newest first; None (having printed
    `none` to `out`) when there are no rows."""
    from rich.table import Table

    if not count:
        console(out).print(none)
        return None
    return Table(title=f"{what} (newest first, {count} shown)")
