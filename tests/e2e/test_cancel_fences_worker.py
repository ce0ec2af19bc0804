"""`enrichq cancel` of a ticket a real worker process is enriching: nothing it found lands.

The worker claims the ticket and starts its lookup (a slow enricher that returns a full
result). The operator cancels the row through the CLI. The worker's next heartbeat finds
the lease gone and tells the handler to stop; the handler still returns its result, and
the worker's settle is refused by the fence: no ticket_orders, no ticket_enrichments row,
the queue row a cancelled dead letter, and the worker exits cleanly when drained. The
lookup that ran is still logged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.db import q
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.world import seeded

from enrichq_service.cli import main

pytestmark = pytest.mark.slow


def test_a_cancelled_job_is_never_written_by_its_worker(
    db_url: str,
    db_engine: sa.Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    markers = tmp_path / "started"
    markers.mkdir()
    [key] = seeded(db_engine, 1)
    env = enrichq_env(
        db_url,
        enricher="tests.support.enrichers:slow",
        ENRICHQ_TEST_SLOW_SECONDS=120,  # returns when told to stop, with its result
        ENRICHQ_TEST_STARTED_DIR=markers,
        lease_seconds=4,
        heartbeat_seconds=0.5,
        poll_seconds=0.2,
    )
    worker = spawn(["worker", "--drain"], env, log=tmp_path / "worker.log")
    try:
        wait_for((markers / key).exists, what="the lookup to start")
        assert q(db_engine, "SELECT state FROM enrichq.queue") == [("leased",)]
        monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
        assert main(["cancel", "--key", key, "--actor", "ops"]) == 0
        assert "1 cancelled (0 queued, 1 leased)" in capsys.readouterr().out
        assert worker.wait(60) == 0, (tmp_path / "worker.log").read_text()
    finally:
        stop(worker)
    assert q(db_engine, "SELECT state, dead_reason, lease_owner FROM enrichq.queue") == [
        ("dead_letter", "cancelled", None)
    ]
    assert q(db_engine, "SELECT count(*) FROM enrichq.ticket_orders") == [(0,)]
    assert q(db_engine, "SELECT count(*) FROM enrichq.ticket_enrichments") == [(0,)]
    assert q(db_engine, "SELECT command, actor, rows_affected FROM enrichq.audit_log") == [
        ("cancel", "ops", 1)
    ]
    # the lookup did run: it is logged (and charged) all the same
    assert q(db_engine, "SELECT count(*) FROM enrichq.lookup_log") == [(1,)]
