"""Terminal counts: the sweeper leader recounts done, failed and dead-letter rows once a
pass into `enrichq.queue_counts`, which /metrics reads instead of the history."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from enrichq_sweeper.common import set_statement_timeout, sql


def run_once(
    engine: sa.Engine, *, statement_timeout_seconds: float, now: datetime | None = None
) -> int:
    """Recount the terminal rows in one short transaction; how many groups there are."""
    with engine.begin() as conn:
        set_statement_timeout(conn, statement_timeout_seconds)
        # Once most rows are terminal the planner prices a sequential scan of the whole
        # table below the index-only scans (it counts their index pages as random reads),
        # though they read about a quarter of the pages (measured in docs/operations.md).
        # This transaction runs nothing else.
        conn.execute(sql()("counts_plan"))
        row = conn.execute(sql()("counts_refresh"), {"now": now}).one()
    return int(row.groups)
