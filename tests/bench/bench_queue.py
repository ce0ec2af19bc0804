"""Queue benchmark (issue 3): enrichq beside a raw-SQL ceiling and pgqueuer, in one run.

    python -m tests.bench.bench_queue [--quick] [--soak-minutes M] [--vacuum-standin]

Everything runs sequentially on scratch databases of ENRICHQ_TEST_DATABASE_URL's server
(default postgresql://postgres@127.0.0.1:5432/postgres), so the figures sit side by side:

- enqueue: batches of 10,000 through `queue.enqueue`, jobs/s;
- claim → complete of no-op jobs, one transaction per claim and one per complete, batch
  1 and 50, with 1, 2 and 4 worker processes (spawned) draining a pre-filled backlog
  (visible now, no tenant); the same for a minimal raw-SQL loop on a bare table (the
  ceiling) and for pgqueuer (batch 100, 2 and 4 processes) when it is installed;
- enrichq as ratios of both, against the issue's targets;
- claim latency p50/p99 (one process, batch 50) with no history, with 1,000,000 terminal
  rows, and with the claim counts of 5,000 tenants over 48 hours (issue 12);
- claim latency by the tenants holding queued work (issue 26): 5,000 queued rows on 200,000
  terminal ones, of one tenant, of 5,000 tenants, and of 5,000 tenants not visible yet
  beside one tenant's visible backlog, each with the plan made with the values and with the
  worker's generic plan, at batch 50 and at batch 1 (where a claim takes one pair's row
  whatever the spread, so the tenants' number alone differs) (`--latency-only` runs the
  two latency parts alone);
- a soak: a steady enqueue rate and 2 workers, per minute throughput and dead tuples.

Not a test: pytest never collects tests/bench. Times come from time.perf_counter.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import sqlalchemy as sa

from enrichq_schema.db import create_engine
from enrichq_schema.settings import Settings
from enrichq_service import queue
from enrichq_service.queue import EnqueueRequest
from enrichq_service.worker import ThreadConnection, build_engines
from tests.bench.common import (
    console,
    libpq_url,
    percentile,
    print_table,
    scratch_database,
    server_url,
)

LEASE_SECONDS = 60.0
PROCESS_COUNTS = (1, 2, 4)
BATCHES = (1, 50)
PGQUEUER_PROCESSES = (2, 4)
PGQUEUER_BATCH = 100
LATENCY_BATCH = 50
TARGET_RAW_RATIO = 0.5
TARGET_PGQUEUER_RATIO = 1.25
TARGET_LATENCY_RATIO = 1.25
TARGET_SOAK_RATIO = 0.8
# the soak's enqueue rate as a share of the measured capacity: steady, with headroom for the
# producer's own CPU (2 cores run producer, 2 workers and their backends)
SOAK_SHARE = 0.25


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; --quick shrinks everything."""

    enqueue_batches: int
    rows_batch_1: int
    rows_batch_50: int
    pgqueuer_rows: int
    latency_claims: int
    latency_terminal_rows: int
    soak_minutes: float


# batch 1 is bound by commit latency (two commits a job): a few thousand rows measure it
FULL = Sizes(5, 3_000, 50_000, 50_000, 2_000, 1_000_000, 10)
# the claim counts of this many tenants, every hour of two days (issue 12: claim cost must
# follow the tenants with visible work, not every tenant with history)
LATENCY_TENANTS = 5_000
# issue 26: the queued rows and the history of the claim-cost-by-tenants part
SPREAD_QUEUED = 5_000
SPREAD_TERMINAL = 200_000
# the worker's batch, then batch 1: a batch of 50 spread over 5,000 tenants takes one row of
# 50 pairs (50 heads to evaluate, 50 served counts) where one tenant's takes 50 rows of one
# pair; at batch 1 both take one row of one pair, so the tenants' number alone differs
SPREAD_BATCHES = (LATENCY_BATCH, 1)
QUICK = Sizes(1, 400, 5_000, 5_000, 200, 200_000, 1)


@dataclass(frozen=True)
class Drain:
    """One drain run: how many jobs, how long, and the mean time of each call."""

    system: str
    batch: int
    processes: int
    jobs: int
    seconds: float
    claim_ms: float
    complete_ms: float

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds > 0 else 0.0


# -- processes


def run_processes(
    target: Callable[..., None], kwargs: Sequence[dict[str, Any]], timeout: float = 3600
) -> list[Any]:
    """Spawn one process per kwargs, release them together, return what each reported."""
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(len(kwargs))
    out = ctx.Queue()
    procs = [ctx.Process(target=target, kwargs={**kw, "start": start, "out": out}) for kw in kwargs]
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=timeout) for _ in procs]
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    failures = [r for r in results if isinstance(r, str)]
    if failures:
        raise RuntimeError(f"a benchmark process failed:\n{failures[0]}")
    return results


