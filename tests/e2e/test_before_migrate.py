"""`enrichq worker` and `enrichq sweep` started before `enrichq migrate`: they wait for the
schema and say so (a line every few seconds), then work once it is there; with --no-wait
they exit 2 in one line. Never a traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.parity_world import create_sources
from tests.support.pg import Databases
from tests.support.procs import REPO, enrichq_env, spawn, stop, wait_for

from enrichq_schema.db import migrate


@pytest.fixture
def unmigrated(databases: Databases) -> Iterator[str]:
    """A database with the help desk's mirror, the warehouse and the legacy output, where
    `enrichq migrate` has not run yet."""
    url = databases.create_empty("unmigrated")
    engine = sa.create_engine(sa.make_url(url).set(drivername="postgresql+psycopg"))
    try:
        with engine.begin() as conn:
            create_sources(conn)
    finally:
        engine.dispose()
    yield url
    databases.drop(url)


@pytest.mark.parametrize("command", [["worker", "--drain"], ["sweep", "--once"]])
def test_told_not_to_wait_it_is_one_line_and_exit_2(unmigrated: str, command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "enrichq_service", *command, "--no-wait"],
        cwd=REPO,
        env=enrichq_env(unmigrated),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert "is at revision none" in line
    assert "run `enrichq migrate`" in line


@pytest.mark.parametrize("command", [["worker", "--drain"], ["sweep", "--once"]])
def test_it_waits_for_the_schema_then_works(
    unmigrated: str, command: list[str], tmp_path: Path
) -> None:
    log = tmp_path / "out.log"
    proc = spawn(command, {**enrichq_env(unmigrated), "ENRICHQ_LOG_LEVEL": "INFO"}, log=log)
    try:
        wait_for(
            lambda: "waits for the schema" in log.read_text(errors="replace"),
            timeout=60,
            what="the waiting line",
        )
        assert proc.poll() is None  # waiting, not dead
        migrate(unmigrated)
        code = proc.wait(timeout=120)
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    assert code == 0, text[-2000:]
    assert "Traceback" not in text
    engine = sa.create_engine(sa.make_url(unmigrated).set(drivername="postgresql+psycopg"))
    try:
        with engine.connect() as conn:
            runs = conn.execute(sa.text("SELECT count(*) FROM enrichq.runs")).scalar_one()
    finally:
        engine.dispose()
    assert runs >= 1
