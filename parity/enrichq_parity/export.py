"""The CSV export of a parity run: one row per differing ticket, written as it streams in,
safe to open in a spreadsheet."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import IO

from enrichq_parity.model import Mismatch

COLUMNS = (
    "ticket_id",
    "tenant",
    "created_at",
    "class",
    "fault",
    "accepted_by",
    "legacy_orders",
    "matched_orders",
    "differing_orders",
    "missing",
    "extra",
    "drift",
    "unverified",
    "legacy_looked_up_at",
    "enriched_at",
)

# What a spreadsheet reads as the start of a formula (OWASP, "CSV injection"): such a cell
# gets a leading single quote, which makes it text.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def write_header(handle: IO[str]) -> None:
    """The header line."""
    csv.writer(handle).writerow(COLUMNS)


def writer(handle: IO[str]) -> Callable[[Mismatch], None]:
    """A function that writes one mismatch as a CSV row to `handle`."""
    out = csv.writer(handle)

    def write(m: Mismatch) -> None:
        out.writerow(row(m))

    return write


def row(m: Mismatch) -> tuple[str, ...]:
    """One mismatch as the CSV's cells."""
    cells = (
        m.ticket_id,
        m.tenant,
        _when(m.created_at),
        m.ticket_class.value,
        "" if m.fault is None else m.fault.value,
        " ".join(str(r) for r in m.accepted_by),
        str(m.legacy_orders),
        str(m.matched_orders),
        str(m.differing_orders),
        _ids(m.missing),
        _ids(m.extra),
        _ids(m.drift),
        _ids(m.unverified),
        _when(m.legacy_looked_up_at),
        _when(m.enriched_at),
    )
    return tuple(neutralised(cell) for cell in cells)


def neutralised(cell: str) -> str:
    """The cell, with a leading single quote if a spreadsheet would take it for a formula."""
    return "'" + cell if cell.startswith(FORMULA_STARTS) else cell


def _ids(ids: Sequence[str]) -> str:
    """Order ids as one unambiguous cell: a JSON array, empty when there are none."""
    return json.dumps(list(ids), ensure_ascii=False) if ids else ""


def _when(value: datetime | None) -> str:
    return "" if value is None else value.isoformat()
