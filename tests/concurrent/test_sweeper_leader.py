"""One active sweeper among replicas: two real `enrichq sweep` processes, kill -9 the leader."""

from __future__ import annotations

import signal
import socket
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
import sqlalchemy as sa
from tests.support.db import execute, insert_expired_leases, q
from tests.support.procs import enrichq_env, spawn, wait_for
from tests.support.settings import make_settings
from tests.support.tcpproxy import TcpProxy, target_of, via

from enrichq_sweeper.leader import SWEEPER_LOCK_ID, leadership, takeover_seconds

DEADLINE_SECONDS = 30.0
T = TypeVar("T")

HOLDERS = sa.text(
    """
    SELECT a.application_name
    FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.database = (
            SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = CAST(:hi AS oid) AND l.objid = CAST(:lo AS oid) AND l.objsubid = 1
    """
)


class Sweeper:
    """One `enrichq sweep` process with its output in a file."""

    def __init__(
        self,
        db_url: str,
        log: Path,
        metrics_port: int = 0,
        settings: dict[str, object] | None = None,
    ) -> None:
        values: dict[str, object] = {"sweep_interval_seconds": 0.2, **(settings or {})}
        env = enrichq_env(db_url, metrics_port=metrics_port, log_level="INFO", **values)
        self.log = log
        self.proc = spawn(["sweep"], env, log=log)
        self.owner = f"{socket.gethostname()}:{self.proc.pid}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=DEADLINE_SECONDS)


@pytest.fixture
def sweepers(db_url: str, tmp_path: Path) -> Iterator[list[Sweeper]]:
    started = [Sweeper(db_url, tmp_path / f"sweeper-{i}.log") for i in range(2)]
    try:
        yield started
    finally:
        for s in started:
            s.stop()


def lock_holders(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        names = conn.execute(
            HOLDERS, {"hi": SWEEPER_LOCK_ID >> 32, "lo": SWEEPER_LOCK_ID & 0xFFFFFFFF}
        ).scalars()
        return [str(n) for n in names]


def connected(engine: sa.Engine) -> str:
    """The application names of every session on this database, as one string."""
    with engine.connect() as conn:
        names = conn.execute(
            sa.text(
                "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
            )
        ).scalars()
        return " ".join(str(n) for n in names)


def leased(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM enrichq.queue WHERE state = 'leased'")
            ).scalar_one()
        )


