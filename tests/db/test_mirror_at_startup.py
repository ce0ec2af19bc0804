"""A missing or misnamed help-desk mirror (ENRICHQ_TICKETS_TABLE) is found at start-up by
every long-running command that reads it (issue #29): one line naming the setting, exit 2,
nothing started. Before, the worker raised at its first lookup (serve's took the process
down) and the sweeper failed every refresh pass."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa
from tests.support.procs import REPO, enrichq_env
from tests.support.web import free_port

COMMANDS = [["worker", "--drain"], ["sweep", "--once"], ["serve"]]


def run(db_url: str, args: list[str], **settings: object) -> subprocess.CompletedProcess[str]:
    env = enrichq_env(db_url, http_host="127.0.0.1", http_port=free_port(), **settings)
    return subprocess.run(
        [sys.executable, "-m", "enrichq_service", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("table", ["helpdesk.tickets", "helpdesk.tickts"])
def test_no_mirror_table_is_one_line_and_exit_2(
    db_url: str, db_engine: sa.Engine, command: list[str], table: str
) -> None:
    with db_engine.begin() as conn:  # the schema is there, the table named is not
        conn.execute(sa.text("CREATE SCHEMA helpdesk"))
    done = run(db_url, command, tickets_table=table)
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert "ENRICHQ_TICKETS_TABLE" in line
    assert f"{table} does not exist" in line
    with db_engine.connect() as conn:  # nothing started: no run was opened
        assert conn.execute(sa.text("SELECT count(*) FROM enrichq.runs")).scalar_one() == 0


def test_with_the_mirror_there_the_same_commands_start(db_url: str, db_engine: sa.Engine) -> None:
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE SCHEMA helpdesk; CREATE TABLE helpdesk.tickets (id text PRIMARY KEY,"
                " requester_email text, tenant text, created_at timestamptz,"
                " updated_at timestamptz)"
            )
        )
    for command in COMMANDS[:2]:
        done = run(db_url, command)
        assert done.returncode == 0, done.stderr[-2000:]
