"""The worker's connections: the claim engine's session settings, prepared statements,
and a kept connection that survives its backend being killed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from tests.support.settings import make_settings
from tests.support.world import seeded

from enrichq_service import queue
from enrichq_service.queue import EnqueueRequest
from enrichq_service.worker import ThreadConnection, Worker, WorkerEngines, build_engines


@pytest.fixture
def engines(db_url: str) -> Iterator[WorkerEngines]:
    built = build_engines(make_settings(db_url), db_url)
    yield built
    built.dispose()


def session_settings(engine: sa.Engine) -> tuple[str, str]:
    with engine.connect() as conn:
        return (
            conn.execute(sa.text("SHOW plan_cache_mode")).scalar_one(),
            conn.execute(sa.text("SHOW synchronous_commit")).scalar_one(),
        )


def prepared_statements(conn: sa.Connection) -> dict[str, tuple[int, int]]:
    """The statements prepared on this session: first words → (generic, custom) plan counts."""
    found = conn.execute(
        sa.text("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
    ).all()
    return {" ".join(r.statement.split()[:3]): (r.generic_plans, r.custom_plans) for r in found}


def enqueue(engine: sa.Engine, n: int) -> None:
    with engine.begin() as conn:
        queue.enqueue(
            conn, [EnqueueRequest.build(key=f"T-{i}") for i in range(n)], settings=make_settings()
        )


def test_only_the_claim_engine_forces_generic_plans_and_asynchronous_commits(
    engines: WorkerEngines,
) -> None:
    assert session_settings(engines.claims) == ("force_generic_plan", "off")
    assert session_settings(engines.queue) == ("auto", "on")
    assert session_settings(engines.warehouse) == ("auto", "on")


def test_claims_run_prepared_on_their_generic_plan(engines: WorkerEngines) -> None:
    enqueue(engines.queue, 30)
    with engines.claims.connect() as conn:
        for _ in range(3):
            with conn.begin():
                jobs = queue.claim(conn, kinds=("enrich",), owner="w", limit=10, lease_seconds=30)
            assert len(jobs) == 10
        # an unmarked statement, however often it runs, is never prepared
        for _ in range(10):
            conn.execute(sa.text("SELECT count(*) FROM enrichq.queue WHERE key = :k"), {"k": "x"})
        statements = prepared_statements(conn)
        conn.rollback()
    assert statements == {"WITH RECURSIVE clock": (3, 0)}


def test_a_kept_connection_is_replaced_after_its_backend_dies(engines: WorkerEngines) -> None:
    kept = ThreadConnection(engines.claims)
    try:
        with kept.begin() as conn:
            pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with kept.begin() as conn:  # the same session between transactions
            assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() == pid
        with engines.queue.connect() as admin:
            admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(sa_exc.DBAPIError), kept.begin() as conn:
            conn.execute(sa.text("SELECT 1"))
        with kept.begin() as conn:  # no ping: one failure, then a fresh session
            assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() != pid
    finally:
        kept.close()


def test_the_worker_drains_on_its_own_engines(db_url: str, engines: WorkerEngines) -> None:
    seeded(engines.queue, 40)
    worker = Worker(
        make_settings(db_url, concurrency=8),
        engines.queue,
        warehouse=engines.warehouse,
        claims=engines.claims,
    )
    result = worker.run(drain=True)
    assert result.counts["done"] == 40
    with engines.queue.connect() as conn:
        states = conn.execute(sa.text("SELECT state, count(*) FROM enrichq.queue GROUP BY 1"))
        assert states.all() == [("done", 40)]
