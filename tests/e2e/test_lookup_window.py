"""The lookup window (ENRICHQ_LOOKUP_WINDOW_SECONDS, issue 30) with real `enrichq worker`
processes against real PostgreSQL: events that trickle in become visible together, at the
window's boundary, and the fleet claims each cohort in batches, not one ticket a query;
manual and redriven work is exempt and never waits for a boundary.

Every call of the probe enricher records its start in a folder (with the tickets it got), so
the queries are counted from outside the processes, not from enrichq's own bookkeeping.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.db import execute, q
from tests.support.procs import REPO, enrichq_env, spawn, stop, wait_for
from tests.support.settings import make_settings
from tests.support.web import free_port
from tests.support.world import seeded

from enrichq_service import queue
from enrichq_service.queue import EnqueueRequest

pytestmark = pytest.mark.slow

PROBE = "tests.support.enrichers:window_probe"


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    """`enrichq ARGS`, to its end."""
    return subprocess.run(
        [sys.executable, "-m", "enrichq_service", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )


def trickle(engine: sa.Engine, keys: list[str], *, window: float, every: float) -> None:
    """An `updated` event for each of `keys`, one transaction each, `every` seconds apart."""
    settings = make_settings(None, lookup_window_seconds=window)
    for key in keys:
        with engine.begin() as conn:
            queue.enqueue(
                conn, [EnqueueRequest.build(key=key, reason="updated")], settings=settings
            )
        time.sleep(every)


def probe_calls(folder: Path) -> list[tuple[int, int]]:
    """Every probe call as (pid, tickets it got)."""
    return [(int(f.name.split("-")[0]), int(f.read_text() or 0)) for f in folder.iterdir()]


def workers(
    db_url: str, folder: Path, tmp_path: Path, *, window: float
) -> list[subprocess.Popen[bytes]]:
    return [
        spawn(
            ["worker"],
            enrichq_env(
                db_url,
                batch_enricher=PROBE,
                lookup_batch_size=50,
                lookup_window_seconds=window,
                poll_seconds=30,  # the boundary, not the poll, must wake the workers
                ENRICHQ_TEST_STARTED_DIR=folder,
            ),
            log=tmp_path / f"w{i}.log",
        )
        for i in range(2)
    ]


@pytest.mark.parametrize("window", [0, 3])
def test_trickling_events_are_claimed_in_cohorts_by_two_workers(
    db_url: str, db_engine: sa.Engine, tmp_path: Path, window: float
) -> None:
    """Two worker processes; 24 events arrive one every 0.1 s. With a 3 s window every row
    becomes visible at a multiple of 3 s since the epoch, so the arrivals fall in at most
    two cohorts, and each cohort is served by at most one query per worker (at least 6
    tickets a query); with the window off (0, today's behaviour) the idle workers take the
    rows one by one as they arrive."""
    keys = [f"W-{i:02d}" for i in range(24)]
    seeded(db_engine, 1, extra=keys, enqueued=False)
    folder = tmp_path / "calls"
    folder.mkdir()
    procs = workers(db_url, folder, tmp_path, window=window)
    try:
        # both workers listening before the first event (a NOTIFY sent before is not heard,
        # and the poll is 30 s)
        wait_for(
            lambda: (
                q(
                    db_engine,
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND query LIKE 'LISTEN %'",
                )
                == [(2,)]
            ),
            timeout=60,
            what="two workers listening",
        )
        trickle(db_engine, keys, window=window, every=0.1)
        wait_for(
            lambda: (
                q(db_engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'done'") == [(24,)]
            ),
            timeout=60,
            what="every ticket to be done",
        )
    finally:
        codes = [stop(w) for w in procs]
    assert codes == [0, 0]
    calls = probe_calls(folder)
    assert sum(n for _, n in calls) == 24
    if window == 0:
        assert len(calls) > 8  # one query for a ticket or two: what the window is for
        return
    cohorts = q(
        db_engine, "SELECT count(DISTINCT visible_at) FROM enrichq.queue WHERE kind = 'enrich'"
    )[0][0]
    assert cohorts <= 2
    aligned = q(
        db_engine,
        "SELECT bool_and(mod(CAST(extract(epoch FROM visible_at) AS numeric), 3) = 0)"
        " FROM enrichq.queue",
    )
    assert aligned == [(True,)]
    assert len(calls) <= 2 * cohorts, calls


def test_manual_and_redriven_work_is_not_held_for_the_window(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    """A worker with the largest window (an hour): an event waits for the hour's boundary,
    but `enrichq enqueue` (manual) is done at once, a manual enqueue of a ticket whose event
    is waiting brings it forward, and a redriven dead letter is done at once."""
    keys = ["M-1", "M-2", "R-1", "E-1"]
    seeded(db_engine, 1, extra=keys, enqueued=False)
    env = enrichq_env(db_url, lookup_window_seconds=3600)
    before = q(db_engine, "SELECT now()")[0][0]
    trickle(db_engine, ["E-1", "M-2"], window=3600, every=0)
    [(visible,)] = q(db_engine, "SELECT visible_at FROM enrichq.queue WHERE key = 'E-1'")
    assert isinstance(visible, datetime)
    assert visible > before
    assert visible.timestamp() % 3600 == 0
    # a dead letter to redrive
    execute(
        db_engine,
        "INSERT INTO enrichq.queue (kind, key, reason, state, dead_reason, finished_at, max_attempts)"
        " VALUES ('enrich', 'R-1', 'updated', 'dead_letter', 'attempts_exhausted', now(), 5)",
    )
    port = free_port()
    worker = spawn(["worker"], enrichq_env(db_url, lookup_window_seconds=3600, metrics_port=port))
    try:
        assert run_cli(["enqueue", "M-1"], env).returncode == 0
        assert run_cli(["enqueue", "M-2"], env).returncode == 0  # merges, brought forward
        assert run_cli(["dlq", "redrive", "--key", "R-1"], env).returncode == 0
        wait_for(
            lambda: (
                q(
                    db_engine,
                    "SELECT key FROM enrichq.queue WHERE state = 'done' ORDER BY key",
                )
                == [("M-1",), ("M-2",), ("R-1",)]
            ),
            timeout=60,
            what="the manual and redriven work to be done",
        )
    finally:
        assert stop(worker) == 0
    # the event's row still waits for its boundary (an hour at most), unless it came
    if visible.timestamp() - time.time() > 5:
        assert q(db_engine, "SELECT state FROM enrichq.queue WHERE key = 'E-1'") == [("queued",)]