def _report(out: Any, body: Callable[[], Any]) -> None:
    """Run a child's body and always put something on its queue (a traceback on failure)."""
    try:
        out.put(body())
    except Exception:  # the parent raises it with the traceback
        out.put(traceback.format_exc())


def enrichq_worker(*, url: str, owner: str, batch: int, start: Any, out: Any) -> None:
    """Claim and complete no-op jobs through enrichq's API until a claim comes back empty."""

    def body() -> tuple[int, float, float, float, float, int, int]:
        # as the worker does: claims on a connection of the claim engine, completes on one
        # of the queue engine, each kept between transactions
        engines = build_engines(Settings.load(database_url=url), url)
        claiming, settling = ThreadConnection(engines.claims), ThreadConnection(engines.queue)
        try:
            for warm in (claiming, settling):
                with warm.begin() as conn:
                    conn.execute(sa.text("SELECT 1"))
            start.wait()
            jobs_done = claims = completes = 0
            claim_s = complete_s = 0.0
            began = time.perf_counter()
            while True:
                t = time.perf_counter()
                with claiming.begin() as conn:
                    jobs = queue.claim(
                        conn,
                        kinds=("enrich",),
                        owner=owner,
                        limit=batch,
                        lease_seconds=LEASE_SECONDS,
                    )
                claim_s += time.perf_counter() - t
                claims += 1
                if not jobs:
                    break
                t = time.perf_counter()
                with settling.begin() as conn:
                    jobs_done += len(queue.complete(conn, owner=owner, jobs=jobs))
                complete_s += time.perf_counter() - t
                completes += 1
            return jobs_done, began, time.perf_counter(), claim_s, complete_s, claims, completes
        finally:
            claiming.close()
            settling.close()
            engines.dispose()

    _report(out, body)


RAW_CLAIM = (
    "UPDATE bench_raw SET state = 'leased' WHERE id IN ("
    "SELECT id FROM bench_raw WHERE state = 'queued' ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
    ") RETURNING id"
)
RAW_COMPLETE = "UPDATE bench_raw SET state = 'done' WHERE id = ANY(%s)"


def raw_worker(*, url: str, owner: str, batch: int, start: Any, out: Any) -> None:
    """The ceiling: the minimal claim / complete loop with psycopg, no ORM, no fencing."""

    def body() -> tuple[int, float, float, float, float, int, int]:
        with psycopg.connect(libpq_url(url), application_name=f"bench-raw-{owner}") as conn:
            start.wait()
            jobs_done = claims = completes = 0
            claim_s = complete_s = 0.0
            began = time.perf_counter()
            while True:
                t = time.perf_counter()
                ids = [r[0] for r in conn.execute(RAW_CLAIM, (batch,))]
                conn.commit()
                claim_s += time.perf_counter() - t
                claims += 1
                if not ids:
                    break
                t = time.perf_counter()
                conn.execute(RAW_COMPLETE, (ids,))
                conn.commit()
                complete_s += time.perf_counter() - t
                completes += 1
                jobs_done += len(ids)
            return jobs_done, began, time.perf_counter(), claim_s, complete_s, claims, completes

    _report(out, body)


def pgqueuer_worker(*, url: str, owner: str, batch: int, start: Any, out: Any) -> None:
    """pgqueuer's QueueManager in drain mode with a no-op entrypoint (asyncpg)."""

    def body() -> tuple[int, float, float, float, float, int, int]:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.domain.types import QueueExecutionMode
        from pgqueuer.models import Job
        from pgqueuer.qm import QueueManager
        from pgqueuer.queries import Queries

        async def drain() -> tuple[int, float, float]:
            conn = await asyncpg.connect(libpq_url(url))
            try:
                qm = QueueManager(Queries(AsyncpgDriver(conn)))
                done = 0

                async def noop(job: Job) -> None:
                    nonlocal done
                    done += 1

                # a plain call, not decorator syntax: typed with or without the bench extra
                qm.entrypoint("noop")(noop)

                start.wait()
                began = time.perf_counter()
                await qm.run(
                    batch_size=batch,
                    mode=QueueExecutionMode.drain,
                    dequeue_timeout=timedelta(seconds=1),
                )
                return done, began, time.perf_counter()
            finally:
                await conn.close()

        done, began, ended = asyncio.run(drain())
        return done, began, ended, 0.0, 0.0, 0, 0

    _report(out, body)


