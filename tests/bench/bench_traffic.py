"""Batched lookups at real traffic (issue 30): the lookup window on against off, side by side.

    python -m tests.bench.bench_traffic [--rates 2,20,100] [--seconds S] [--window W]
                                        [--latency S] [--delay S]

In one run, on a scratch database of the benchmark server (ENRICHQ_TEST_DATABASE_URL or
the local default) seeded with one world: for each rate, events (`updated`, one ticket
each, one transaction each, like webhook ingest) arrive steadily for --seconds, and two
worker processes (settings otherwise the defaults) enrich them with the built-in batch
lookup against a MODEL of BigQuery (tests/support/warehouse_model.py: every query waits
--latency seconds and bills the bytes of the columns it references, at least 10 MB).
Each rate runs twice: with ENRICHQ_LOOKUP_WINDOW_SECONDS=--window (default: the setting's
default) and with 0 (claimed the moment visible, the behaviour before the window).

Per run: tickets done, warehouse queries (distinct job ids in the lookup log), tickets per
query, MB billed per ticket (the lookup log, checked against the model), and the latency
from each event's nominal visibility (its arrival plus the visibility delay, not the
visible_at the window moves) to done, p50 and p99. Targets with the default window: ≥ 20
tickets per query at 2 events/s and ≥ 25 at 20 and 100; MB billed per ticket ≤ 1/20 of the
window off; p99 latency ≤ the window off's p99 + the window + 2 s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from enrichq_schema.db import create_engine
from enrichq_schema.settings import LOOKUP_WINDOW_SECONDS_DEFAULT, Settings
from enrichq_service import queue, seed
from enrichq_service.queue import EnqueueRequest
from tests.bench.common import print_table, scratch_database
from tests.support.settings import make_settings
from tests.support.warehouse_model import LATENCY_SECONDS_DEFAULT, attach

MB = 1024 * 1024
WORKERS = 2
MIN_TICKETS_PER_QUERY = {2.0: 20.0}  # and 25 at every higher rate
MIN_TICKETS_PER_QUERY_DEFAULT = 25.0
MIN_SAVING = 20.0
LATENCY_SLACK_SECONDS = 2.0


@dataclass(frozen=True)
class Run:
    """One rate, one window: what was done and what it cost."""

    rate: float
    window: float
    tickets: int
    queries: int
    model_bytes: int
    logged_bytes: int
    p50: float
    p99: float

    @property
    def per_query(self) -> float:
        return self.tickets / self.queries if self.queries else float("nan")

    @property
    def mb_per_ticket(self) -> float:
        return self.logged_bytes / self.tickets / MB


def worker_child(*, url: str, window: float, latency: float, stop: Any, out: Any) -> None:
    """One worker, wired like `enrichq worker`, its warehouse engine under the model,
    running until `stop` is set."""
    try:
        from enrichq_service.worker import Worker, build_engines

        settings = Settings.load(
            database_url=url, warehouse_url=url, metrics_port=0, lookup_window_seconds=window
        )
        engines = build_engines(settings, url)
        model = attach(engines.warehouse, latency_seconds=latency)
        try:
            worker = Worker(
                settings, engines.queue, warehouse=engines.warehouse, claims=engines.claims
            )

            def stop_when_told() -> None:
                stop.wait()
                worker.stop.set()

            threading.Thread(target=stop_when_told, daemon=True).start()
            worker.run()
        finally:
            engines.dispose()
        out.put((model.queries, model.bytes_billed))
    except Exception:  # the parent raises it with the traceback
        out.put(traceback.format_exc())


def run_rate(
    url: str,
    keys: list[str],
    *,
    rate: float,
    seconds: float,
    window: float,
    latency: float,
    delay: float,
) -> Run:
    """Events at `rate` for `seconds`, two workers with the window `window`, until done."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "TRUNCATE enrichq.queue, enrichq.runs, enrichq.ticket_orders,"
                    " enrichq.ticket_enrichments, enrichq.lookup_log, enrichq.budget_ledger,"
                    " enrichq.queue_heads, enrichq.tenant_served"
                )
            )
        ctx = multiprocessing.get_context("spawn")
        out, stop = ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(
                target=worker_child,
                kwargs={"url": url, "window": window, "latency": latency, "stop": stop, "out": out},
            )
            for _ in range(WORKERS)
        ]
        for p in procs:
            p.start()
        time.sleep(5)  # the workers up and idle before the first event
        settings = make_settings(url, delay_updated_seconds=delay, lookup_window_seconds=window)
        count = int(rate * seconds)
        start = time.monotonic()
        for i, key in enumerate(keys[:count]):
            due = start + i / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            with engine.begin() as conn:
                queue.enqueue(
                    conn, [EnqueueRequest.build(key=key, reason="updated")], settings=settings
                )
        deadline = time.monotonic() + window + 600
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                done = conn.execute(
                    sa.text("SELECT count(*) FROM enrichq.queue WHERE state = 'done'")
                ).scalar_one()
            if done >= count:
                break
            time.sleep(0.5)
        stop.set()
        reports = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(60)
        for r in reports:
            if isinstance(r, str):
                raise RuntimeError(f"a worker process failed:\n{r}")
        model_queries = sum(r[0] for r in reports)
        model_bytes = sum(r[1] for r in reports)
        with engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM enrichq.queue WHERE state = 'done') AS done,"
                    " (SELECT count(DISTINCT job_id) FROM enrichq.lookup_log) AS queries,"
                    " (SELECT coalesce(sum(bytes_billed), 0) FROM enrichq.lookup_log) AS billed,"
                    " (SELECT percentile_disc(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY"
                    "   extract(epoch FROM finished_at - created_at) - :delay)"
                    "  FROM enrichq.queue WHERE state = 'done') AS latency"
                ),
                {"delay": delay},
            ).one()
        assert row.done == count, f"{rate}/s, window {window}: {row.done} of {count} done"
        assert row.queries == model_queries, (row.queries, model_queries)
        assert int(row.billed) == model_bytes, (row.billed, model_bytes)
        p50, p99 = (float(x) for x in row.latency)
        return Run(rate, window, count, row.queries, model_bytes, int(row.billed), p50, p99)
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2,20,100", help="events/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=40.0, help="arrivals per rate")
    parser.add_argument("--window", type=float, default=float(LOOKUP_WINDOW_SECONDS_DEFAULT))
    parser.add_argument("--latency", type=float, default=LATENCY_SECONDS_DEFAULT)
    parser.add_argument("--delay", type=float, default=2.0, help="visibility delay, seconds")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    needed = int(max(rates) * args.seconds) + 1
    runs: list[tuple[Run, Run]] = []
    with scratch_database("traffic") as url:
        engine = create_engine(url)
        with engine.begin() as conn:
            seed.seed_world(conn, tickets=needed)
        keys = [r[0] for r in engine.connect().execute(sa.text("SELECT id FROM helpdesk.tickets"))]
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE"))
        engine.dispose()
        for rate in rates:
            kw = {
                "rate": rate,
                "seconds": args.seconds,
                "latency": args.latency,
                "delay": args.delay,
            }
            on = run_rate(url, keys, window=args.window, **kw)
            off = run_rate(url, keys, window=0.0, **kw)
            runs.append((on, off))
    rows: list[list[object]] = []
    verdicts: list[str] = []
    for on, off in runs:
        for r in (on, off):
            rows.append(
                [
                    f"{r.rate:g}/s",
                    f"{r.window:g} s" if r.window else "off",
                    r.tickets,
                    r.queries,
                    r.per_query,
                    r.mb_per_ticket,
                    r.p50,
                    r.p99,
                ]
            )
        want = MIN_TICKETS_PER_QUERY.get(on.rate, MIN_TICKETS_PER_QUERY_DEFAULT)
        saving = off.mb_per_ticket / on.mb_per_ticket
        added = on.p99 - off.p99
        ok = (
            on.per_query >= want
            and saving >= MIN_SAVING
            and added <= on.window + LATENCY_SLACK_SECONDS
        )
        verdicts.append(
            f"{on.rate:g}/s: {on.per_query:.1f} tickets/query (≥ {want:g}), MB/ticket 1/{saving:.1f}"
            f" of off (≤ 1/{MIN_SAVING:g}), p99 +{added:.1f} s (≤ {on.window:g} + "
            f"{LATENCY_SLACK_SECONDS:g}): {'met' if ok else 'NOT met'}"
        )
    print_table(
        f"enrichq at steady traffic: {WORKERS} workers, BigQuery model "
        f"{args.latency * 1000:g} ms a query, {args.seconds:g} s of arrivals a rate",
        [
            "events",
            "window",
            "tickets",
            "queries",
            "tickets/query",
            "MB billed/ticket",
            "latency p50 s",
            "latency p99 s",
        ],
        rows,
        note="; ".join(verdicts)
        + ". Latency: from the event's arrival + visibility delay to done.",
    )


if __name__ == "__main__":
    main()
