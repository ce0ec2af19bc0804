"""`enrichq parity` on a real streaming standby (pg_basebackup of a private primary): the
same report as on the primary, the run recorded on the primary, and replication lag
judged by the standby's last replayed commit, so unreplayed results are too young, never
missing."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support import cluster, parity_world
from tests.support.procs import REPO, enrichq_env, wait_for

from enrichq_schema.db import ensure_database, migrate

pytestmark = pytest.mark.slow

GRACE_SECONDS = 3
RUN_FIELDS = ("run_id", "started_at", "finished_at", "duration_seconds")


def parity(env: dict[str, str], out: Path, since: datetime, until: datetime) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "enrichq_service",
            "parity",
            "--json",
            str(out),
            "--since",
            since.isoformat(),
            "--until",
            until.isoformat(),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr
    report: dict[str, Any] = json.loads(out.read_text())
    report["exit"] = proc.returncode
    return report


def same(report: dict[str, Any]) -> dict[str, Any]:
    """The report without what differs between any two runs (their id, times and clock)."""
    kept = {k: v for k, v in report.items() if k not in RUN_FIELDS}
    kept["window"] = {k: v for k, v in report["window"].items() if k in ("since", "until")}
    # where it read (the primary, or a standby and its lag) and the data time it read as of
    kept["sources"] = {k: v for k, v in report["sources"].items() if k != "read_side"}
    return kept


def seed(conn: sa.Connection, now: datetime) -> None:
    """A small world with a difference of each common kind, two days old."""
    parity_world.create_sources(conn)
    old = now - timedelta(days=2)
    for i in range(12):
        parity_world.add_ticket(
            conn,
            f"T-{i:02d}",
            created_at=old,
            legacy=[f"O{i}a", f"O{i}b"],
            shadow=[f"O{i}a", f"O{i}b"],
        )
    parity_world.add_ticket(conn, "T-partial", created_at=old, legacy=["P1", "P2"], shadow=["P1"])
    parity_world.add_ticket(conn, "T-lost", created_at=old, legacy=["L1"])
    parity_world.add_ticket(conn, "T-extra", created_at=old, legacy=["E1"], shadow=["E1", "E2"])


def write_shadow(conn: sa.Connection, ticket: str, orders: list[str]) -> None:
    """enrichq enriching `ticket` now, on the primary."""
    for order in orders:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.ticket_orders (ticket_id, order_id, customer_id, placed_at,"
                " total, looked_up_at, queue_id) VALUES (:t, :o, :c, now() - interval '1 day',"
                " 10, now(), 1)"
            ),
            {"t": ticket, "o": order, "c": f"C-{ticket}"},
        )
    conn.execute(
        sa.text(
            "INSERT INTO enrichq.ticket_enrichments (ticket_id, enriched_at, order_count,"
            " queue_id) VALUES (:t, now(), :n, 1)"
        ),
        {"t": ticket, "n": len(orders)},
    )


def mismatch_ids(report: dict[str, Any]) -> set[str]:
    return {m["ticket_id"] for group in report["mismatches"].values() for m in group}


def test_parity_on_a_standby_is_the_primary_s_report_and_lag_is_too_young(
    tmp_path: Path,
) -> None:
    cluster.require()
    with cluster.cluster() as c:
        primary_url = ensure_database(c.primary.url(), "enrichq")
        migrate(primary_url)
        standby_url = c.standby.url("enrichq")
        primary = c.engine(primary_url)
        standby = c.engine(standby_url)
        with primary.begin() as conn:
            now = conn.execute(sa.text("SELECT now()")).scalar_one()
            seed(conn, now)
        since, until = now - timedelta(days=3), now + timedelta(days=1)
        c.wait_caught_up("enrichq")
        settings = {"delay_created_seconds": 0, "parity_grace_seconds": GRACE_SECONDS}
        on_primary = enrichq_env(primary_url, **settings)
        on_standby = enrichq_env(primary_url, parity_database_url=standby_url, **settings)

        first = parity(on_primary, tmp_path / "p1.json", since, until)
        second = parity(on_standby, tmp_path / "s1.json", since, until)
        assert same(second) == same(first)
        assert first["total"]["compared"] == 15
        assert mismatch_ids(first) == {"T-partial", "T-lost", "T-extra"}
        with primary.connect() as conn:  # both runs recorded where enrichq writes
            recorded = conn.execute(sa.text("SELECT id FROM enrichq.parity_runs ORDER BY id"))
            assert recorded.scalars().all() == [first["run_id"], second["run_id"]]

        # A ticket whose mirror row replayed, but whose results have not: replay paused.
        with primary.begin() as conn:
            parity_world.add_ticket(conn, "T-lagging", created_at=now_of(conn), legacy=["G1"])
        c.wait_caught_up("enrichq")
        with standby.connect() as conn:
            conn.execute(sa.text("SELECT pg_wal_replay_pause()"))
            conn.commit()
        with primary.begin() as conn:
            write_shadow(conn, "T-lagging", ["G1"])
            created = conn.execute(
                sa.text("SELECT created_at FROM helpdesk.tickets WHERE id = 'T-lagging'")
            ).scalar_one()
        # past the grace on every clock: by now() alone, the ticket would be compared
        wait_for(
            lambda: now_of(primary) >= created + timedelta(seconds=GRACE_SECONDS + 1),
            timeout=GRACE_SECONDS + 30,
            interval=0.2,
            what="the lagging ticket to pass the grace on the primary's clock",
        )
        behind = parity(on_standby, tmp_path / "s2.json", since, until)
        ahead = parity(on_primary, tmp_path / "p2.json", since, until)
        assert "T-lagging" not in mismatch_ids(behind)
        assert behind["total"]["compared"] == 15
        assert behind["total"]["exclusions"]["too_young"] == 1
        assert ahead["total"]["compared"] == 16
        assert ahead["total"]["exclusions"]["too_young"] == 0
        assert "T-lagging" not in mismatch_ids(ahead)  # exact on the primary

        # replay resumes: the standby agrees with the primary again
        with standby.connect() as conn:
            conn.execute(sa.text("SELECT pg_wal_replay_resume()"))
            conn.commit()
        c.wait_caught_up("enrichq")
        caught_up = parity(on_standby, tmp_path / "s3.json", since, until)
        again = parity(on_primary, tmp_path / "p3.json", since, until)
        assert same(caught_up) == same(again)
        assert caught_up["total"]["compared"] == 16


def now_of(engine_or_conn: sa.Engine | sa.Connection) -> datetime:
    if isinstance(engine_or_conn, sa.Engine):
        with engine_or_conn.connect() as conn:
            return now_of(conn)
    value: datetime = engine_or_conn.execute(sa.text("SELECT now()")).scalar_one()
    return value


def test_a_run_on_a_paused_standby_does_not_gate_a_cutover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before (#27.5): a run on a standby whose replay was paused passed, became the latest
    run and gated a cutover, whatever the age of the data it read. Now the run records its
    data time and the standby's lag, the report shows them, and the gate refuses data older
    than ENRICHQ_PARITY_MAX_AGE_HOURS."""
    from enrichq_service.cli import main

    cluster.require()
    max_age_seconds = 6.0
    with cluster.cluster() as c:
        primary_url = ensure_database(c.primary.url(), "enrichq")
        migrate(primary_url)
        standby_url = c.standby.url("enrichq")
        primary = c.engine(primary_url)
        standby = c.engine(standby_url)
        with primary.begin() as conn:
            now = conn.execute(sa.text("SELECT now()")).scalar_one()
            parity_world.create_sources(conn)
            for i in range(5):
                parity_world.add_ticket(
                    conn, f"T-{i}", created_at=now - timedelta(days=2), legacy=[f"O{i}"],
                    shadow=[f"O{i}"],
                )  # fmt: skip
        c.wait_caught_up("enrichq")
        with standby.connect() as conn:
            conn.execute(sa.text("SELECT pg_wal_replay_pause()"))
            conn.commit()
        paused_at = now_of(primary)
        wait_for(
            lambda: now_of(primary) >= paused_at + timedelta(seconds=max_age_seconds + 1),
            timeout=60,
            interval=0.2,
            what="the standby's data to grow older than the bound",
        )
        settings = {"max_age_hours": max_age_seconds / 3600}
        env = enrichq_env(
            primary_url,
            parity_database_url=standby_url,
            parity_max_age_hours=settings["max_age_hours"],
        )
        report = parity(env, tmp_path / "s.json", now - timedelta(days=8), now + timedelta(days=1))
        assert report["exit"] == 0, report["verdict"]
        with primary.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO enrichq.parity_approvals (parity_run_id, approved_by, reviewer_key)"
                    " VALUES (:id, 'alice', 'alice')"
                ),
                {"id": report["run_id"]},
            )
        monkeypatch.setenv("ENRICHQ_DATABASE_URL", primary_url)
        monkeypatch.setenv("ENRICHQ_PARITY_MAX_AGE_HOURS", str(settings["max_age_hours"]))
        assert main(["cutover", "--tenant", "acme"]) == 1
        err = capsys.readouterr().err
        assert f"parity run #{report['run_id']} read data as of" in err
        assert "it read a standby" in err
        # the report and the run say how far behind the standby was
        assert report["sources"]["read_side"].startswith("a standby ")
        with primary.connect() as conn:
            lag = conn.execute(
                sa.text("SELECT replica_lag_seconds FROM enrichq.parity_runs WHERE id = :id"),
                {"id": report["run_id"]},
            ).scalar_one()
        assert lag >= max_age_seconds
        with standby.connect() as conn:
            conn.execute(sa.text("SELECT pg_wal_replay_resume()"))
            conn.commit()
        primary.dispose()
        standby.dispose()
