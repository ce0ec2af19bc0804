"""Fault-injection scenarios with real processes, shared by the tests and the report.

Each scenario seeds a world, enqueues every ticket, runs several `enrichq worker`
processes and an `enrichq sweep` with a short lease, injects its fault, waits until the
queue is quiet, and returns what happened. `check()` then holds it to the promise: every
ticket done with exactly its expected orders, each ticket's result written once, by the
attempt that held the lease, and the queue's invariants intact.

A trigger on `enrichq.ticket_enrichments` (installed only in the scenario's database)
records every result write, so a second write for a ticket cannot go unseen.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from enrichq_schema.db import create_engine
from enrichq_schema.states import LEASE_EXPIRED_ERROR
from enrichq_service import seed
from tests.support import cluster, pgbouncer
from tests.support.commit_cutter import CommitCutter
from tests.support.db import q
from tests.support.enrichers import BAD_FIELDS, bad_data_fate
from tests.support.pgbouncer import PgBouncer
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.tcpproxy import TcpProxy, target_of, via
from tests.support.web import free_port
from tests.support.world import seeded

AUDIT = """
CREATE TABLE IF NOT EXISTS public.result_writes (
    ticket_id text NOT NULL, queue_id bigint NOT NULL, at timestamptz NOT NULL DEFAULT now()
);
CREATE OR REPLACE FUNCTION public.audit_result_write() RETURNS trigger AS $$
BEGIN
    INSERT INTO public.result_writes (ticket_id, queue_id) VALUES (NEW.ticket_id, NEW.queue_id);
    RETURN NEW;
END $$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS audit_result_write ON enrichq.ticket_enrichments;
CREATE TRIGGER audit_result_write AFTER INSERT OR UPDATE ON enrichq.ticket_enrichments
    FOR EACH ROW EXECUTE FUNCTION public.audit_result_write();