def drain(
    system: str,
    target: Callable[..., None],
    url: str,
    batch: int,
    processes: int,
) -> Drain:
    """Run `processes` copies of a worker until the backlog is gone; one row of the table."""
    results = run_processes(
        target,
        [{"url": url, "owner": f"w{n}", "batch": batch} for n in range(processes)],
    )
    jobs = sum(r[0] for r in results)
    seconds = max(r[2] for r in results) - min(r[1] for r in results)
    claims = sum(r[5] for r in results)
    completes = sum(r[6] for r in results)
    claim_ms = 1000 * sum(r[3] for r in results) / claims if claims else float("nan")
    complete_ms = 1000 * sum(r[4] for r in results) / completes if completes else float("nan")
    return Drain(system, batch, processes, jobs, seconds, claim_ms, complete_ms)


# -- filling tables


def run_sql(url: str, *statements: str, autocommit: bool = False) -> None:
    with psycopg.connect(libpq_url(url), autocommit=autocommit) as conn:
        for statement in statements:
            conn.execute(statement)


def fill_enrichq(url: str, rows: int, *, terminal: int = 0, tenants: int = 0) -> None:
    """`rows` queued rows visible now (no tenant), after `terminal` done rows of history and
    `tenants` tenants served every hour of the last 48 (claim counts, but no queued work)."""
    statements = ["TRUNCATE enrichq.queue, enrichq.tenant_served RESTART IDENTITY"]
    if tenants:
        statements.append(
            "INSERT INTO enrichq.tenant_served (kind, tenant, bucket, served)"
            " SELECT 'enrich', 'hist-' || t, date_trunc('hour', now())"
            "  - make_interval(hours => h), 5"
            f" FROM generate_series(1, {int(tenants)}) AS t, generate_series(0, 47) AS h"
        )
    if terminal:
        statements.append(
            "INSERT INTO enrichq.queue (kind, key, reason, state, visible_at, attempts,"
            " max_attempts, finished_at, created_at, updated_at)"
            " SELECT 'enrich', 'H-' || g, 'created', 'done', now() - interval '2 days', 1, 5,"
            f"  now() - interval '1 day', now() - interval '2 days', now() - interval '1 day'"
            f" FROM generate_series(1, {int(terminal)}) AS g"
        )
    statements.append(
        "INSERT INTO enrichq.queue (kind, key, reason, visible_at, max_attempts)"
        " SELECT 'enrich', 'T-' || g, 'manual', now() - interval '1 second', 5"
        f" FROM generate_series(1, {int(rows)}) AS g"
    )
    run_sql(url, *statements)
    run_sql(
        url, "VACUUM ANALYZE enrichq.queue", "VACUUM ANALYZE enrichq.tenant_served", autocommit=True
    )


def fill_raw(url: str, rows: int) -> None:
    run_sql(
        url,
        "CREATE TABLE IF NOT EXISTS bench_raw ("
        " id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
        " state text NOT NULL DEFAULT 'queued', payload jsonb NOT NULL DEFAULT '{}')",
        "CREATE INDEX IF NOT EXISTS bench_raw_queued_idx ON bench_raw (id) WHERE state = 'queued'",
        "TRUNCATE bench_raw RESTART IDENTITY",
        f"INSERT INTO bench_raw (state) SELECT 'queued' FROM generate_series(1, {int(rows)})",
    )
    run_sql(url, "VACUUM ANALYZE bench_raw", autocommit=True)


def fill_pgqueuer(url: str, rows: int) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    async def fill() -> None:
        conn = await asyncpg.connect(libpq_url(url))
        try:
            q = Queries(AsyncpgDriver(conn))
            if not await q.schema_is_installed():
                await q.install()
            await q.clear_queue()
            for first in range(0, rows, 1000):
                n = min(1000, rows - first)
                await q.enqueue(["noop"] * n, [None] * n, [0] * n)
        finally:
            await conn.close()

    asyncio.run(fill())
    run_sql(url, "VACUUM ANALYZE", autocommit=True)


# -- parts of the benchmark


def bench_enqueue(url: str, sizes: Sizes, settings: Settings) -> list[list[object]]:
    engine = create_engine(url, pool_size=1)
    try:
        total, seconds = 0, 0.0
        for b in range(sizes.enqueue_batches):
            batch = [EnqueueRequest.build(key=f"E-{b}-{i}") for i in range(10_000)]
            t = time.perf_counter()
            with engine.begin() as conn:
                results = queue.enqueue(conn, batch, settings=settings)
            seconds += time.perf_counter() - t
            total += sum(r.inserted for r in results)
        return [
            ["enqueue, batch of 10,000 (one statement + commit)", total, seconds, total / seconds]
        ]
    finally:
        engine.dispose()


