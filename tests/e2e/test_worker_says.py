"""`enrichq worker` says what it is doing at INFO: what it connects to (no secret), how it
runs, and why it stopped."""

from __future__ import annotations

import subprocess
import sys

import sqlalchemy as sa
from tests.support.procs import REPO, enrichq_env
from tests.support.world import seeded

from enrichq_schema.settings import LOOKUP_BATCH_SIZE_DEFAULT


def test_the_worker_says_where_and_how_it_runs_and_why_it_stopped(
    db_url: str, db_engine: sa.Engine
) -> None:
    seeded(db_engine, 20)
    url = sa.make_url(db_url).update_query_dict({"password": "not-on-screen"})
    done = subprocess.run(
        [sys.executable, "-m", "enrichq_service", "worker", "--drain"],
        cwd=REPO,
        env={
            **enrichq_env(url.render_as_string(hide_password=False)),
            "ENRICHQ_LOG_LEVEL": "INFO",
            "ENRICHQ_CONCURRENCY": "3",
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    [start] = [line for line in lines if " starting: " in line]
    assert "database postgresql" in start
    assert "password=***" in start
    assert f"concurrency 3, lookup batch {LOOKUP_BATCH_SIZE_DEFAULT}, draining" in start
    [stop] = [line for line in lines if "worker stopped" in line]
    assert "worker stopped (no_work): claimed 20, done 20" in stop
    assert "not-on-screen" not in done.stderr


def test_sweep_once_says_what_it_runs_and_what_each_pass_did(
    db_url: str, db_engine: sa.Engine
) -> None:
    seeded(db_engine, 5, enqueued=False)
    with db_engine.begin() as conn:
        # a lease that expired an hour ago: the recovery pass has something to do
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.queue (kind, key, reason, state, max_attempts, attempts,"
                " lease_owner, lease_expires_at) VALUES ('enrich', 'T-000001', 'updated',"
                " 'leased', 5, 1, 'gone', now() - interval '1 hour')"
            )
        )
    done = subprocess.run(
        [sys.executable, "-m", "enrichq_service", "sweep", "--once"],
        cwd=REPO,
        env={**enrichq_env(db_url), "ENRICHQ_LOG_LEVEL": "INFO"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sweep --once as " in done.stderr
    assert "recovery, retention, refresh, counts, reconcile, on postgresql" in done.stderr
    assert "sweep --once done: every task ran" in done.stderr
    # a pass that did something says so
    assert "sweeper recovery pass: promoted 1" in done.stderr