"""

FAST = {
    "lease_seconds": 3,
    "heartbeat_seconds": 0.5,
    "poll_seconds": 0.2,
    "sweep_interval_seconds": 0.5,
    "backoff_base_seconds": 0.2,
    "backoff_cap_seconds": 1,
    "max_attempts": 10,
    "concurrency": 8,
}


@dataclass
class Outcome:
    """What one scenario did and what it found."""

    name: str
    tickets: int
    faults: int = 0
    seconds: float = 0.0
    recover_seconds: list[float] = field(default_factory=list)
    lost: int = 0
    duplicate_writes: int = 0
    fenced: int = 0
    not_done: int = 0
    wrong_orders: int = 0
    dead_letters: int = 0
    notes: str = ""

    @property
    def time_to_recover(self) -> float:
        return max(self.recover_seconds, default=0.0)


def prepare(
    engine: sa.Engine,
    tickets: int,
    *,
    extra_keys: tuple[str, ...] = (),
    max_attempts: int = int(FAST["max_attempts"]),
) -> list[str]:
    """Seed the world, enqueue every ticket and install the audit trigger; the keys."""
    keys = seeded(engine, tickets, extra=extra_keys, max_attempts=max_attempts)
    with engine.begin() as conn:
        conn.execute(sa.text(AUDIT))
    return keys


@dataclass
class Run:
    """One scenario's database, its world and its outcome; `seconds` counts from the moment
    its work was enqueued to the moment its fleet stopped."""

    engine: sa.Engine
    out: Outcome
    keys: list[str]
    started: float = field(default_factory=time.monotonic)

    @contextmanager
    def fleet(self, db_url: str, logs: Path, **kw: Any) -> Iterator[Fleet]:
        """The scenario's `fleet`; when it has stopped, the outcome's `seconds`."""
        with fleet(db_url, logs, **kw) as f:
            yield f
        self.out.seconds = time.monotonic() - self.started


@contextmanager
def prepared(db_url: str, name: str, tickets: int, **world: Any) -> Iterator[Run]:
    """A scenario named `name` on `db_url`: its world prepared (`prepare`, with `world`),
    the clock started; the engine is disposed of after."""
    engine = create_engine(db_url)
    try:
        keys = prepare(engine, tickets, **world)
        yield Run(engine, Outcome(name, tickets), keys)
    finally:
        engine.dispose()


class Fleet:
    """Worker and sweeper processes of one scenario, restartable."""

    def __init__(self, db_url: str, logs: Path, *, workers: int = 3, **settings: Any) -> None:
        self.env = enrichq_env(db_url, **{**FAST, **settings})
        self.logs = logs
        self.workers: list[subprocess.Popen[bytes]] = []
        self.sweeper: subprocess.Popen[bytes] | None = None
        self.revived = 0  # workers started again after they died on their own
        self._n = 0
        for _ in range(workers):
            self.workers.append(self.start_worker())

    def start_worker(self) -> subprocess.Popen[bytes]:
        self._n += 1
        return spawn(["worker"], self.env, log=self.logs / f"worker-{self._n}.log")

    def start_sweeper(self) -> None:
        self._n += 1
        self.sweeper = spawn(["sweep"], self.env, log=self.logs / f"sweep-{self._n}.log")

    def revive(self) -> None:
        """Restart, as a supervisor would, workers that died on their own (a poison ticket;
        counted in `revived`) and a sweeper that exited (one that starts while the database
        is down says so and exits non-zero)."""
        for i, w in enumerate(self.workers):
            if w.poll() is not None:
                self.workers[i] = self.start_worker()
                self.revived += 1
        if self.sweeper is not None and self.sweeper.poll() is not None:
            self.start_sweeper()

    def stop_all(self) -> None:
        for p in [*self.workers, self.sweeper]:
            if p is not None:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
                stop(p)


@contextmanager
def fleet(db_url: str, logs: Path, **kw: Any) -> Iterator[Fleet]:
    f = Fleet(db_url, logs, **kw)
    try:
        yield f
    finally:
        f.stop_all()


def kill_workers_while_busy(
    f: Fleet,
    engine: sa.Engine,
    out: Outcome,
    rng: random.Random,
    *,
    kills: int,
    pause: tuple[float, float],
) -> None:
    """SIGKILL a random worker every `pause` seconds (uniform) and start another in its
    place, `kills` times or until no work remains; then wait for the queue to drain and
    record how long that took after the last kill."""
    while not quiet(engine) and out.faults < kills:
        time.sleep(rng.uniform(*pause))
        i = rng.randrange(len(f.workers))
        f.workers[i].kill()
        f.workers[i].wait(10)
        out.faults += 1
        f.workers[i] = f.start_worker()
    fault_end = time.monotonic()
    drained(engine, f)
    out.recover_seconds.append(time.monotonic() - fault_end)


def quiet(engine: sa.Engine) -> bool:
    """No queued or leased row left."""
    return q(
        engine,
        "SELECT count(*) FROM enrichq.queue WHERE state = 'queued' OR state = 'leased'",
    ) == [(0,)]


DONE = "SELECT count(*) FROM enrichq.queue WHERE state = 'done'"


def drained(engine: sa.Engine, fleet: Fleet | None = None, timeout: float = 240) -> None:
    watched(
        engine,
        fleet,
        lambda: quiet(engine),
        timeout=timeout,
        interval=0.25,
        what="the queue to drain",
    )


def reached(engine: sa.Engine, fleet: Fleet, rows: float, *, what: str) -> None:
    """Wait until `rows` queue rows are done."""
    watched(engine, fleet, lambda: q(engine, DONE)[0][0] >= rows, timeout=240, what=what)


def watched(
    engine: sa.Engine,
    fleet: Fleet | None,
    condition: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
) -> None:
    """`wait_for` of `condition`, the `fleet`'s exited processes started again meanwhile as a
    supervisor would (one that starts while the database restarts exits at start-up, by
    design); its failure also says what the queue and the fleet look like."""

    def revived() -> bool:
        if fleet is not None:
            fleet.revive()
        return condition()

    try:
        wait_for(revived, timeout=timeout, interval=interval, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {stuck(engine, fleet)}") from None


def stuck(engine: sa.Engine, fleet: Fleet | None) -> str:
    """What the queue and the fleet look like when they stop draining (for the message):
    the open rows, the processes' exit codes and the last line each process logged."""
    open_rows = q(
        engine,
        "SELECT state, lease_expires_at < now() AS expired, visible_at <= now() AS visible,"
        " lease_owner, attempts, left(last_error, 60), count(*) FROM enrichq.queue"
        " WHERE state IN ('queued', 'leased') GROUP BY 1, 2, 3, 4, 5, 6 ORDER BY 7 DESC LIMIT 10",
    )
    alive = "no fleet"
    if fleet is not None:
        sweeper = fleet.sweeper.poll() if fleet.sweeper is not None else "none"
        alive = f"workers exit codes {[w.poll() for w in fleet.workers]}, sweeper {sweeper}"
        for log in sorted(fleet.logs.glob("*.log")):
            logged = [line for line in log.read_text().splitlines() if line and line[0] != " "]
            alive += f"; {log.name}: {logged[-1][:300] if logged else 'nothing logged'}"
    return (
        f"open rows (state, expired, visible, owner, attempts, last error, n): {open_rows}; {alive}"
    )


