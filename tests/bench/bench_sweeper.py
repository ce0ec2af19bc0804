"""Benchmark: the sweeper's passes against bare statements doing the same writes.

Run: ``python -m tests.bench.bench_sweeper [--rows N] [--batch-size B] [--repeat R]``
against ENRICHQ_TEST_DATABASE_URL (default: the local server). It creates a scratch
database, and for each repetition builds the same expired leases (N rows, one lease per
ticket as the queue allows; every third ticket has a queued row already; one INSERT ...
SELECT generate_series, then VACUUM ANALYZE as autovacuum would) and times:

- recovery: ``recovery.run_once`` (bounded batches, one transaction each: a lease back to
  the queue, or dead-lettered as superseded by its ticket's queued row, or exhausted);
- bare UPDATE: one statement that moves every expired lease straight to dead_letter,
  writing the same columns (no per-ticket choice, one transaction; what the original
  system's single-statement sweeper did, minus its unique violation).

Target: recovery within 3x of the bare UPDATE. It prints wall-clock medians and bests and,
when the server runs on this machine, the CPU seconds each side used (the server backend's
from /proc, plus this process's): on a machine shared with other work the wall clock
mostly measures the neighbours, the CPU seconds do not. It also prints the longest time
one recovery batch held its row locks.

Then, on a long history (200,000 dead letters, most superseded, with some past their 90
days; 5,000 done rows, some past 30 days; 250,000 lookup-log rows), it times a retention
pass against bare DELETEs of the same rows, the sweeper's terminal count, and one read of
the /metrics database gauges (issue 12: each bounded by what it acts on).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from enrichq_schema.db import create_engine, migrate, normalize_url
from enrichq_sweeper import recovery
from enrichq_sweeper.common import DEFAULT_BATCH_SIZE

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
T0 = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
EXPIRED = T0 - timedelta(seconds=5)
TARGET_RATIO = 3.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

BUILD = (
    sa.text(
        """
        INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts,
                                   lease_owner, lease_expires_at, heartbeat_at, visible_at)
        SELECT 'enrich', 'T-' || i, 'created', 'leased',
               CASE WHEN i % 97 = 0 THEN 5 ELSE 1 END, 5, 'w-' || (i % 64),
               CAST(:expired AS timestamptz), CAST(:expired AS timestamptz),
               CAST(:expired AS timestamptz)
        FROM generate_series(1, :rows) AS i
        """
    ),
    sa.text(
        """
        INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts, visible_at)
        SELECT 'enrich', 'T-' || i, 'updated', 'queued', 0, 5, CAST(:expired AS timestamptz)
        FROM generate_series(3, :rows, 3) AS i
        """
    ),
)

BARE_UPDATE = sa.text(
    """
    UPDATE enrichq.queue
    SET state = 'dead_letter', dead_reason = 'superseded', finished_at = CAST(:now AS timestamptz),
        last_error = 'lease expired', updated_at = CAST(:now AS timestamptz),
        lease_owner = NULL, lease_expires_at = NULL, heartbeat_at = NULL
    WHERE state = 'leased' AND lease_expires_at < CAST(:now AS timestamptz)
    """
)

HISTORY = (
    """
    INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts, finished_at,
                               dead_reason)
    SELECT 'enrich', 'D-' || g, 'updated', 'dead_letter', 1, 5,
           CAST(:t0 AS timestamptz) - make_interval(mins => g % 140000),
           CASE WHEN g % 10 = 0 THEN 'attempts_exhausted' ELSE 'superseded' END
    FROM generate_series(1, 200000) AS g
    """,
    """
    INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts, finished_at)
    SELECT 'enrich', 'F-' || g, 'updated', 'done', 1, 5,
           CAST(:t0 AS timestamptz) - make_interval(hours => g % 1000)
    FROM generate_series(1, 5000) AS g
    """,
    """
    INSERT INTO enrichq.lookup_log (queue_id, ticket_id, attempt, duration_ms, status, created_at)
    SELECT g, 'F-' || g, 1, 1.0, 'ok', CAST(:t0 AS timestamptz) - make_interval(mins => g % 60000)
    FROM generate_series(1, 250000) AS g
    """,
)
# The same rows a retention pass deletes, each table in one statement.
BARE_PRUNE = (
    "DELETE FROM enrichq.queue WHERE state IN ('done', 'failed')"
    " AND finished_at < CAST(:t0 AS timestamptz) - interval '30 days'",
    "DELETE FROM enrichq.queue WHERE state = 'dead_letter'"
    " AND finished_at < CAST(:t0 AS timestamptz) - interval '90 days'",
    "DELETE FROM enrichq.lookup_log WHERE created_at < CAST(:t0 AS timestamptz) - interval '30 days'",
)


@dataclass(frozen=True, slots=True)
class Run:
    """One timed run: wall seconds, and CPU seconds of the server backend and of this process."""

    wall: float
    server_cpu: float | None
    client_cpu: float

    @property
    def cpu(self) -> float | None:
        return None if self.server_cpu is None else self.server_cpu + self.client_cpu


def build(engine: sa.Engine, rows: int) -> None:
    """Empty the queue and fill it with `rows` expired leases, a third with a queued row."""
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE enrichq.queue"))
        for statement in BUILD:
            conn.execute(statement, {"rows": rows, "expired": EXPIRED})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE enrichq.queue"))


def backend_cpu(engine: sa.Engine) -> tuple[int, float | None]:
    """The pid of the engine's one pooled connection and its CPU seconds (None if not local)."""
    with engine.connect() as conn:
        pid = int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return pid, None
    # utime and stime are fields 14 and 15 of /proc/pid/stat; the split starts at field 3
    return pid, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def measured(engine: sa.Engine, work: Callable[[], object]) -> tuple[Run, object]:
    """Run `work` on `engine` (one pooled connection) and measure it."""
    pid, server_before = backend_cpu(engine)
    client_before, started = time.process_time(), time.perf_counter()
    result = work()
    wall, client = time.perf_counter() - started, time.process_time() - client_before
    pid_after, server_after = backend_cpu(engine)
    server = None
    if server_before is not None and server_after is not None and pid_after == pid:
        server = server_after - server_before
    return Run(wall, server, client), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    admin_url = normalize_url(os.environ.get("ENRICHQ_TEST_DATABASE_URL", DEFAULT_URL))
    name = f"enrichq_bench_sweeper_{uuid.uuid4().hex[:8]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT", pool_size=1)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    setup = create_engine(url, pool_size=1)
    # one connection, so one server backend whose CPU time can be read
    engine = create_engine(url, pool_size=1)
    recoveries: list[Run] = []
    bares: list[Run] = []
    max_batch: list[float] = []
    batches = max_rows = 0
    try:
        migrate(url)
        for _ in range(args.repeat):
            build(setup, args.rows)
            run, outcome = measured(
                engine,
                lambda: recovery.run_once(
                    engine, batch_size=args.batch_size, now=T0, gave_up_hook=None
                ),
            )
            assert isinstance(outcome, recovery.RecoveryResult)
            assert outcome.recovered == args.rows, outcome
            recoveries.append(run)
            max_batch.append(outcome.max_batch_seconds)
            batches, max_rows = outcome.batches, outcome.max_batch_rows

            build(setup, args.rows)

            def bare() -> int:
                with engine.begin() as conn:
                    return conn.execute(BARE_UPDATE, {"now": T0}).rowcount

            run, updated = measured(engine, bare)
            assert updated == args.rows, updated
            bares.append(run)
        history = bench_history(setup, engine, args.repeat)
    finally:
        engine.dispose()
        setup.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    report(
        args,
        recoveries=recoveries,
        bares=bares,
        max_batch=max_batch,
        batches=batches,
        max_rows=max_rows,
    )
    report_history(history)


