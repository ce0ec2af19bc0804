"""`enrichq pause` and `resume` against a running `enrichq worker` process: obeyed at its
next claim without a restart, leases already held finish normally, ingest goes on, and a
resume wakes the worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.db import q
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.settings import make_settings

from enrichq_service import queue, seed
from enrichq_service.cli import main
from enrichq_service.queue import EnqueueRequest

pytestmark = pytest.mark.slow

POLL_SECONDS = 0.5


def enqueue_all(engine: sa.Engine, url: str, tenant: str | None = None) -> None:
    with engine.begin() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, tenant FROM helpdesk.tickets WHERE CAST(:tenant AS text) IS NULL OR tenant = :tenant"
            ),
            {"tenant": tenant},
        ).all()
        queue.enqueue(
            conn,
            [EnqueueRequest.build(key=r.id, tenant=r.tenant) for r in rows],
            settings=make_settings(url),
        )


def states(engine: sa.Engine, tenant: str) -> dict[str, int]:
    return dict(
        q(  # (state, count) pairs
            engine,
            "SELECT state, count(*) FROM enrichq.queue WHERE tenant = :t GROUP BY state",
            t=tenant,
        )
    )


def test_a_running_worker_obeys_pause_and_resume(
    db_url: str, db_engine: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", db_url)
    with db_engine.begin() as conn:
        seed.seed_world(conn, tickets=60)
    env = enrichq_env(
        db_url,
        enricher="tests.support.enrichers:slow",
        ENRICHQ_TEST_SLOW_SECONDS=0.4,
        concurrency=4,
        poll_seconds=POLL_SECONDS,
        lease_seconds=10,
        heartbeat_seconds=1,
    )
    worker = spawn(["worker"], env, log=tmp_path / "worker.log")
    try:
        assert main(["pause", "--tenant", "acme", "--reason", "test", "--actor", "ops"]) == 0
        enqueue_all(db_engine, db_url)
        # globex is paused while the worker holds some of its rows: those finish normally
        wait_for(lambda: states(db_engine, "globex").get("leased", 0) > 0, what="a globex lease")
        assert main(["pause", "--tenant", "globex", "--actor", "ops"]) == 0
        held = q(
            db_engine, "SELECT id FROM enrichq.queue WHERE tenant = 'globex' AND state = 'leased'"
        )
        wait_for(
            lambda: (
                states(db_engine, "initech")
                == {"done": states(db_engine, "initech").get("done", -1)}
                and states(db_engine, "globex").get("leased", 0) == 0
            ),
            timeout=60,
            what="initech done and globex's leases settled",
        )
        assert {
            state
            for (state,) in q(
                db_engine,
                "SELECT state FROM enrichq.queue WHERE id = ANY(:ids)",
                ids=[i for (i,) in held],
            )
        } == {"done"}
        # nothing paused is claimed, for several poll intervals
        paused_before = {t: states(db_engine, t) for t in ("acme", "globex")}
        assert set(paused_before["acme"]) == {"queued"}
        assert paused_before["globex"].get("queued", 0) > 0
        time.sleep(4 * POLL_SECONDS)
        assert {t: states(db_engine, t) for t in ("acme", "globex")} == paused_before
        # ingest goes on while paused: a second event for each acme ticket merges
        enqueue_all(db_engine, db_url, tenant="acme")
        assert states(db_engine, "acme") == paused_before["acme"]
        # one resume at a time: acme first, then globex; the worker needs no restart
        assert main(["resume", "--tenant", "acme", "--actor", "ops"]) == 0
        wait_for(lambda: set(states(db_engine, "acme")) == {"done"}, timeout=60, what="acme done")
        assert states(db_engine, "globex") == paused_before["globex"]
        assert main(["resume", "--tenant", "globex", "--actor", "ops"]) == 0
        wait_for(
            lambda: set(states(db_engine, "globex")) == {"done"}, timeout=60, what="globex done"
        )
        assert worker.poll() is None
    finally:
        stop(worker)
    assert q(db_engine, "SELECT max(attempts) FROM enrichq.queue") == [(1,)]