def check(engine: sa.Engine, outcome: Outcome, *, poison: tuple[str, ...] = ()) -> Outcome:
    """Measure the promise: nothing lost, nothing written twice, invariants intact."""
    skip = list(poison)
    outcome.not_done = q(
        engine,
        "SELECT count(*) FROM helpdesk.tickets t WHERE t.id <> ALL(:skip) AND NOT EXISTS ("
        " SELECT 1 FROM enrichq.queue WHERE key = t.id AND state = 'done')",
        skip=skip,
    )[0][0]
    outcome.lost = q(
        engine,
        "SELECT count(*) FROM helpdesk.tickets t WHERE t.id <> ALL(:skip) AND NOT EXISTS ("
        " SELECT 1 FROM enrichq.ticket_enrichments e WHERE e.ticket_id = t.id)",
        skip=skip,
    )[0][0]
    outcome.duplicate_writes = q(
        engine,
        "SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM public.result_writes "
        "GROUP BY ticket_id) AS w",
    )[0][0]
    # the written result must come from the queue row that completed
    outcome.wrong_orders = q(
        engine,
        "WITH expected AS ("
        " SELECT t.id AS ticket_id, o.order_id FROM helpdesk.tickets t"
        " JOIN warehouse.customers c ON lower(c.email) = lower(t.requester_email)"
        " JOIN warehouse.orders o ON o.customer_id = c.customer_id"
        " WHERE t.id <> ALL(:skip)),"
        " got AS (SELECT ticket_id, order_id FROM enrichq.ticket_orders)"
        " SELECT count(*) FROM ((SELECT * FROM expected EXCEPT SELECT * FROM got)"
        " UNION ALL (SELECT * FROM got EXCEPT SELECT * FROM expected)) AS d",
        skip=skip,
    )[0][0]
    outcome.wrong_orders += q(
        engine,
        "SELECT count(*) FROM enrichq.ticket_enrichments e WHERE NOT EXISTS ("
        " SELECT 1 FROM enrichq.queue d WHERE d.id = e.queue_id AND d.state = 'done'"
        " AND d.key = e.ticket_id)",
    )[0][0]
    # lookups whose result did not land: their settle was refused or dropped by fencing
    outcome.fenced = q(
        engine,
        "SELECT count(*) FROM enrichq.lookup_log l WHERE l.status IN ('ok', 'empty') AND NOT "
        "EXISTS (SELECT 1 FROM enrichq.queue d WHERE d.id = l.queue_id AND d.state = 'done' "
        "AND d.attempts = l.attempt)",
    )[0][0]
    outcome.dead_letters = q(
        engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'dead_letter'"
    )[0][0]
    violations = q(
        engine,
        "SELECT (SELECT count(*) FROM (SELECT key FROM enrichq.queue WHERE state = 'queued'"
        " GROUP BY kind, key HAVING count(*) > 1) a)"
        " + (SELECT count(*) FROM (SELECT key FROM enrichq.queue WHERE state = 'leased'"
        " AND lease_expires_at > now() GROUP BY key HAVING count(*) > 1) b)"
        " + (SELECT count(*) FROM enrichq.queue WHERE attempts > max_attempts)",
    )[0][0]
    assert violations == 0, f"{violations} queue invariant violations"
    return outcome


# -- the scenarios


# The built-in batch lookup, slowed so the fleet does about 50 tickets a second, for the
# scenarios that inject faults for as long as work remains: the work outlasts the faults
# (the kills: one per 30 tickets, 0.75 s apart on average), and each finds lookups running.
# Unslowed, 3 workers finish 2,000 tickets in 3 s, before the 4th kill.
BUSY = {
    "batch_enricher": "tests.support.enrichers:sleepy_batch",
    "ENRICHQ_TEST_SLOW_SECONDS": 0.6,
    "lookup_batch_size": 5,
    "concurrency": 2,
}


