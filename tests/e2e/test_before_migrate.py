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


def test_serve_waits_for_the_schema_and_readyz_says_why(unmigrated: str, tmp_path: Path) -> None:
    """`enrichq serve` before `enrichq migrate` printed a 176-line traceback and exited 1;
    it now serves /readyz (503, saying to migrate) while its worker waits, and with
    --no-wait exits 2 in one line."""
    import httpx
    from tests.support.web import free_port

    port = free_port()
    # a secret: without one serve warns at start-up (tests/db/test_http_robustness.py)
    env = {
        **enrichq_env(
            unmigrated, http_host="127.0.0.1", http_port=port, webhook_secret="before-migrate"
        )
    }
    refused = subprocess.run(
        [sys.executable, "-m", "enrichq_service", "serve", "--no-wait"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
    log = tmp_path / "serve.log"
    proc = spawn(["serve"], {**env, "ENRICHQ_LOG_LEVEL": "INFO"}, log=log)
    try:
        base = f"http://127.0.0.1:{port}"

        def readyz() -> httpx.Response | None:
            try:
                return httpx.get(f"{base}/readyz", timeout=5)
            except httpx.HTTPError:
                return None

        first = wait_for(readyz, timeout=60, what="/readyz")
        assert first.status_code == 503
        assert "run `enrichq migrate`" in first.json()["detail"]
        migrate(unmigrated)
        wait_for(
            lambda: (r := readyz()) is not None and r.status_code == 200,
            timeout=60,
            what="/readyz once migrated",
        )
    finally:
        code = stop(proc)
    text = log.read_text(errors="replace")
    assert code == 0, text[-2000:]
    assert "waits for the schema" in text
    assert "Traceback" not in text
