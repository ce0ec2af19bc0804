"""A second `enrichq worker` (or sweeper) on one machine finds the metrics port taken: one
line naming ENRICHQ_METRICS_PORT and exit 2, not a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from tests.support.procs import REPO, enrichq_env

from enrichq_service.seed import create_external_tables


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("command", [["worker", "--drain"], ["sweep"]])
def test_a_taken_metrics_port_is_one_line_and_exit_2(
    db_url: str, db_engine: sa.Engine, taken_port: int, command: list[str]
) -> None:
    with db_engine.begin() as conn:  # the mirror both read (checked before the port)
        create_external_tables(conn)
    done = subprocess.run(
        [sys.executable, "-m", "enrichq_service", *command],
        cwd=REPO,
        env=enrichq_env(db_url, ENRICHQ_METRICS_PORT=taken_port),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert f"port {taken_port}" in lines[0]
    assert "ENRICHQ_METRICS_PORT" in lines[0]
