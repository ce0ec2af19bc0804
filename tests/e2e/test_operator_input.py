"""Ordinary mistakes in arguments and URLs end in one line and exit 2, never a traceback:
bytes that are not UTF-8, blank or padded ids and tenants (the CLI and HTTP apply one rule),
bad values of known connection options."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa
from tests.support.db import q
from tests.support.procs import REPO, enrichq_env


def _run(args: list[str | bytes], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "enrichq_service", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
        check=False,
    )


BAD_ARGUMENTS: dict[str, list[str | bytes]] = {
    "key": ["enqueue", b"bad\xffkey"],
    "tenant": ["enqueue", "T-1", "--tenant", b"acme\xff"],
    "cancel key": ["cancel", "--key", b"T-\xfe", "--dry-run"],
    "reason": ["pause", "--tenant", "acme", "--reason", b"why\xff"],
    "actor": ["cancel", "--all", "--dry-run", "--actor", b"al\xffice"],
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS, ids=list(BAD_ARGUMENTS))
def test_bytes_that_are_not_utf8_are_one_line(db_url: str, db_engine: sa.Engine, case: str) -> None:
    done = _run(BAD_ARGUMENTS[case], enrichq_env(db_url))
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert "not valid UTF-8" in line
    assert q(db_engine, "SELECT count(*) FROM enrichq.queue") == [(0,)]


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["enqueue", "T-1", "--tenant", "   "], "tenant"),
        (["enqueue", "  T-1  "], "key"),
        (["enqueue", "T-1", "--tenant", " acme"], "tenant"),
    ],
)
def test_blank_or_padded_ids_are_refused(
    db_url: str, db_engine: sa.Engine, args: list[str], problem: str
) -> None:
    done = _run(list(args), enrichq_env(db_url))
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"enrichq: {problem}: ")
    assert q(db_engine, "SELECT count(*) FROM enrichq.queue") == [(0,)]


@pytest.mark.parametrize("option", ["connect_timeout=abc", "port=abc", "keepalives_idle=-1"])
def test_bad_values_of_known_url_options_are_one_line(db_url: str, option: str) -> None:
    name, _, value = option.partition("=")
    url = sa.make_url(db_url).update_query_dict({name: value})
    done = _run(["status"], enrichq_env(url.render_as_string(hide_password=False)))
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    assert "ENRICHQ_DATABASE_URL" in line
    assert name in line