def bench_drains(
    url: str, sizes: Sizes, *, pgqueuer_url: str | None
) -> tuple[list[Drain], str | None]:
    results: list[Drain] = []
    for batch in BATCHES:
        rows = sizes.rows_batch_1 if batch == 1 else sizes.rows_batch_50
        for processes in PROCESS_COUNTS:
            fill_enrichq(url, rows)
            results.append(drain("enrichq", enrichq_worker, url, batch, processes))
            console.print(f"  {results[-1]}")
            fill_raw(url, rows)
            results.append(drain("raw SQL", raw_worker, url, batch, processes))
            console.print(f"  {results[-1]}")
    pgqueuer_status: str | None = None
    if pgqueuer_url is None:
        pgqueuer_status = "not installed: pip install pgqueuer asyncpg (the [bench] extra)"
    else:
        try:
            for processes in PGQUEUER_PROCESSES:
                fill_pgqueuer(pgqueuer_url, sizes.pgqueuer_rows)
                results.append(
                    drain("pgqueuer", pgqueuer_worker, pgqueuer_url, PGQUEUER_BATCH, processes)
                )
                console.print(f"  {results[-1]}")
        except Exception as exc:  # a peer's failure is reported, not fatal
            pgqueuer_status = f"failed: {str(exc).strip().splitlines()[-1]}"
    return results, pgqueuer_status


