"""`enrichq worker` says what it is doing at INFO: what it connects to (no secret), how it
runs, and why it stopped."""

from __future__ import annotations

import subprocess
import sys

import sqlalchemy as sa
from tests.support.procs import REPO, enrichq_env
from tests.support.world import seeded


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
    assert "concurrency 3, lookup batch 50, draining" in start
    [stop] = [line for line in lines if "worker stopped" in line]
    assert "worker stopped (no_work): claimed 20, done 20" in stop
    assert "not-on-screen" not in done.stderr
