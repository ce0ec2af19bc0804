"""`enrichq status` reads what is in the queue."""

from __future__ import annotations

import json
import subprocess
import sys

import sqlalchemy as sa
from tests.support.settings import make_settings

from enrichq_service import queue
from enrichq_service.commands.queue import _upcoming
from enrichq_service.queue import EnqueueRequest
from enrichq_service.status import collect


def test_status_counts_by_kind_and_state(db_url: str, db_engine: sa.Engine) -> None:
    cfg = make_settings(db_url, max_attempts=1)
    with db_engine.begin() as conn:
        queue.enqueue(conn, [EnqueueRequest.build(key=f"T-{i}") for i in range(4)], settings=cfg)
        queue.enqueue(conn, [EnqueueRequest.build(key="R-1", kind="refresh")], settings=cfg)
    with db_engine.begin() as conn:
        a, b, _c = queue.claim(conn, kinds=("enrich",), owner="w", limit=3, lease_seconds=60)
        queue.complete(conn, owner="w", jobs=[a])
        queue.retry(
            conn, owner="w", failures=[(b, "x")], backoff_base_seconds=0, backoff_cap_seconds=0
        )
    with db_engine.connect() as conn:
        report = collect(conn)
    assert report.counts["enrich"] == {
        "queued": 1,
        "leased": 1,
        "done": 1,
        "failed": 0,
        "dead_letter": 1,
    }
    assert report.counts["refresh"]["queued"] == 1
    assert report.live_leases == 1
    assert report.dead_letters == {"attempts_exhausted": 1}
    assert report.oldest_visible_seconds["enrich"] >= 0

    env = {"ENRICHQ_DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "enrichq_service", "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert json.loads(proc.stdout)["counts"]["enrich"]["done"] == 1
    table = subprocess.run(
        [sys.executable, "-m", "enrichq_service", "status"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert "dead letters by reason: attempts_exhausted: 1" in table.stdout


def test_a_queue_of_delayed_rows_says_when_the_next_becomes_visible(
    db_url: str, db_engine: sa.Engine
) -> None:
    """Every row still inside its visibility delay: status shows how many wait and when the
    first becomes visible, not just 'oldest visible -'."""
    cfg = make_settings(db_url, delay_created_seconds=600, delay_updated_seconds=120)
    with db_engine.begin() as conn:
        queue.enqueue(
            conn,
            [EnqueueRequest.build(key=f"T-{i}", reason="created") for i in range(3)]
            + [EnqueueRequest.build(key="T-9", reason="updated")],
            settings=cfg,
        )
    with db_engine.connect() as conn:
        report = collect(conn)
    assert "enrich" not in report.oldest_visible_seconds
    waiting = report.next_visible["enrich"]
    assert waiting["waiting"] == 4
    assert 100 < waiting["in_seconds"] <= 120
    shown = subprocess.run(
        [sys.executable, "-m", "enrichq_service", "status", "--json"],
        capture_output=True,
        text=True,
        env={"ENRICHQ_DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"},
        timeout=60,
        check=True,
    )
    assert json.loads(shown.stdout)["next_visible"]["enrich"]["waiting"] == 4
    assert _upcoming({"waiting": 4, "in_seconds": 110.4}) == "4, the first in 1 min 50 s"
    assert _upcoming(None) == "-"


def test_a_manual_enqueue_brings_a_delayed_ticket_forward(
    db_url: str, db_engine: sa.Engine
) -> None:
    """`enqueue --reason manual` is visible now, also when it merges into a delayed row; an
    event merging into it keeps the row's own delay."""
    cfg = make_settings(db_url, delay_created_seconds=600, delay_updated_seconds=120)
    with db_engine.begin() as conn:
        queue.enqueue(conn, [EnqueueRequest.build(key="T-1", reason="created")], settings=cfg)
        queue.enqueue(conn, [EnqueueRequest.build(key="T-2", reason="created")], settings=cfg)
        queue.enqueue(conn, [EnqueueRequest.build(key="T-2", reason="updated")], settings=cfg)
        [merged] = queue.enqueue(
            conn, [EnqueueRequest.build(key="T-1", reason="manual")], settings=cfg
        )
    assert not merged.inserted
    with db_engine.begin() as conn:
        claimed = queue.claim(conn, kinds=("enrich",), owner="w", limit=10, lease_seconds=60)
    assert [job.key for job in claimed] == ["T-1"]
