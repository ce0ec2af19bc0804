"""Benchmark: lease recovery of 100,000 expired leases against one bare UPDATE of the same rows.

Run: ``python -m tests.bench.bench_sweeper [--rows N] [--keys K] [--batch-size B] [--repeat R]``
against ENRICHQ_TEST_DATABASE_URL (default: the local server). It creates a scratch
database, and for each repetition builds the same expired leases (N rows over K tickets,
one INSERT ... SELECT generate_series, then VACUUM ANALYZE as autovacuum would) and times:

- recovery: ``recovery.run_once`` (bounded batches, one transaction each: newest row per
  ticket back to the queue, the others dead-lettered as superseded, spent rows exhausted);
- bare UPDATE: one statement that moves every expired lease straight to dead_letter,
  writing the same columns (no per-ticket choice, one transaction; what the original
  system's single-statement sweeper did, minus its unique violation).

Target: recovery within 3x of the bare UPDATE. It prints wall-clock medians and bests and,
when the server runs on this machine, the CPU seconds each side used (the server backend's
from /proc, plus this process's): on a machine shared with other work the wall clock
mostly measures the neighbours, the CPU seconds do not. It also prints the longest time
one recovery batch held its row locks.
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

BUILD = sa.text(
    """
    INSERT INTO enrichq.queue (kind, key, reason, state, attempts, max_attempts,
                               lease_owner, lease_expires_at, heartbeat_at, visible_at)
    SELECT 'enrich', 'T-' || (i % :keys), 'created', 'leased',
           CASE WHEN i % 97 = 0 THEN 5 ELSE 1 END, 5, 'w-' || (i % 64),
           CAST(:expired AS timestamptz), CAST(:expired AS timestamptz),
           CAST(:expired AS timestamptz)
    FROM generate_series(1, :rows) AS i
    """
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


@dataclass(frozen=True, slots=True)
class Run:
    """One timed run: wall seconds, and CPU seconds of the server backend and of this process."""

    wall: float
    server_cpu: float | None
    client_cpu: float

    @property
    def cpu(self) -> float | None:
        return None if self.server_cpu is None else self.server_cpu + self.client_cpu


def build(engine: sa.Engine, rows: int, keys: int) -> None:
    """Empty the queue and fill it with `rows` expired leases over `keys` tickets."""
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE enrichq.queue"))
        conn.execute(BUILD, {"rows": rows, "keys": keys, "expired": EXPIRED})
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
    parser.add_argument("--keys", type=int, default=30_000)
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
            build(setup, args.rows, args.keys)
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

            build(setup, args.rows, args.keys)

            def bare() -> int:
                with engine.begin() as conn:
                    return conn.execute(BARE_UPDATE, {"now": T0}).rowcount

            run, updated = measured(engine, bare)
            assert updated == args.rows, updated
            bares.append(run)
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
        f"\nlease recovery: {args.rows:,} expired leases over {args.keys:,} tickets, "
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
