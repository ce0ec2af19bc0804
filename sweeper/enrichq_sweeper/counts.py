"""Terminal counts: the sweeper leader recounts done, failed and dead-letter rows once a pass.

Counting the terminal rows walks the retained history (30 days of done rows, 90 of dead
letters), which no scrape should do. So the leader counts them once per pass, index-only
over the two finished-row indexes (steered to them: see `run_once`), into
`enrichq.queue_counts`, and every process's /metrics reads that small table (open rows are
still counted live, through their partial indexes). The gauges are then as fresh as the
last pass; `enrichq_queue_counted_timestamp_seconds` says how fresh.
"""

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
