"""`enrichq migrate` behind a long reader of a table it must change: it gives up after a
few short lock waits, names who holds the lock, and keeps the revisions it finished."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from tests.support.pg import Databases
from tests.support.procs import enrichq_env, spawn

from enrichq_schema.db import alembic_config, create_engine, current_revision, head_revision

# A revision that creates a table of its own, just before one that changes enrichq.runs.
BEFORE_RUNS_CHANGE = "0007"
RUNS_UNTOUCHED_UNTIL = "0008"
DEADLINE_SECONDS = 60.0
# Longer than migrate's lock timeout, far shorter than the reader: a write queued behind
# migrate's pending lock must get through within it.
WRITER_LOCK_TIMEOUT = "6s"


@pytest.fixture
def empty_db(databases: Databases, request: pytest.FixtureRequest) -> str:
    label = "".join(c if c.isalnum() else "_" for c in request.node.name)[-40:]
    return databases.create_empty(label)


def test_migrate_behind_a_reader_gives_up_names_the_holder_and_keeps_finished_revisions(
    empty_db: str, tmp_path: Path
) -> None:
    command.upgrade(alembic_config(empty_db), BEFORE_RUNS_CHANGE)  # type: ignore[arg-type]
    engine = create_engine(empty_db)
    reader_engine = create_engine(empty_db, application_name="nightly-dump")
    log = tmp_path / "migrate.log"
    try:
        with reader_engine.connect() as reader, reader.begin():
            # a pg_dump, or a psql left open: ACCESS SHARE on the run log until it ends
            reader.execute(sa.text("SELECT count(*) FROM enrichq.runs")).scalar_one()
            reader_pid = reader.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            migrate = spawn(["migrate"], enrichq_env(empty_db), log=log)
            try:
                # the fleet's writes to that table queue behind migrate's pending lock,
                # never for longer than one of its short waits
                while migrate.poll() is None:
                    with engine.begin() as writer:
                        writer.execute(sa.text(f"SET LOCAL lock_timeout = '{WRITER_LOCK_TIMEOUT}'"))
                        writer.execute(
                            sa.text(
                                "INSERT INTO enrichq.runs (component, owner, started_at)"
                                " VALUES ('worker', 'w', now())"
                            )
                        )
                code = migrate.wait(timeout=DEADLINE_SECONDS)
            finally:
                if migrate.poll() is None:
                    migrate.kill()
                    migrate.wait(timeout=DEADLINE_SECONDS)
        output = log.read_text().strip()
        assert code == 1, output
        assert len(output.splitlines()) == 1, output
        assert f"pid {reader_pid}" in output, output
        assert "nightly-dump" in output, output
        with engine.connect() as conn:
            # one transaction per revision: the one before the blocked one is kept
            assert current_revision(conn) == RUNS_UNTOUCHED_UNTIL
        # the reader gone, the migration finishes
        again = spawn(["migrate"], enrichq_env(empty_db), log=tmp_path / "again.log")
        assert again.wait(timeout=DEADLINE_SECONDS) == 0
        with engine.connect() as conn:
            assert current_revision(conn) == head_revision()
    finally:
        engine.dispose()
        reader_engine.dispose()