def recovering_owners(engine: sa.Engine) -> set[str]:
    """Owners of the run-log rows of recovery passes that recovered something."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT DISTINCT owner FROM enrichq.runs WHERE counts->>'task' = 'recovery'"
                " AND (counts->>'promoted')::int + (counts->>'superseded')::int > 0"
            )
        ).scalars()
        return set(rows)


def test_only_the_leader_sweeps_and_the_other_takes_over_when_it_dies(
    db_engine: sa.Engine, sweepers: list[Sweeper]
) -> None:
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE SCHEMA helpdesk; CREATE TABLE helpdesk.tickets (id text PRIMARY KEY,"
                " requester_email text, tenant text, created_at timestamptz,"
                " updated_at timestamptz)"
            )
        )
    by_owner = {s.owner: s for s in sweepers}

    def leader() -> Sweeper | None:
        for name in lock_holders(db_engine):
            for owner, sweeper in by_owner.items():
                if name.endswith(owner):
                    return sweeper
        return None

    first = wait_for(leader, what="a leader", timeout=DEADLINE_SECONDS)
    [second] = [s for s in sweepers if s is not first]
    # the follower is alive and connected for its tries, but holds nothing
    wait_for(
        lambda: second.owner in connected(db_engine),
        what="the follower to connect",
        timeout=DEADLINE_SECONDS,
    )
    assert second.proc.poll() is None

    insert_expired_leases(db_engine, ["T-1", "T-2"])
    wait_for(
        lambda: leased(db_engine) == 0,
        what="the leader to recover the leases",
        timeout=DEADLINE_SECONDS,
    )
    # the pass's run-log row is closed (with its counts) just after its batch commits
    wait_for(
        lambda: recovering_owners(db_engine),
        what="the recovery pass's run-log row",
        timeout=DEADLINE_SECONDS,
    )
    assert recovering_owners(db_engine) == {first.owner}
    with db_engine.connect() as conn:
        passes_by = set(conn.execute(sa.text("SELECT DISTINCT owner FROM enrichq.runs")).scalars())
        states = conn.execute(sa.text("SELECT key, state FROM enrichq.queue ORDER BY id")).all()
    assert passes_by == {first.owner}, "the follower ran a pass"
    assert [tuple(r) for r in states] == [("T-1", "queued"), ("T-2", "queued")]

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=DEADLINE_SECONDS)
    assert wait_for(leader, what="the follower to take over", timeout=DEADLINE_SECONDS) is second

    insert_expired_leases(db_engine, ["T-3"])
    wait_for(
        lambda: leased(db_engine) == 0,
        what="the new leader to recover the leases",
        timeout=DEADLINE_SECONDS,
    )
    wait_for(
        lambda: second.owner in recovering_owners(db_engine),
        what="the new leader's run-log row",
        timeout=DEADLINE_SECONDS,
    )
    assert recovering_owners(db_engine) == {first.owner, second.owner}
    with db_engine.connect() as conn:
        t3 = conn.execute(
            sa.text("SELECT state FROM enrichq.queue WHERE key = 'T-3' ORDER BY id")
        ).scalars()
        assert list(t3) == ["queued"]

    # SIGTERM: a clean stop, exit 0, the lock given back
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(timeout=DEADLINE_SECONDS) == 0, second.output()
    assert lock_holders(db_engine) == []
    assert "stopped" in second.output()


def test_a_leader_whose_lock_session_dies_steps_down_and_leads_again(
    db_engine: sa.Engine, db_url: str, tmp_path: Path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sweeper = Sweeper(db_url, tmp_path / "sweeper.log", metrics_port=port)

    def is_leader() -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                body = resp.read().decode()
        except OSError:
            return None
        return next(
            (ln for ln in body.splitlines() if ln.startswith("enrichq_sweeper_is_leader ")), None
        )

    try:
        with db_engine.begin() as conn:
            conn.execute(
                sa.text(
                    "CREATE SCHEMA helpdesk; CREATE TABLE helpdesk.tickets (id text, updated_at timestamptz)"
                )
            )

        def lock_session() -> int | None:
            with db_engine.connect() as conn:
                pid = conn.execute(
                    sa.text(
                        "SELECT l.pid FROM pg_locks AS l JOIN pg_stat_activity AS a"
                        " ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted"
                        " AND a.application_name LIKE '%' || :owner"
                    ),
                    {"owner": sweeper.owner},
                ).scalar()
                return None if pid is None else int(pid)

        first_session = wait_for(lock_session, what="the sweeper to lead", timeout=DEADLINE_SECONDS)
        wait_for(
            lambda: is_leader() == "enrichq_sweeper_is_leader 1.0",
            what="/metrics to show the leader",
            timeout=DEADLINE_SECONDS,
        )
        with db_engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first_session})
        wait_for(
            lambda: (lock_session() or first_session) != first_session,
            what="the sweeper to lead again on a new session",
            timeout=DEADLINE_SECONDS,
        )
        assert "lost the leader lock" in sweeper.output()
        assert sweeper.proc.poll() is None
        insert_expired_leases(db_engine, ["T-1"])
        wait_for(
            lambda: leased(db_engine) == 0,
            what="the leases to be recovered",
            timeout=DEADLINE_SECONDS,
        )
        sweeper.proc.send_signal(signal.SIGTERM)
        assert sweeper.proc.wait(timeout=DEADLINE_SECONDS) == 0, sweeper.output()
    finally:
        sweeper.stop()


# The partitioned leader's settings: a check a second, network timeouts of 2 s.
PARTITION_SETTINGS: dict[str, object] = {
    "sweep_interval_seconds": 1.0,
    "network_timeout_seconds": 2.0,
}
# What a process start, a reconnect and a busy machine may add to the documented bound.
TAKEOVER_SLACK_SECONDS = 10.0


def test_a_leader_cut_off_from_the_database_is_replaced_within_the_documented_bound(
    db_engine: sa.Engine, db_url: str, tmp_path: Path
) -> None:
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE SCHEMA helpdesk; CREATE TABLE helpdesk.tickets (id text PRIMARY KEY,"
                " requester_email text, tenant text, created_at timestamptz,"
                " updated_at timestamptz)"
            )
        )
    bound = takeover_seconds(make_settings(db_url, **PARTITION_SETTINGS))
    with TcpProxy(target_of(db_url)) as proxy:
        cut_off = Sweeper(via(proxy, db_url), tmp_path / "cut-off.log", settings=PARTITION_SETTINGS)
        standby: Sweeper | None = None
        try:

            def leader_name() -> str | None:
                return next(iter(lock_holders(db_engine)), None)

            wait_for(
                lambda: (leader_name() or "").endswith(cut_off.owner),
                what="the proxied sweeper to lead",
                timeout=DEADLINE_SECONDS,
            )
            standby = Sweeper(db_url, tmp_path / "standby.log", settings=PARTITION_SETTINGS)
            wait_for(
                lambda: standby is not None and standby.owner in connected(db_engine),
                what="the standby to connect",
                timeout=DEADLINE_SECONDS,
            )
            # the network between the leader and the database goes silent: no FIN, no RST
            proxy.blackhole()
            wait_for(
                lambda: (leader_name() or "").endswith(standby.owner) if standby else False,
                what=f"the standby to take over within the documented {bound:g} s",
                timeout=bound + TAKEOVER_SLACK_SECONDS,
            )
            insert_expired_leases(db_engine, ["P-1"])
            wait_for(
                lambda: leased(db_engine) == 0,
                what="the new leader to recover the lease",
                timeout=DEADLINE_SECONDS,
            )
            # the old leader noticed it was cut off and stepped down
            assert "lost the leader lock" in cut_off.output()
            assert cut_off.proc.poll() is None
            proxy.heal()
            # healed, the old leader follows: the standby keeps the lock
            insert_expired_leases(db_engine, ["P-2"])
            wait_for(
                lambda: leased(db_engine) == 0,
                what="the leader to recover after the heal",
                timeout=DEADLINE_SECONDS,
            )
            assert [n for n in lock_holders(db_engine) if n.endswith(standby.owner)]
            assert len(lock_holders(db_engine)) == 1
        finally:
            cut_off.stop()
            if standby is not None:
                standby.stop()


# The gave-up hook of the long pass below: each page of spent rows takes this long.
SLOW_HOOK_SECONDS = 3.0
PAGE_ROWS = 1000  # enrichq_sweeper.common.DEFAULT_BATCH_SIZE


def slow_gave_up(rows: Sequence[object]) -> None:
    """A gave-up hook that takes SLOW_HOOK_SECONDS per page (runs in the sweeper)."""
    time.sleep(SLOW_HOOK_SECONDS)


def insert_spent_leases(engine: sa.Engine, n: int) -> None:
    """`n` expired leases whose attempts are spent, one ticket each."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts,"
                " lease_owner, lease_expires_at)"
                " SELECT 'enrich', 'S-' || i, 'created', 'leased', 5, 5, 'dead-worker',"
                " now() - interval '1 minute' FROM generate_series(1, :n) AS i"
            ),
            {"n": n},
        )


