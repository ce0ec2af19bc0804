"""The warehouse path (issue 16): per-ticket lookups against batched ones, side by side.

    python -m tests.bench.bench_warehouse [--latency S] [--tickets N] [--single-tickets N]

In one run, on a scratch database of the benchmark server (ENRICHQ_TEST_DATABASE_URL or
the local default) seeded with one world, whose warehouse is also copied into a DuckDB
file: one worker process at a time (concurrency 8, the default) drains the queue

1. with the per-ticket built-in lookup (`warehouse_lookup`), and
2. with the batched built-in lookup (the default, batches of ENRICHQ_LOOKUP_BATCH_SIZE),

both against a MODEL of BigQuery (tests/support/warehouse_model.py, over the PostgreSQL
warehouse): every query waits --latency seconds (default 0.8) and bills the bytes of the
columns it references in the tables it reads, at least 10 MB. It is a cost model, not
BigQuery. Then the batched lookup against the PostgreSQL warehouse and against the DuckDB
one without the latency (the model still counts the bytes). Tickets/s is the worker's run
log (its first claim to its stop), bytes billed per ticket what enrichq's lookup log
charged (checked against what the model billed). Targets: with the latency, batched ≥ 25x
the per-ticket tickets/s and ≤ 1/25 of its bytes billed per ticket.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from enrichq_schema.db import create_engine, create_warehouse_engine
from enrichq_schema.settings import LOOKUP_BATCH_SIZE_DEFAULT, Settings
from enrichq_service import queue, seed
from enrichq_service.queue import EnqueueRequest
from tests.bench.common import print_table, scratch_database
from tests.support.settings import make_settings
from tests.support.warehouse_model import LATENCY_SECONDS_DEFAULT, MIN_BYTES_BILLED, attach

TARGET_SPEEDUP = 25.0
MB = 1024 * 1024
PER_TICKET = "enrichq_service.enrich:warehouse_lookup"


@dataclass(frozen=True)
class Run:
    """One drain: what ran, how fast, and what it billed."""

    label: str
    warehouse: str
    latency: float
    tickets: int
    seconds: float
    queries: int
    model_bytes: int
    logged_bytes: int

    @property
    def rate(self) -> float:
        return self.tickets / self.seconds

    @property
    def bytes_per_ticket(self) -> float:
        return self.logged_bytes / self.tickets


def worker_child(
    *, url: str, warehouse_url: str, enricher: str | None, latency: float, out: Any
) -> None:
    """One worker, wired like `enrichq worker`, its warehouse engine under the model."""
    try:
        from enrichq_service.worker import Worker, build_engines

        settings = Settings.load(
            database_url=url, warehouse_url=warehouse_url, enricher=enricher, metrics_port=0
        )
        engines = build_engines(settings, url)
        model = attach(engines.warehouse, latency_seconds=latency)
        try:
            worker = Worker(
                settings, engines.queue, warehouse=engines.warehouse, claims=engines.claims
            )
            worker.run(drain=True)
        finally:
            engines.dispose()
        out.put((model.queries, model.bytes_billed))
    except Exception:  # the parent raises it with the traceback
        out.put(traceback.format_exc())


def drain(
    url: str,
    warehouse_url: str,
    keys: list[str],
    *,
    label: str,
    warehouse: str,
    enricher: str | None,
    latency: float,
) -> Run:
    """Enqueue `keys` afresh and drain them with one worker process."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "TRUNCATE enrichq.queue, enrichq.runs, enrichq.ticket_orders,"
                    " enrichq.ticket_enrichments, enrichq.lookup_log, enrichq.budget_ledger"
                )
            )
            queue.enqueue(
                conn, [EnqueueRequest.build(key=k) for k in keys], settings=make_settings(url)
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE enrichq.queue"))
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(
            target=worker_child,
            kwargs={
                "url": url,
                "warehouse_url": warehouse_url,
                "enricher": enricher,
                "latency": latency,
                "out": out,
            },
        )
        proc.start()
        reported = out.get(timeout=3600)
        proc.join(60)
        if isinstance(reported, str):
            raise RuntimeError(f"the worker process failed:\n{reported}")
        queries, model_bytes = reported
        with engine.connect() as conn:
            done, seconds, logged = conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM enrichq.queue WHERE state = 'done'),"
                    " (SELECT extract(epoch FROM max(finished_at) - min(started_at))"
                    "  FROM enrichq.runs),"
                    " (SELECT coalesce(sum(bytes_billed), 0) FROM enrichq.lookup_log)"
                )
            ).one()
        assert done == len(keys), f"{label}: {done} of {len(keys)} done"
        assert logged == model_bytes, (
            f"{label}: logged {logged} bytes, the model billed {model_bytes}"
        )
        return Run(
            label, warehouse, latency, done, float(seconds), queries, model_bytes, int(logged)
        )
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=LATENCY_SECONDS_DEFAULT)
    parser.add_argument("--tickets", type=int, default=5000, help="batched runs")
    parser.add_argument("--single-tickets", type=int, default=240, help="the per-ticket run")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="enrichq-bench-warehouse-"))
    duckdb_url = f"duckdb:///{folder / 'dw.duckdb'}"
    with scratch_database("warehouse") as url:
        engine = create_engine(url)
        with engine.begin() as conn:
            seed.seed_world(conn, tickets=args.tickets)
        keys = [r[0] for r in engine.connect().execute(sa.text("SELECT id FROM helpdesk.tickets"))]
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE"))
        duck = create_warehouse_engine(duckdb_url, pool_size=1)
        with engine.connect() as src, duck.begin() as dst:
            seed.copy_warehouse(src, dst)
        sizes = attach(duck, latency_seconds=0).tables
        duck.dispose()
        engine.dispose()
        runs = [
            drain(
                url,
                url,
                keys[: args.single_tickets],
                label="per ticket (warehouse_lookup)",
                warehouse="BigQuery model over PostgreSQL",
                enricher=PER_TICKET,
                latency=args.latency,
            ),
            drain(
                url,
                url,
                keys,
                label=f"batched (built-in, batch {LOOKUP_BATCH_SIZE_DEFAULT})",
                warehouse="BigQuery model over PostgreSQL",
                enricher=None,
                latency=args.latency,
            ),
            drain(
                url,
                url,
                keys,
                label=f"batched (built-in, batch {LOOKUP_BATCH_SIZE_DEFAULT})",
                warehouse="PostgreSQL",
                enricher=None,
                latency=0,
            ),
            drain(
                url,
                duckdb_url,
                keys,
                label=f"batched (built-in, batch {LOOKUP_BATCH_SIZE_DEFAULT})",
                warehouse="DuckDB (duckdb-engine)",
                enricher=None,
                latency=0,
            ),
        ]
    single = runs[0]
    rows = [
        [
            r.label,
            r.warehouse,
            f"{r.latency * 1000:g} ms",
            r.tickets,
            r.queries,
            r.rate,
            r.rate / single.rate,
            r.bytes_per_ticket / MB,
            r.bytes_per_ticket / single.bytes_per_ticket,
        ]
        for r in runs
    ]
    speedup = runs[1].rate / single.rate
    saving = single.bytes_per_ticket / runs[1].bytes_per_ticket
    scanned = sum(sum(columns.values()) for columns in sizes.values())
    print_table(
        "enrichq warehouse path: one worker, concurrency 8",
        [
            "lookup",
            "warehouse",
            "latency",
            "tickets",
            "queries",
            "tickets/s",
            "÷ per ticket",
            "MB billed/ticket",
            "÷ per ticket",
        ],
        rows,
        note=(
            f"with {args.latency * 1000:g} ms a query: batched {speedup:.1f}x the per-ticket "
            f"tickets/s (target ≥ {TARGET_SPEEDUP:g}x: {'met' if speedup >= TARGET_SPEEDUP else 'NOT met'}), "
            f"1/{saving:.0f} of its bytes billed per ticket (target ≤ 1/{TARGET_SPEEDUP:g}: "
            f"{'met' if saving >= TARGET_SPEEDUP else 'NOT met'}). The model is not BigQuery: "
            f"it bills every row of each referenced column (all the warehouse's columns come to "
            f"{scanned / MB:.2f} MB here), at least {MIN_BYTES_BILLED // MB} MB a query."
        ),
    )


if __name__ == "__main__":
    main()
