"""Shadow mode enforced by the database: the worker, under the service role, cannot write legacy."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.db import q
from tests.support.procs import enrichq_env, spawn
from tests.support.roles import service_role
from tests.support.world import seeded

pytestmark = pytest.mark.slow


def test_worker_under_the_service_role_enriches_but_cannot_write_legacy(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    seeded(db_engine, 10)
    legacy_before = q(db_engine, "SELECT count(*) FROM legacy.ticket_orders")
    with service_role(db_url) as (_role, login_url):
        worker = spawn(
            ["worker", "--drain"],
            enrichq_env(login_url, enricher="tests.support.enrichers:tries_legacy_write"),
            log=tmp_path / "worker.log",
        )
        assert worker.wait(120) == 0, (tmp_path / "worker.log").read_text()[-2000:]
    assert q(db_engine, "SELECT state, count(*) FROM enrichq.queue GROUP BY 1") == [("done", 10)]
    # every attempt to write the legacy output was refused by the database itself
    assert q(db_engine, "SELECT DISTINCT job_id FROM enrichq.lookup_log") == [
        ("legacy-write-refused",)
    ]
    assert q(db_engine, "SELECT count(*) FROM legacy.ticket_orders") == legacy_before
    assert q(db_engine, "SELECT count(*) FROM enrichq.ticket_enrichments") == [(10,)]