def test_a_sweep_once_pass_longer_than_its_lease_keeps_leading_until_it_is_taken(
    db_engine: sa.Engine, db_url: str, tmp_path: Path
) -> None:
    with db_engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE SCHEMA helpdesk; CREATE TABLE helpdesk.tickets (id text PRIMARY KEY,"
                " requester_email text, tenant text, created_at timestamptz,"
                " updated_at timestamptz)"
            )
        )
    insert_spent_leases(db_engine, PAGE_ROWS + PAGE_ROWS // 2)
    values: dict[str, object] = {
        "pool_mode": "transaction",
        "sweep_interval_seconds": 0.2,  # a check of 0.2 s: a lease of 1.2 s
        "gave_up_hook": f"{__name__}:slow_gave_up",
    }
    settings = make_settings(db_url, **values)
    env = enrichq_env(db_url, log_level="INFO", **values)
    once = spawn(["sweep", "--once"], env, log=tmp_path / "once.log")
    other = leadership(settings, db_url, owner="another-replica", check_seconds=0.2)
    dead = "SELECT count(*) FROM enrichq.queue WHERE state = 'dead_letter'"
    try:
        # the first page is done and its hook runs for SLOW_HOOK_SECONDS
        wait_for(lambda: q(db_engine, dead)[0][0] >= PAGE_ROWS, what="the first page")
        [(acquired,)] = q(db_engine, "SELECT acquired_at FROM enrichq.leader_leases")
        # past the lease the pass started with: it was renewed, nobody else may lead
        wait_for(
            lambda: q(
                db_engine,
                "SELECT now() > CAST(:at AS timestamptz) + interval '1.5 s'",
                at=acquired,
            )[0][0],
            what="the first lease to run out",
        )
        assert once.poll() is None, "the pass ended before its lease did"
        assert not other.try_acquire(), "a second sweeper leads during the pass"
        # the leadership is taken from it: the pass stops before its next page
        execute(
            db_engine,
            "UPDATE enrichq.leader_leases SET owner = 'thief', expires_at = now() + interval '1 h'",
        )
        assert once.wait(timeout=DEADLINE_SECONDS) == 1
        assert q(db_engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'leased'") == [
            (PAGE_ROWS // 2,)
        ]
        assert "leadership" in (tmp_path / "once.log").read_text()
    finally:
        other.close()
        if once.poll() is None:
            once.kill()
            once.wait(timeout=DEADLINE_SECONDS)


def test_two_replicas_of_one_host_name_and_pid_never_both_lead(db_url: str) -> None:
    settings = make_settings(db_url, pool_mode="transaction")
    # two containers, each its own pid 1, with the same host name
    first = leadership(settings, db_url, owner="sweeper-0:1", check_seconds=1.0)
    second = leadership(settings, db_url, owner="sweeper-0:1", check_seconds=1.0)
    try:
        assert first.try_acquire()
        assert not second.try_acquire()
        assert first.still_held()
        assert not second.still_held()
    finally:
        first.close()
        second.close()
