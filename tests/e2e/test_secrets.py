"""No secret of a database URL reaches an operator's screen or a log: not the password of
the userinfo, not libpq's `password` or `sslpassword` options, not part of a password that
an unescaped character cut, whatever command prints it and however it fails."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa
from tests.support.procs import REPO, enrichq_env

SECRET = "S3cr3tPw-do-not-print"


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "enrichq_service", *args],
        cwd=REPO,
        env={**env, "ENRICHQ_LOG_LEVEL": "DEBUG"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _with_query(url: str, **options: str) -> str:
    return sa.make_url(url).update_query_dict(options).render_as_string(hide_password=False)


@pytest.mark.parametrize("option", ["password", "sslpassword"])
def test_libpq_secret_options_never_reach_the_output(db_url: str, option: str) -> None:
    url = _with_query(db_url, **{option: SECRET})
    env = enrichq_env(url)
    outputs = [
        _run(["migrate"], env),
        _run(["status"], env),
        _run(["status", "--json"], env),
        _run(["enqueue", "T-1", "--reason", "manual"], env),
        _run(["worker", "--drain"], env),
        _run(["sweep", "--once"], env),
    ]
    for done in outputs:
        assert SECRET not in done.stdout + done.stderr, done.args
    assert outputs[0].returncode == 0, outputs[0].stderr


def test_a_failing_connection_does_not_print_the_password(db_url: str) -> None:
    # nothing listens on port 1: the connection error names host and port, never the secret
    url = sa.URL.create(
        "postgresql", "postgres", SECRET, "127.0.0.1", 1, "enrichq", {"password": SECRET}
    )
    done = _run(["status"], enrichq_env(url.render_as_string(hide_password=False)))
    assert done.returncode != 0
    assert SECRET not in done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_password_with_an_unescaped_at_is_refused_without_printing_it(db_url: str) -> None:
    base = sa.make_url(db_url)
    url = f"postgresql://postgres:tPa@zzqxw@{base.host or '127.0.0.1'}:{base.port or 5432}/x"
    done = _run(["status"], enrichq_env(url))
    assert done.returncode == 2
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1
    assert "%40" in err
    for part in ("tPa", "zzqxw"):
        assert part not in err
