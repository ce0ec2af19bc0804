"""The CSV export of a parity run: one row per differing ticket, written as it streams in.

Columns are fixed (``COLUMNS``); order ids are separated by spaces, the rules that accept a
ticket too. The class, the fault group and the accepting rules are the run's own, so the
CSV, the JSON and the HTML report cannot disagree.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
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
    return (
        m.ticket_id,
        m.tenant,
        _when(m.created_at),
        m.ticket_class.value,
        "" if m.fault is None else m.fault.value,
        " ".join(str(r) for r in m.accepted_by),
        str(m.legacy_orders),
        str(m.matched_orders),
        str(m.differing_orders),
        " ".join(m.missing),
        " ".join(m.extra),
        " ".join(m.drift),
        " ".join(m.unverified),
        _when(m.legacy_looked_up_at),
        _when(m.enriched_at),
    )


def _when(value: datetime | None) -> str:
    return "" if value is None else value.isoformat()
