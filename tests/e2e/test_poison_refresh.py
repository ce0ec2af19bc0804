"""A poison ticket is claimed max_attempts times in all, however often the sweeper runs.

The ticket was enriched once (days ago) and is active again, so the refresh schedule looks
at it; then a new enrich row of it kills whatever runs its enrichment. Real `enrichq worker`
and `enrichq sweep` processes: the first claim kills its worker, the next ones kill
the isolated child the worker runs a suspect in, and the row ends `attempts_exhausted`.
Then ten refresh passes of a running `enrichq sweep` must feed it to nobody: the queue gave up on it, and only a
redrive brings it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.db import q
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.settings import make_settings

from enrichq_service import queue, seed
from enrichq_service.queue import EnqueueRequest

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 3
FAST = {
    "lease_seconds": 2,
    "heartbeat_seconds": 0.5,
    "poll_seconds": 0.2,
    "backoff_base_seconds": 0.1,
    "backoff_cap_seconds": 0.2,
    "max_attempts": MAX_ATTEMPTS,
}


def poison_rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    return q(
        engine,
        "SELECT kind, state, dead_reason, attempts FROM enrichq.queue"
        " WHERE key = 'POISON' ORDER BY id",
    )


def test_a_poison_ticket_and_ten_sweeper_passes_give_max_attempts_claims(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    cfg = make_settings(db_url, max_attempts=MAX_ATTEMPTS)
    with db_engine.begin() as conn:
        seed.seed_world(conn, tickets=5)
        conn.execute(
            sa.text(
                "INSERT INTO helpdesk.tickets (id, requester_email, tenant, created_at, updated_at)"
                " VALUES ('POISON', 'nobody@example.org', 'acme', now() - interval '3 days',"
                " now())"
            )
        )
        # enriched once, three days ago, by a row long pruned: refresh finds it stale
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_enrichments (ticket_id, enriched_at, order_count,"
                " queue_id) VALUES ('POISON', now() - interval '3 days', 0, 0)"
            )
        )
        queue.enqueue(conn, [EnqueueRequest.build(key="POISON")], settings=cfg)
    env = enrichq_env(
        db_url,
        enricher="tests.support.enrichers:crash_on_poison",
        sweep_interval_seconds=0.5,
        refresh_interval_seconds=0.5,
        **FAST,
    )
    log = tmp_path / "fleet.log"
    sweeper = spawn(["sweep"], env, log=log)
    workers = [spawn(["worker"], env, log=log)]
    try:

        def gave_up() -> bool:
            if workers[-1].poll() is not None:  # the poison killed it: its supervisor restarts it
                workers.append(spawn(["worker"], env, log=log))
            rows = poison_rows(db_engine)
            return bool(rows) and rows[-1][1:3] == ("dead_letter", "attempts_exhausted")

        wait_for(gave_up, timeout=90, interval=0.2, what="POISON to spend its attempts")
        assert poison_rows(db_engine) == [("enrich", "dead_letter", "attempts_exhausted", 3)]
        assert len(workers) == 2  # the first claim killed a worker, the others a child only

        def refresh_passes() -> int:
            [(n,)] = q(
                db_engine,
                "SELECT count(*) FROM enrichq.runs WHERE counts->>'task' = 'refresh'"
                " AND stop_reason = 'no_work'",
            )
            return int(n)

        start = refresh_passes()
        wait_for(lambda: refresh_passes() >= start + 10, timeout=60, what="ten refresh passes")
        assert workers[-1].poll() is None
    finally:
        for proc in [sweeper, *workers]:
            stop(proc)
    rows = poison_rows(db_engine)
    assert sum(r[3] for r in rows) == MAX_ATTEMPTS, rows
    assert rows == [("enrich", "dead_letter", "attempts_exhausted", 3)]
