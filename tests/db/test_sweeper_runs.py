"""The run log of killed workers: the sweeper closes a run that went silent with stop
reason `lost`, so retention prunes it like any other (DESIGN §6, run log)."""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa
from tests.support.db import q
from tests.support.procs import enrichq_env, spawn, wait_for
from tests.support.settings import make_settings
from tests.support.world import seeded

from enrichq_service.seed import create_external_tables
from enrichq_sweeper import passes

# A lease of 2 s: a worker run silent for a few leases is lost.
FAST: dict[str, object] = {"lease_seconds": 2, "heartbeat_seconds": 0.5, "poll_seconds": 0.5}
DEADLINE_SECONDS = 60.0
RUNS = "SELECT owner, finished_at IS NOT NULL, stop_reason FROM enrichq.runs WHERE component = 'worker' ORDER BY id"


def test_the_run_of_a_killed_worker_is_closed_as_lost_and_then_pruned(
    db_engine: sa.Engine, db_url: str, tmp_path: Path
) -> None:
    settings = make_settings(db_url, **FAST)
    # the mirror's tables: a worker refuses to start without them
    seeded(db_engine, 1, enqueued=False)
    env = enrichq_env(db_url, **FAST)
    with db_engine.begin() as conn:  # the mirror a worker checks for at start-up
        create_external_tables(conn)
    killed = spawn(["worker"], env, log=tmp_path / "killed.log")
    alive = spawn(["worker"], env, log=tmp_path / "alive.log")
    try:
        wait_for(lambda: len(q(db_engine, RUNS)) == 2, what="both runs", timeout=DEADLINE_SECONDS)
        killed.kill()
        killed.wait(timeout=DEADLINE_SECONDS)

        def lost() -> bool:
            report = passes.recovery_pass(db_engine, settings, owner="test-sweeper")
            assert report.ok, report.error
            return any(r[2] == "lost" for r in q(db_engine, RUNS))

        wait_for(lost, what="the killed worker's run to be closed", timeout=DEADLINE_SECONDS)
        [(killed_row, stop_reason, error)] = q(
            db_engine,
            "SELECT id, stop_reason, error FROM enrichq.runs WHERE finished_at IS NOT NULL"
            " AND component = 'worker'",
        )
        assert stop_reason == "lost"
        assert error
        # the worker that still beats keeps its run open
        assert [r[1] for r in q(db_engine, RUNS)].count(False) == 1
        assert alive.poll() is None
        alive.send_signal(signal.SIGTERM)
        assert alive.wait(timeout=DEADLINE_SECONDS) == 0
        assert sorted(r[2] for r in q(db_engine, RUNS)) == ["lost", "shutdown"]
        # a lost run ages like any finished one: retention prunes it
        [(now,)] = q(db_engine, "SELECT now()")
        later = now + timedelta(days=settings.retention_days + 1)
        assert passes.retention_pass(db_engine, settings, now=later).ok
        remaining = q(db_engine, "SELECT id FROM enrichq.runs WHERE id = :id", id=killed_row)
        assert remaining == []
    finally:
        for p in (killed, alive):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=DEADLINE_SECONDS)