def kill_9(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """Workers killed with SIGKILL at random moments, repeatedly, and restarted."""
    return _kill_workers(db_url, db_url, logs, tickets, rng, name="kill -9 workers, restart")


def kill_9_pgbouncer(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """kill -9 of workers as above, with every enrichq process behind a real PgBouncer 1.18
    in transaction pooling (ENRICHQ_POOL_MODE=transaction: no LISTEN, the sweeper leading
    by a lease row), its pool smaller than the fleet's connections."""
    with PgBouncer(db_url, pool_mode="transaction", pool_size=6) as bouncer:
        out = _kill_workers(
            db_url,
            bouncer.url_of(db_url),
            logs,
            tickets,
            rng,
            name="kill -9 workers behind PgBouncer (transaction pooling)",
            pool_mode="transaction",
        )
    out.notes = "pool of 6 server connections for 3 workers and a sweeper; polling, no LISTEN"
    return out


def _kill_workers(
    db_url: str,
    fleet_url: str,
    logs: Path,
    tickets: int,
    rng: random.Random,
    *,
    name: str,
    **settings: Any,
) -> Outcome:
    with prepared(db_url, name, tickets) as run:
        engine, out = run.engine, run.out
        with run.fleet(fleet_url, logs, **{**BUSY, **settings}) as f:
            f.start_sweeper()
            # a kill every 0.3-1.2 s, one per 30 tickets (at least 8), while work remains
            kills = max(8, tickets // 30)
            kill_workers_while_busy(f, engine, out, rng, kills=kills, pause=(0.3, 1.2))
        return check(engine, out)


def freeze(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """A worker frozen (SIGSTOP) past its lease, resumed after the others finished its rows."""
    with prepared(db_url, "SIGSTOP past the lease, resume", tickets) as run:
        engine, out = run.engine, run.out
        with run.fleet(
            db_url,
            logs,
            enricher="tests.support.enrichers:sleepy_warehouse",
            ENRICHQ_TEST_SLOW_SECONDS=0.05,
        ) as f:
            f.start_sweeper()
            victim = f.workers[0]
            reached(engine, f, tickets // 10 + 1, what="a tenth done")
            os.kill(victim.pid, signal.SIGSTOP)
            out.faults += 1
            frozen_at = time.monotonic()
            drained(engine, None)
            out.recover_seconds.append(time.monotonic() - frozen_at)
            os.kill(victim.pid, signal.SIGCONT)
            # A graceful stop flushes the resumed worker's settles: when it has exited, every
            # late write it would make has been tried (and must have been refused).
            stop(victim)
            drained(engine, f)
        return check(engine, out)


def terminate_storm(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """A storm of pg_terminate_backend on the workers' connections."""
    with prepared(db_url, "pg_terminate_backend storm", tickets) as run:
        engine, out = run.engine, run.out
        db = sa.engine.make_url(db_url).database
        with run.fleet(db_url, logs, **BUSY) as f:
            f.start_sweeper()
            last = time.monotonic()
            while not quiet(engine) and time.monotonic() - run.started < 240:
                time.sleep(rng.uniform(0.1, 0.5))
                # a worker whose start-up connection was terminated exits 1 (by design):
                # its supervisor starts it again, and so does the storm
                f.revive()
                killed = q(
                    engine,
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = :db AND pid <> pg_backend_pid() "
                    "AND application_name LIKE 'enrichq-worker%'",
                    db=db,
                )[0][0]
                out.faults += killed
                last = time.monotonic()
            drained(engine, f)
            out.recover_seconds.append(time.monotonic() - last)
        return check(engine, out)


def slow_warehouse(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """A warehouse so slow that every lookup outlives the claim loop many times over."""
    with prepared(db_url, "slow warehouse holding its pool", tickets) as run:
        engine, out = run.engine, run.out
        with run.fleet(
            db_url,
            logs,
            workers=2,
            enricher="tests.support.enrichers:slow_query",
            ENRICHQ_TEST_SLOW_SECONDS=1.5,
            concurrency=16,
        ) as f:
            f.start_sweeper()
            drained(engine, f, timeout=400)
        out.faults = tickets
        # heartbeats kept every lease alive: nothing was claimed twice
        out.notes = "claims beyond the first: " + str(
            q(engine, "SELECT coalesce(sum(attempts - 1), 0) FROM enrichq.queue")[0][0]
        )
        return check(engine, out)


def poison(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """A ticket whose enrichment kills the process every time."""
    with prepared(
        db_url, "poison ticket crashes its worker", tickets, extra_keys=("POISON",), max_attempts=3
    ) as run:
        engine, out = run.engine, run.out
        with run.fleet(
            db_url, logs, enricher="tests.support.enrichers:crash_on_poison", max_attempts=3
        ) as f:
            f.start_sweeper()
            drained(engine, f)
            out.faults = f.revived  # each time the poison took its worker down
        row = q(
            engine, "SELECT state, dead_reason, attempts FROM enrichq.queue WHERE key = 'POISON'"
        )
        out.notes = f"POISON: {row}"
        return check(engine, out, poison=("POISON",))


def db_restart(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """PostgreSQL restarted mid-run (a server of the scenario's own; `db_url` is unused):
    first a fast shutdown, then a crash (immediate shutdown), which loses the claims whose
    asynchronous commit had not reached the disk yet."""
    import shutil
    import tempfile

    from enrichq_schema.db import ensure_database, migrate
    from enrichq_service.embedded_postgres import EmbeddedPostgres

    base = Path(tempfile.mkdtemp(prefix="enrichq-chaos-pg-", dir="/tmp"))
    base.chmod(0o711)
    server = EmbeddedPostgres(base, port=free_port())
    try:
        url = ensure_database(server.start(), "enrichq")
        migrate(url)
        with prepared(url, "PostgreSQL restarted, then crashed, mid-run", tickets) as run:
            engine, out = run.engine, run.out
            out.notes = "the second stop is a crash (immediate shutdown): unflushed claims are lost"
            with run.fleet(url, logs) as f:
                f.start_sweeper()
                for fraction, crash in ((0.2, False), (0.6, True)):
                    reached(engine, f, tickets * fraction, what=f"{fraction:.0%} done")
                    server.stop(crash=crash)
                    time.sleep(rng.uniform(0.5, 2.0))
                    server.start()
                    out.faults += 1
                    back = time.monotonic()
                drained(engine, f)
                out.recover_seconds.append(time.monotonic() - back)
            return check(engine, out)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def sweeper_killed(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """The sweeper killed mid-pass over many expired leases; the next pass finishes.

    One lease per ticket (the queue allows no more); a third of the tickets have a queued
    row already, so their expired leases are superseded by it, the others go back."""
    engine = create_engine(db_url)
    rows = tickets * 10
    out = Outcome("sweeper kill -9 mid-pass", rows)
    try:
        with engine.begin() as conn:
            seed.create_external_tables(conn)  # the refresh pass reads the ticket mirror
            conn.execute(
                sa.text(
                    "INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts,"
                    " lease_owner, lease_expires_at, visible_at)"
                    " SELECT 'enrich', 'K-' || g, 'manual', 'leased', 1, 5, 'gone',"
                    " now() - interval '1 minute', now() - interval '2 minutes'"
                    " FROM generate_series(1, :rows) AS g"
                ),
                {"rows": rows},
            )
            conn.execute(
                sa.text(
                    "INSERT INTO enrichq.queue (kind, key, reason, state, max_attempts)"
                    " SELECT 'enrich', 'K-' || g, 'updated', 'queued', 5"
                    " FROM generate_series(3, :rows, 3) AS g"
                ),
                {"rows": rows},
            )
        start = time.monotonic()
        env = enrichq_env(db_url, sweep_interval_seconds=3600, **{"ENRICHQ_LOG_LEVEL": "INFO"})
        first = spawn(["sweep"], env, log=logs / "sweep-1.log")
        wait_for(
            lambda: (
                q(engine, "SELECT count(*) FROM enrichq.queue WHERE state <> 'leased'")[0][0] > 0
            ),
            timeout=60,
            interval=0.01,
            what="the first batch",
        )
        first.kill()
        first.wait(10)
        out.faults = 1
        partial = q(engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'leased'")[0][0]
        killed_at = time.monotonic()
        second = spawn(["sweep", "--once"], env, log=logs / "sweep-2.log")
        assert second.wait(120) == 0
        out.recover_seconds.append(time.monotonic() - killed_at)
        out.seconds = time.monotonic() - start
        out.notes = f"{partial} of {rows} leases were still expired when the first sweeper died"
        out.lost = q(
            engine,
            "SELECT count(*) FROM (SELECT key FROM enrichq.queue GROUP BY key"
            " HAVING count(*) FILTER (WHERE state = 'queued') <> 1) AS k",
        )[0][0]
        out.not_done = q(engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'leased'")[0][0]
        # a key's expired lease went back, or was superseded by the key's queued row
        out.wrong_orders = q(
            engine,
            "SELECT count(*) FROM enrichq.queue d JOIN enrichq.queue n"
            " ON n.key = d.key AND n.state = 'queued'"
            " WHERE d.state = 'dead_letter' AND d.superseded_by IS DISTINCT FROM n.id",
        )[0][0]
        out.dead_letters = q(
            engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'dead_letter'"
        )[0][0]
        return out
    finally:
        engine.dispose()


def bad_data(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """About 1% of lookups return an invalid result (each kind in turn) and 1% hang past
    the attempt deadline on their first start, while workers are killed with SIGKILL."""
    with prepared(db_url, "bad data: invalid results, hangs, kill -9", tickets) as run:
        engine, out = run.engine, run.out
        started = logs / "started"
        started.mkdir()
        keys = run.keys
        fates = {k: bad_data_fate(k) for k in keys}
        bad = {k: fate for k, fate in fates.items() if fate in BAD_FIELDS}
        hung = [k for k, fate in fates.items() if fate == "hang"]
        with run.fleet(
            db_url,
            logs,
            enricher="tests.support.enrichers:bad_data",
            attempt_deadline_seconds=2,
            ENRICHQ_TEST_STARTED_DIR=started,
        ) as f:
            f.start_sweeper()
            kills = max(3, tickets // 100)
            kill_workers_while_busy(f, engine, out, rng, kills=kills, pause=(0.5, 1.5))
            # with nothing left, a draining worker exits on its own, and cleanly
            drain = spawn(["worker", "--drain"], f.env, log=logs / "drain.log")
            drain_exit = drain.wait(120)
        out.faults += len(bad) + len(hung)
        settled = q(
            engine,
            "SELECT key, state, last_error FROM enrichq.queue WHERE key = ANY(:keys)",
            keys=list(bad),
        )
        wrong = sorted(
            key
            for key, state, error in settled
            if state != "failed" or BAD_FIELDS[bad[key]] not in (error or "")
        )
        out.notes = (
            f"{len(bad)} invalid results failed naming their field, {len(hung)} hung once"
            f" then done; wrongly settled: {wrong}; `worker --drain` exit {drain_exit}"
        )
        return check(engine, out, poison=tuple(bad))


# The partitioned worker's own bounds: ENRICHQ_NETWORK_TIMEOUT_SECONDS, and a statement
# timeout that, with it, bounds every reply wait (4 s); the partition lasts well past both
# and past the lease (3 s).
PARTITION_SECONDS = 10.0
PARTITIONED = {"network_timeout_seconds": 2, "statement_timeout_seconds": 2}
LOST_LINE = "treated as lost"


def partition(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """One worker's connections run through a TCP proxy that, mid-run, stops forwarding in
    both directions without closing anything (no FIN, no RST) for PARTITION_SECONDS, more
    than three leases, then heals. The worker must give its jobs up within a lease (its
    handlers stopped), and every write of those jobs that arrives late must be refused."""
    with prepared(
        db_url, "network partition of one worker (blackholed, then healed)", tickets
    ) as run:
        engine, out = run.engine, run.out
        slow = {
            "enricher": "tests.support.enrichers:sleepy_warehouse",
            "ENRICHQ_TEST_SLOW_SECONDS": 0.05,
        }
        with TcpProxy(target_of(db_url)) as proxy, run.fleet(db_url, logs, workers=2, **slow) as f:
            # its lookups take longer, so the cut finds its handlers running (the first claim
            # is seen within a poll), not only settles
            started = logs / "victim-started"
            started.mkdir()
            victim_env = enrichq_env(
                via(proxy, db_url),
                **{
                    **FAST,
                    **slow,
                    **PARTITIONED,
                    "ENRICHQ_TEST_SLOW_SECONDS": 5,
                    "ENRICHQ_TEST_STARTED_DIR": started,
                },
            )
            victim = spawn(["worker"], victim_env, log=logs / "partitioned.log")
            f.workers.append(victim)  # stopped (gracefully) with the others
            f.start_sweeper()
            owner = f"{socket.gethostname()}:{victim.pid}:%"
            held = (
                "SELECT id, claim_token FROM enrichq.queue"
                " WHERE state = 'leased' AND lease_owner LIKE :owner"
            )
            # its handlers run: the claim's reply reached it (a cut during the claim's round
            # trip leaves leases it never learnt of, which only expire)
            wait_for(
                lambda: q(engine, held, owner=owner) and any(started.iterdir()),
                timeout=120,
                interval=0.02,
                what="the partitioned worker to hold leases and run their handlers",
            )
            proxy.blackhole()
            cut_at, cut = time.time(), time.monotonic()
            out.faults += 1
            # what it held when the network went: nothing of it can reach the server now
            at_cut = q(engine, held, owner=owner)
            # the others finish its work: its leases expire, the sweeper puts them back
            drained(engine, None)
            out.recover_seconds.append(time.monotonic() - cut)
            time.sleep(max(0.0, cut + PARTITION_SECONDS - time.monotonic()))
            proxy.heal()
            # a graceful stop flushes its settles: every late write it makes has been tried
            assert stop(victim) == 0
            drained(engine, f)
        late = q(
            engine,
            "SELECT count(*) FROM enrichq.queue q JOIN unnest(CAST(:ids AS bigint[]),"
            " CAST(:tokens AS uuid[])) AS h (id, token) ON q.id = h.id"
            " WHERE q.state = 'done' AND q.claim_token = h.token",
            ids=[r[0] for r in at_cut],
            tokens=[r[1] for r in at_cut],
        )[0][0]
        lost = q(
            engine,
            "SELECT coalesce(sum(CAST(counts->>'lost' AS int)), 0) FROM enrichq.runs"
            " WHERE component = 'worker' AND owner LIKE :owner",
            owner=owner,
        )[0][0]
        noticed = _first_log_line(logs / "partitioned.log", LOST_LINE)
        given_up = (
            "none given up"
            if noticed is None
            else f"{noticed[1]} running given up after {noticed[0] - cut_at:.1f} s"
        )
        out.notes = (
            f"partition {PARTITION_SECONDS:g} s, lease {FAST['lease_seconds']:g} s: "
            f"{len(at_cut)} leases held at the cut, {given_up} ({lost} lost in all); "
            f"late writes accepted: {late}"
        )
        return check(engine, out)


def _first_log_line(path: Path, needle: str) -> tuple[float, int] | None:
    """The time (epoch seconds) of the first log line containing `needle`, and the first
    count of leases on it (how many the lease watch gave up)."""
    import re
    from datetime import datetime

    for line in path.read_text(errors="replace").splitlines():
        if needle in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            count = re.search(r": (\d+) leases", line)
            return stamp.timestamp(), int(count.group(1)) if count else 0
    return None


# Claims whose COMMIT reply the lost_replies scenario cuts, and how it knows one: the claim
# is the one statement that counts claims per tenant.
LOST_CLAIM_REPLIES = 12
CLAIM_TEXT = b"INSERT INTO enrichq.tenant_served"


def lost_replies(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """Every process talks to the server through a proxy that, LOST_CLAIM_REPLIES times,
    drops the reply to a claim's COMMIT: the server committed the leases, the worker sees
    its connection die. Each worker must give back the rows it never heard of, with the
    attempt the claim counted, and claim them again, instead of leaving them leased until
    their lease expires."""
    with prepared(db_url, "claim COMMIT replies lost", tickets) as run:
        engine, out = run.engine, run.out
        cutter = CommitCutter(target_of(db_url), CLAIM_TEXT, times=LOST_CLAIM_REPLIES)
        with cutter, run.fleet(via(cutter, db_url), logs) as f:
            f.start_sweeper()
            drained(engine, f)
        out.faults = cutter.cut
        given_back, lease_expired, retried = q(
            engine,
            "SELECT (SELECT coalesce(sum(CAST(counts->>'given_back' AS int)), 0)"
            "        FROM enrichq.runs WHERE component = 'worker'),"
            "       (SELECT count(*) FROM enrichq.queue WHERE starts_with(last_error, :expired)),"
            "       (SELECT count(*) FROM enrichq.queue WHERE state = 'done' AND attempts > 1)",
            expired=LEASE_EXPIRED_ERROR,
        )[0]
        out.notes = (
            f"{cutter.cut} claim replies lost; rows given back: {given_back}; "
            f"rows that waited for their lease to expire: {lease_expired}; "
            f"done with more than one attempt: {retried}"
        )
        return check(engine, out)


def failover(db_url: str, logs: Path, tickets: int, rng: random.Random) -> Outcome:
    """Workers and a sweeper on a multi-host URL (primary, standby;
    target_session_attrs=read-write). Mid-run, replication stalls for a second (its
    connection blackholed), the primary is stopped hard (immediate shutdown) and the
    standby promoted: the commits that had not replicated are lost with the primary and
    must be redone, never doubled, by the same processes reconnecting by themselves.
    (A server pair of the scenario's own; `db_url` is unused.)"""
    from enrichq_schema.db import ensure_database, migrate

    out = Outcome("failover: primary stopped hard, standby promoted", tickets)
    with cluster.cluster(proxied_replication=True) as c:
        url = ensure_database(c.primary.url(), "enrichq")
        migrate(url)
        primary = c.engine(url)
        prepare(primary, tickets)
        c.wait_caught_up("enrichq")
        start = time.monotonic()
        multi = c.multi_host_url("enrichq")
        # lookups of half a second (24 at once): the crash finds work left to do on the new
        # primary, however fast the worker gets at the rest (a batch of 50 no-op lookups
        # finishes the bounded run's 300 tickets before replication can be cut)
        slow = {
            "enricher": "tests.support.enrichers:sleepy_warehouse",
            "ENRICHQ_TEST_SLOW_SECONDS": 0.5,
        }
        with fleet(multi, logs, network_timeout_seconds=2, **slow) as f:
            f.start_sweeper()
            reached(primary, f, tickets * 0.4, what="40% done")
            assert c.replication is not None
            c.replication.blackhole()  # the standby stops receiving WAL
            time.sleep(1.0)
            done_on_primary = q(primary, DONE)[0][0]
            c.primary.stop("immediate")
            crashed = time.monotonic()
            out.faults += 1
            primary.dispose()
            time.sleep(1.0)  # the time it takes someone to decide to fail over
            c.standby.promote()
            promoted = time.monotonic()
            standby = c.engine(c.standby.url("enrichq"))
            done_on_standby = q(standby, DONE)[0][0]
            wait_for(
                lambda: q(standby, DONE)[0][0] > done_on_standby,
                timeout=120,
                interval=0.05,
                what="work on the new primary",
            )
            resumed = time.monotonic() - promoted
            drained(standby, None)
            out.recover_seconds.append(time.monotonic() - crashed)
            restarted = sum(p.poll() is not None for p in [*f.workers, f.sweeper] if p)
        out.seconds = time.monotonic() - start
        out.notes = (
            f"{done_on_primary - done_on_standby} completions committed on the old primary "
            "never replicated (all redone); work resumed "
            f"{resumed:.1f} s after the promotion; processes that exited: {restarted}"
        )
        return check(standby, out)


SCENARIOS: dict[str, Callable[[str, Path, int, random.Random], Outcome]] = {
    "kill_9": kill_9,
    "kill_9_pgbouncer": kill_9_pgbouncer,
    "freeze": freeze,
    "db_restart": db_restart,
    "terminate_storm": terminate_storm,
    "slow_warehouse": slow_warehouse,
    "sweeper_killed": sweeper_killed,
    "poison": poison,
    "bad_data": bad_data,
    "partition": partition,
    "lost_replies": lost_replies,
    "failover": failover,
}

# What a scenario needs beyond the test server: a function saying why it cannot run here
# (a Debian package that is not installed), or None.
MISSING: dict[str, Callable[[], str | None]] = {
    "kill_9_pgbouncer": pgbouncer.missing,
    "failover": cluster.missing,
}
