"""The parity run's pure helpers: how a window is cut into UTC days."""

from __future__ import annotations

from datetime import UTC, datetime

from enrichq_parity.parity import (
    day_windows,
)


def test_day_windows_cut_at_utc_midnight() -> None:
    since = datetime(2024, 3, 1, 18, tzinfo=UTC)
    until = datetime(2024, 3, 3, 6, tzinfo=UTC)
    assert [(d.isoformat(), s.hour, e.hour) for d, s, e in day_windows(since, until)] == [
        ("2024-03-01", 18, 0), ("2024-03-02", 0, 0), ("2024-03-03", 0, 6),
    ]  # fmt: skip