def fill_history(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE enrichq.queue, enrichq.lookup_log, enrichq.queue_counts"))
        for statement in HISTORY:
            conn.execute(sa.text(statement), {"t0": T0})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE"))


def bench_history(setup: sa.Engine, engine: sa.Engine, repeat: int) -> dict[str, list[Run]]:
    """Retention vs bare deletes, the terminal count and a scrape read, on a long history."""
    from enrichq_service.observe import read_snapshot
    from enrichq_sweeper import counts, retention

    runs: dict[str, list[Run]] = {"retention": [], "bare": [], "counts": [], "scrape": []}
    for _ in range(repeat):
        fill_history(setup)
        run, pruned = measured(
            engine,
            lambda: retention.run_once(
                engine, retention_days=30, dead_letter_retention_days=90, now=T0
            ),
        )
        assert isinstance(pruned, retention.PruneResult)
        runs["retention"].append(run)
        run, _ = measured(engine, lambda: counts.run_once(engine, statement_timeout_seconds=60))
        runs["counts"].append(run)

        def scrape() -> object:
            with engine.connect() as conn:
                return read_snapshot(conn)

        runs["scrape"].append(measured(engine, scrape)[0])
        fill_history(setup)

        def bare() -> None:
            with engine.begin() as conn:
                for statement in BARE_PRUNE:
                    conn.execute(sa.text(statement), {"t0": T0})

        runs["bare"].append(measured(engine, bare)[0])
    return runs


def report_history(runs: dict[str, list[Run]]) -> None:
    print(
        "\non a long history (200,000 dead letters, 5,000 done rows, 250,000 lookup-log rows),"
        f" {len(runs['retention'])} runs each\n"
    )
    print(f"{'':<36} {'wall median':>12} {'CPU median':>11}")
    labels = {
        "retention": "retention.run_once (pages of 1,000)",
        "bare": "bare DELETEs of the same rows",
        "counts": "terminal count (counts.run_once)",
        "scrape": "one /metrics database read",
    }
    for key, label in labels.items():
        walls = [r.wall for r in runs[key]]
        cpus = [r.cpu for r in runs[key] if r.cpu is not None]
        cpu = f"{statistics.median(cpus):.3f}" if len(cpus) == len(walls) else "n/a"
        print(f"{label:<36} {statistics.median(walls):>12.3f} {cpu:>11}")
    ratio = statistics.median(r.wall for r in runs["retention"]) / statistics.median(
        r.wall for r in runs["bare"]
    )
    print(f"{'ratio (retention / bare)':<36} {ratio:>11.2f}x")


def report(
    args: argparse.Namespace,
    *,
    recoveries: list[Run],
    bares: list[Run],
    max_batch: list[float],
    batches: int,
    max_rows: int,
) -> None:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    rec_wall, bare_wall = med([r.wall for r in recoveries]), med([r.wall for r in bares])
    best_rec, best_bare = min(r.wall for r in recoveries), min(r.wall for r in bares)
    rec_cpus = [r.cpu for r in recoveries if r.cpu is not None]
    bare_cpus = [r.cpu for r in bares if r.cpu is not None]
    print(
        f"\nlease recovery: {args.rows:,} expired leases (a third superseded), "
        f"batch size {args.batch_size}, {args.repeat} runs each (interleaved)\n"
    )
    print(f"{'':<30} {'wall median':>12} {'wall best':>10} {'CPU median':>11} {'rows/s':>9}")
    print(f"{'-' * 30} {'-' * 12} {'-' * 10} {'-' * 11} {'-' * 9}")
    for label, runs, wall, best, cpus in (
        ("recovery.run_once", recoveries, rec_wall, best_rec, rec_cpus),
        ("bare single UPDATE", bares, bare_wall, best_bare, bare_cpus),
    ):
        cpu = f"{med(cpus):.2f}" if len(cpus) == len(runs) else "n/a"
        print(f"{label:<30} {wall:>12.2f} {best:>10.2f} {cpu:>11} {args.rows / wall:>9,.0f}")
    wall_ratio, best_ratio = rec_wall / bare_wall, best_rec / best_bare
    cpu_ratio = med(rec_cpus) / med(bare_cpus) if rec_cpus and bare_cpus else None
    cpu_text = f"{cpu_ratio:>10.2f}x" if cpu_ratio is not None else f"{'n/a':>11}"
    print(f"{'ratio (recovery / bare)':<30} {wall_ratio:>11.2f}x {best_ratio:>9.2f}x {cpu_text}")
    print(f"\ntarget: within {TARGET_RATIO:g}x", end="")
    for label, value in (("wall median", wall_ratio), ("CPU", cpu_ratio)):
        if value is not None:
            verdict = "met" if value <= TARGET_RATIO else "NOT met"
            print(f"; {label} {verdict}", end="")
    print()
    print(
        f"longest lock held by one recovery batch: {max(max_batch):.3f} s (median of runs "
        f"{med(max_batch):.3f} s); {batches} batches, at most {max_rows:,} rows in one"
    )
    print(
        "all runs, wall s: recovery "
        + ", ".join(f"{r.wall:.2f}" for r in recoveries)
        + " | bare "
        + ", ".join(f"{r.wall:.2f}" for r in bares)
    )


if __name__ == "__main__":
    main()
