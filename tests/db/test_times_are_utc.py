"""Every time enrichq shows as UTC is UTC, whatever the server's `TimeZone`: a database set to
America/New_York must not make "14:26 UTC" read "09:26 UTC"."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.parity_world import add_ticket, create_sources, seed

from enrichq_schema.db import create_engine
from enrichq_service.cli import main

CREATED = datetime.now(UTC).replace(microsecond=0) - timedelta(days=2)


@pytest.fixture
def new_york(db_url: str, db_engine: sa.Engine) -> str:
    """The test database with New York as its default time zone (new sessions get it)."""
    name = sa.make_url(db_url).database
    with db_engine.connect() as conn:
        conn.execute(sa.text(f'ALTER DATABASE "{name}" SET "TimeZone" = \'America/New_York\''))
        conn.commit()
    db_engine.dispose()
    return db_url


def test_an_enrichq_session_reads_times_in_utc_whatever_the_server_zone(new_york: str) -> None:
    engine = create_engine(new_york)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW TimeZone")).scalar_one() == "UTC"
            at = conn.execute(sa.text("SELECT now()")).scalar_one()
    finally:
        engine.dispose()
    assert at.utcoffset() == timedelta(0)


def _shown(text: str) -> set[str]:
    """Every "YYYY-MM-DD HH:MM" the text shows."""
    return set(re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d", text))


def test_approve_runs_and_the_report_show_utc(
    new_york: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    def exact(conn: sa.Connection) -> None:
        create_sources(conn)
        for i in range(10):
            add_ticket(conn, f"T-{i}", created_at=CREATED, legacy=[f"O{i}"], shadow=[f"O{i}"])

    admin = create_engine(new_york)
    seed(admin, exact)
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", new_york)
    assert main(["parity"]) == 0
    capsys.readouterr()
    with admin.connect() as conn:
        conn.exec_driver_sql("SET TimeZone = 'America/New_York'")
        run_id, finished = conn.execute(
            sa.text(
                "SELECT id, to_char(timezone('UTC', finished_at), 'YYYY-MM-DD HH24:MI')"
                " FROM enrichq.parity_runs"
            )
        ).one()
    assert main(["parity", "approve", str(run_id), "--by", "alice"]) == 0
    approve_out = capsys.readouterr().out
    with admin.connect() as conn:
        approved = conn.execute(
            sa.text(
                "SELECT to_char(timezone('UTC', approved_at), 'YYYY-MM-DD HH24:MI')"
                " FROM enrichq.parity_approvals"
            )
        ).scalar_one()
    admin.dispose()
    assert _shown(approve_out) == {approved}
    assert main(["parity", "runs"]) == 0
    assert finished in _shown(capsys.readouterr().out)
    html = tmp_path / "p.html"
    assert main(["parity", "show", str(run_id), "--html", str(html)]) == 0
    shown = _shown(html.read_text())
    assert {finished, approved} <= shown