def bench_latency(url: str, history_url: str, tenants_url: str, sizes: Sizes) -> list[list[float]]:
    """Claim latency (claim statement + commit), one process, batch 50, completes untimed:
    on a table without history, on one with `latency_terminal_rows` terminal rows, and on
    one whose claim counts hold LATENCY_TENANTS tenants over 48 hours, taking turns every 50
    claims so all three see the same machine load."""
    rows = sizes.latency_claims * LATENCY_BATCH
    fill_enrichq(url, rows)
    fill_enrichq(history_url, rows, terminal=sizes.latency_terminal_rows)
    fill_enrichq(tenants_url, rows, tenants=LATENCY_TENANTS)
    engines = [create_engine(u, pool_size=1) for u in (url, history_url, tenants_url)]
    latencies: list[list[float]] = [[], [], []]
    try:
        for n in range(sizes.latency_claims * 3):
            side = (n // 50) % 3
            engine = engines[side]
            t = time.perf_counter()
            with engine.begin() as conn:
                jobs = queue.claim(
                    conn,
                    kinds=("enrich",),
                    owner="lat",
                    limit=LATENCY_BATCH,
                    lease_seconds=LEASE_SECONDS,
                )
            latencies[side].append(time.perf_counter() - t)
            with engine.begin() as conn:
                queue.complete(conn, owner="lat", jobs=jobs)
        return latencies
    finally:
        for engine in engines:
            engine.dispose()


@dataclass(frozen=True)
class Spread:
    """One table of the claim-cost-by-tenants part: who holds its queued rows."""

    label: str
    tenants: int  # the queued rows are spread over this many tenants
    hidden: bool  # they are not visible yet; one tenant's visible backlog beside them


SPREADS = (
    Spread("1 tenant", 1, hidden=False),
    Spread(f"{LATENCY_TENANTS:,} tenants", LATENCY_TENANTS, hidden=False),
    Spread(f"{LATENCY_TENANTS:,} tenants not visible yet", LATENCY_TENANTS, hidden=True),
)


def fill_spread(url: str, spread: Spread) -> None:
    """SPREAD_TERMINAL done rows, then SPREAD_QUEUED queued rows over `spread.tenants`
    tenants (visible now, or in 10 minutes beside one tenant's SPREAD_QUEUED visible rows)."""
    visible = "now() + interval '10 minutes'" if spread.hidden else "now() - interval '1 second'"
    statements = [
        "TRUNCATE enrichq.queue, enrichq.tenant_served RESTART IDENTITY",
        "INSERT INTO enrichq.queue (kind, key, tenant, reason, state, visible_at, attempts,"
        " max_attempts, finished_at, created_at, updated_at)"
        " SELECT 'enrich', 'H-' || g, 'hist-' || (g % 5000), 'created', 'done',"
        "  now() - interval '2 days', 1, 5, now() - interval '1 day', now() - interval '2 days',"
        "  now() - interval '1 day'"
        f" FROM generate_series(1, {SPREAD_TERMINAL}) AS g",
        "INSERT INTO enrichq.queue (kind, key, tenant, reason, visible_at, max_attempts)"
        f" SELECT 'enrich', 'S-' || g, 'spread-' || (g % {int(spread.tenants)}), 'manual',"
        f"  {visible}, 5"
        f" FROM generate_series(1, {SPREAD_QUEUED}) AS g",
    ]
    if spread.hidden:
        statements.append(
            "INSERT INTO enrichq.queue (kind, key, tenant, reason, visible_at, max_attempts)"
            " SELECT 'enrich', 'V-' || g, 'busy', 'manual', now() - interval '1 second', 5"
            f" FROM generate_series(1, {SPREAD_QUEUED}) AS g"
        )
    run_sql(url, *statements)
    run_sql(url, "VACUUM ANALYZE enrichq.queue", autocommit=True)


def bench_spread(urls: Sequence[str], sizes: Sizes, batch: int) -> list[list[float]]:
    """Claim latency (claim statement + commit), one process, batches of `batch`, on each SPREADS
    table, with the plan made with the values and then with the worker's claim engine
    (generic plan), the tables taking turns every 50 claims. Untimed after each claim: its
    jobs complete and as many rows of the same tenants are enqueued, visible now, so every
    claim meets the tenants and the backlog the table started with."""
    settings = Settings.load(database_url=urls[0], delay_created_seconds=0)
    for url, spread in zip(urls, SPREADS, strict=True):
        fill_spread(url, spread)
    custom = [create_engine(u, pool_size=1) for u in urls]
    built = [build_engines(Settings.load(database_url=u), u) for u in urls]
    engines = custom + [b.claims for b in built]
    latencies: list[list[float]] = [[] for _ in engines]
    try:
        for n in range(sizes.latency_claims * len(engines)):
            side = (n // 50) % len(engines)
            engine = engines[side]
            t = time.perf_counter()
            with engine.begin() as conn:
                jobs = queue.claim(
                    conn,
                    kinds=("enrich",),
                    owner="lat",
                    limit=batch,
                    lease_seconds=LEASE_SECONDS,
                )
            latencies[side].append(time.perf_counter() - t)
            with custom[side % len(urls)].begin() as conn:
                queue.complete(conn, owner="lat", jobs=jobs)
                # the table's own key and this claim's number: a key that kept every
                # claim's number would outgrow the 200 characters a key may hold
                again = [
                    EnqueueRequest.build(
                        key=f"{'-'.join(j.key.split('-')[:2])}-{n}",
                        tenant=j.tenant,
                        delay_seconds=0,
                    )
                    for j in jobs
                ]
                queue.enqueue(conn, again, settings=settings)
        return latencies
    finally:
        for engine in custom:
            engine.dispose()
        for b in built:
            b.dispose()


def soak_producer(
    *, url: str, rate: float, minutes: float, counter: Any, start: Any, out: Any
) -> None:
    """Enqueue `rate` jobs/s in ticks of 100 ms for `minutes`."""

    def body() -> int:
        settings = Settings.load(database_url=url, delay_created_seconds=0, delay_updated_seconds=0)
        engine = create_engine(url, pool_size=1, application_name="bench-soak-producer")
        try:
            start.wait()
            began = time.perf_counter()
            deadline = began + minutes * 60
            tick, sent = 0, 0
            while time.perf_counter() < deadline:
                tick += 1
                due = int(rate * (time.perf_counter() - began)) - sent
                if due > 0:
                    batch = [EnqueueRequest.build(key=f"S-{tick}-{i}") for i in range(due)]
                    with engine.begin() as conn:
                        queue.enqueue(conn, batch, settings=settings)
                    sent += due
                    with counter.get_lock():
                        counter.value += due
                time.sleep(max(0.0, began + tick * 0.1 - time.perf_counter()))
            return sent
        finally:
            engine.dispose()

    _report(out, body)


def soak_worker(*, url: str, owner: str, stop: Any, counter: Any, start: Any, out: Any) -> None:
    """Claim batches of 50 and complete them until told to stop; poll every 20 ms when idle."""

    def body() -> int:
        engine = create_engine(url, pool_size=1, application_name=f"bench-soak-{owner}")
        done = 0
        try:
            start.wait()
            while not stop.is_set():
                with engine.begin() as conn:
                    jobs = queue.claim(
                        conn, kinds=("enrich",), owner=owner, limit=50, lease_seconds=LEASE_SECONDS
                    )
                if not jobs:
                    time.sleep(0.02)
                    continue
                with engine.begin() as conn:
                    n = len(queue.complete(conn, owner=owner, jobs=jobs))
                done += n
                with counter.get_lock():
                    counter.value += n
            return done
        finally:
            engine.dispose()

    _report(out, body)


def bench_soak(
    url: str, minutes: float, rate: float, *, vacuum_standin: bool
) -> list[list[object]]:
    """Producer + 2 workers for `minutes`; one row per minute. With `vacuum_standin`, the
    monitor VACUUMs the queue table after each minute's sample (for servers that run
    with autovacuum off, where the table's autovacuum settings do nothing)."""
    run_sql(url, "TRUNCATE enrichq.queue, enrichq.tenant_served RESTART IDENTITY")
    run_sql(url, "VACUUM ANALYZE enrichq.queue", autocommit=True)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(4)
    out = ctx.Queue()
    stop = ctx.Event()
    enqueued = ctx.Value("q", 0)
    completed = ctx.Value("q", 0)
    procs = [
        ctx.Process(
            target=soak_producer,
            kwargs={
                "url": url,
                "rate": rate,
                "minutes": minutes,
                "counter": enqueued,
                "start": start,
                "out": out,
            },
        ),
        *[
            ctx.Process(
                target=soak_worker,
                kwargs={
                    "url": url,
                    "owner": f"s{n}",
                    "stop": stop,
                    "counter": completed,
                    "start": start,
                    "out": out,
                },
            )
            for n in range(2)
        ],
    ]
    for proc in procs:
        proc.start()
    rows: list[list[object]] = []
    engine = create_engine(url, pool_size=1)
    try:
        start.wait()
        began = time.perf_counter()
        last_enqueued = last_completed = 0
        for minute in range(1, round(minutes) + 1):
            time.sleep(max(0.0, began + 60 * minute - time.perf_counter()))
            now_enqueued, now_completed = enqueued.value, completed.value
            with engine.connect() as conn:
                stats = conn.execute(
                    sa.text(
                        "SELECT n_dead_tup, n_live_tup, autovacuum_count"
                        " FROM pg_stat_user_tables WHERE relid = 'enrichq.queue'::regclass"
                    )
                ).one()
                backlog = conn.execute(
                    sa.text("SELECT count(*) FROM enrichq.queue WHERE state = 'queued'")
                ).scalar_one()
            done = now_completed - last_completed
            rows.append(
                [
                    minute,
                    now_enqueued - last_enqueued,
                    done,
                    done / 60,
                    backlog,
                    stats.n_dead_tup,
                    stats.n_live_tup,
                    stats.autovacuum_count,
                ]
            )
            console.print(f"  soak minute {minute}: {rows[-1]}")
            if vacuum_standin:
                run_sql(url, "VACUUM enrichq.queue", autocommit=True)
            last_enqueued, last_completed = now_enqueued, now_completed
        stop.set()
        results = [out.get(timeout=120) for _ in procs]
        failures = [r for r in results if isinstance(r, str)]
        if failures:
            raise RuntimeError(f"a soak process failed:\n{failures[0]}")
    finally:
        stop.set()
        engine.dispose()
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    return rows


# -- reporting


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def verdict(value: float, target: float, *, higher_is_better: bool = True) -> str:
    if math.isnan(value):  # not measured
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "MISSED"


def report_drains(drains: list[Drain], pgqueuer_status: str | None) -> list[list[object]]:
    by = {(d.system, d.batch, d.processes): d for d in drains}
    pgq = {d.processes: d.rate for d in drains if d.system == "pgqueuer"}
    rows: list[list[object]] = []
    for d in drains:
        raw = by.get(("raw SQL", d.batch, d.processes))
        vs_raw = ratio(d.rate, raw.rate) if raw and d.system != "raw SQL" else float("nan")
        vs_pgq = (
            ratio(d.rate, pgq[d.processes])
            if d.system.startswith("enrichq") and d.batch == 50 and d.processes in pgq
            else float("nan")
        )
        rows.append(
            [
                d.system,
                d.batch,
                d.processes,
                d.jobs,
                d.seconds,
                d.rate,
                d.claim_ms,
                d.complete_ms,
                vs_raw,
                vs_pgq,
            ]
        )
    print_table(
        "claim → complete of no-op jobs (one transaction per claim, one per complete)",
        [
            "system",
            "batch",
            "procs",
            "jobs",
            "seconds",
            "jobs/s",
            "ms/claim",
            "ms/complete",
            "x raw",
            "x pgqueuer",
        ],
        rows,
        note=(
            "backlog pre-filled visible now, no tenant; raw SQL = bare table, partial index on"
            " queued, psycopg; pgqueuer = QueueManager drain mode, asyncpg, batch 100"
            + (f"\npgqueuer {pgqueuer_status}" if pgqueuer_status else "")
        ),
    )
    targets: list[list[object]] = []
    for batch in BATCHES:
        for label, procs in (("1 process", (1,)), ("best of 2-4", (2, 4))):
            mine = max(
                (by[("enrichq", batch, p)].rate, p) for p in procs if ("enrichq", batch, p) in by
            )
            raw_rate = by[("raw SQL", batch, mine[1])].rate
            value = ratio(mine[0], raw_rate)
            targets.append(
                [
                    f"enrichq ≥ {TARGET_RAW_RATIO}x raw, batch {batch}, {label}",
                    f"{value:.2f}x",
                    f"{mine[0]:,.0f} vs {raw_rate:,.0f} jobs/s ({mine[1]} procs)",
                    verdict(value, TARGET_RAW_RATIO),
                ]
            )
    if pgq:
        best_pgq = max(pgq.values())
        best_mine = max(by[("enrichq", 50, p)].rate for p in PGQUEUER_PROCESSES)
        value = ratio(best_mine, best_pgq)
        targets.append(
            [
                f"enrichq ≥ {TARGET_PGQUEUER_RATIO}x pgqueuer, best of 2-4 processes",
                f"{value:.2f}x",
                f"{best_mine:,.0f} (batch 50) vs {best_pgq:,.0f} (batch 100) jobs/s",
                verdict(value, TARGET_PGQUEUER_RATIO),
            ]
        )
    else:
        targets.append(
            [
                f"enrichq ≥ {TARGET_PGQUEUER_RATIO}x pgqueuer",
                "n/a",
                f"pgqueuer {pgqueuer_status}",
                "n/a",
            ]
        )
    return targets


def report_latency(sizes: Sizes, latencies: list[list[float]]) -> list[list[object]]:
    empty, full, tenants = latencies
    p50 = [percentile(side, 50) * 1000 for side in latencies]
    print_table(
        f"claim latency, 1 process, batch {LATENCY_BATCH}, {sizes.latency_claims:,} claims each"
        " (ms, claim + commit; the three tables take turns every 50 claims)",
        ["history", "p50", "p99", "max"],
        [
            ["none", p50[0], percentile(empty, 99) * 1000, max(empty) * 1000],
            [
                f"{sizes.latency_terminal_rows:,} terminal rows",
                p50[1],
                percentile(full, 99) * 1000,
                max(full) * 1000,
            ],
            [
                f"{LATENCY_TENANTS:,} tenants, 48 h served",
                p50[2],
                percentile(tenants, 99) * 1000,
                max(tenants) * 1000,
            ],
        ],
    )
    targets: list[list[object]] = []
    for what, value in (
        (f"{sizes.latency_terminal_rows:,} terminal rows", p50[1]),
        (f"{LATENCY_TENANTS:,} tenants of history", p50[2]),
    ):
        x = ratio(value, p50[0])
        targets.append(
            [
                f"claim p50 with {what} ≤ {TARGET_LATENCY_RATIO}x none",
                f"{x:.2f}x",
                f"{value:.2f} vs {p50[0]:.2f} ms",
                verdict(x, TARGET_LATENCY_RATIO, higher_is_better=False),
            ]
        )
    return targets


def report_spread(sizes: Sizes, by_batch: dict[int, list[list[float]]]) -> list[list[object]]:
    plans = ("values", "generic")
    rows: list[list[object]] = []
    p50: dict[tuple[int, str, str], float] = {}
    for batch, latencies in by_batch.items():
        for i, side in enumerate(latencies):
            spread, plan = SPREADS[i % len(SPREADS)], plans[i // len(SPREADS)]
            p50[(batch, spread.label, plan)] = percentile(side, 50) * 1000
            rows.append(
                [
                    batch,
                    spread.label,
                    plan,
                    p50[(batch, spread.label, plan)],
                    percentile(side, 99) * 1000,
                    max(side) * 1000,
                ]
            )
    print_table(
        f"claim latency by tenants with queued work, 1 process, {sizes.latency_claims:,} claims"
        f" each (ms, claim + commit; {SPREAD_QUEUED:,} queued rows, {SPREAD_TERMINAL:,}"
        " terminal rows)",
        ["batch", "queued rows of", "plan", "p50", "p99", "max"],
        rows,
        note="not visible yet: visible in 10 minutes, beside one tenant's visible backlog;"
        " a batch over 5,000 tenants takes one row of each of its pairs",
    )
    targets: list[list[object]] = []
    one = SPREADS[0].label
    for batch in by_batch:
        for spread in SPREADS[1:]:
            for plan in plans:
                x = ratio(p50[(batch, spread.label, plan)], p50[(batch, one, plan)])
                targets.append(
                    [
                        f"claim p50 at batch {batch}, queued rows of {spread.label}"
                        f" ≤ {TARGET_LATENCY_RATIO}x of {one} ({plan} plan)",
                        f"{x:.2f}x",
                        f"{p50[(batch, spread.label, plan)]:.2f} vs"
                        f" {p50[(batch, one, plan)]:.2f} ms",
                        verdict(x, TARGET_LATENCY_RATIO, higher_is_better=False),
                    ]
                )
    return targets


def server_setting(name: str) -> str:
    with psycopg.connect(libpq_url(server_url())) as conn:
        row = conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
    return str(row[0]) if row else "?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="shrink everything (~2 minutes)")
    parser.add_argument(
        "--soak-minutes", type=float, default=None, help="soak length (10; 1 with --quick)"
    )
    parser.add_argument(
        "--soak-rate",
        type=float,
        default=None,
        help="soak enqueue rate, jobs/s (default: a quarter of enrichq's 2-process batch-50 rate)",
    )
    parser.add_argument("--skip-soak", action="store_true", help="leave the soak out")
    parser.add_argument(
        "--latency-only", action="store_true", help="run only the claim-latency parts"
    )
    parser.add_argument(
        "--soak-only", action="store_true", help="run only the soak (needs --soak-rate)"
    )
    parser.add_argument(
        "--vacuum-standin",
        action="store_true",
        help="VACUUM the queue table every soak minute (for servers with autovacuum off)",
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    soak_minutes = args.soak_minutes if args.soak_minutes is not None else sizes.soak_minutes
    if soak_minutes <= 0 or soak_minutes != int(soak_minutes):
        parser.error("--soak-minutes must be a whole number of minutes, at least 1")
    if args.soak_rate is not None and args.soak_rate <= 0:
        parser.error("--soak-rate must be positive")
    if args.soak_only and (args.soak_rate is None or args.skip_soak):
        parser.error("--soak-only needs --soak-rate and no --skip-soak")

    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401

        have_pgqueuer = True
    except ImportError:
        have_pgqueuer = False

    targets: list[list[object]] = []
    autovacuum = server_setting("autovacuum")
    drains: list[Drain] = []
    if args.latency_only:
        with scratch_database("queue_bench") as url:
            latencies, spread = run_latency(url, sizes)
        console.rule("results")
        targets += report_latency(sizes, latencies)
        targets += report_spread(sizes, spread)
        print_table("targets (issues 3, 26)", ["target", "measured", "detail", "verdict"], targets)
        return 0
    with scratch_database("queue_bench") as url:
        if not args.soak_only:
            settings = Settings.load(
                database_url=url, delay_created_seconds=0, delay_updated_seconds=0
            )
            console.print("[bold]enqueue[/bold]")
            enqueue_rows = bench_enqueue(url, sizes, settings)
            console.print("[bold]claim → complete[/bold]")
            with maybe_scratch("pgqueuer_bench", have_pgqueuer) as pgq_url:
                drains, pgq_status = bench_drains(url, sizes, pgqueuer_url=pgq_url)
            latencies, spread = run_latency(url, sizes)
        rate = args.soak_rate or SOAK_SHARE * max(
            d.rate for d in drains if (d.system, d.batch, d.processes) == ("enrichq", 50, 2)
        )
        soak_rows: list[list[object]] = []
        if not args.skip_soak:
            console.print(f"[bold]soak[/bold] {soak_minutes:g} min at {rate:,.0f} jobs/s")
            soak_rows = bench_soak(url, soak_minutes, rate, vacuum_standin=args.vacuum_standin)

    console.rule("results")
    if not args.soak_only:
        print_table("enqueue", ["what", "jobs", "seconds", "jobs/s"], enqueue_rows)
        targets += report_drains(drains, pgq_status)
        targets += report_latency(sizes, latencies)
        targets += report_spread(sizes, spread)
    if soak_rows:
        vacuum_note = f"server autovacuum = {autovacuum}" + (
            "; the monitor VACUUMs the queue table each minute" if args.vacuum_standin else ""
        )
        print_table(
            f"soak: 1 producer at {rate:,.0f} jobs/s, 2 workers (batch 50), per minute",
            [
                "minute",
                "enqueued",
                "completed",
                "jobs/s",
                "backlog",
                "n_dead_tup",
                "n_live_tup",
                "autovacuums",
            ],
            soak_rows,
            note=vacuum_note,
        )
        first, last = float(soak_rows[0][3]), float(soak_rows[-1][3])  # type: ignore[arg-type]  # the figures column is numeric
        value = ratio(last, first)
        targets.append(
            [
                f"soak: last minute ≥ {TARGET_SOAK_RATIO:.0%} of the first",
                f"{value:.2f}x",
                f"{last:,.0f} vs {first:,.0f} jobs/s ({vacuum_note})",
                verdict(value, TARGET_SOAK_RATIO),
            ]
        )
    print_table("targets (issues 3, 26)", ["target", "measured", "detail", "verdict"], targets)
    return 0


def run_latency(url: str, sizes: Sizes) -> tuple[list[list[float]], dict[int, list[list[float]]]]:
    """Both claim-latency parts, on scratch databases beside `url`."""
    console.print("[bold]claim latency[/bold]")
    with (
        scratch_database("queue_bench_history") as history_url,
        scratch_database("queue_bench_tenants") as tenants_url,
    ):
        latencies = bench_latency(url, history_url, tenants_url, sizes)
    console.print("[bold]claim latency by tenants with queued work[/bold]")
    with (
        scratch_database("queue_bench_one") as one_url,
        scratch_database("queue_bench_spread") as spread_url,
        scratch_database("queue_bench_hidden") as hidden_url,
    ):
        spread = {
            batch: bench_spread([one_url, spread_url, hidden_url], sizes, batch)
            for batch in SPREAD_BATCHES
        }
    return latencies, spread


@contextmanager
def maybe_scratch(label: str, wanted: bool) -> Iterator[str | None]:
    """A bare scratch database when `wanted`, else None."""
    if not wanted:
        yield None
        return
    with scratch_database(label, migrated=False) as url:
        yield url


if __name__ == "__main__":
    raise SystemExit(main())
