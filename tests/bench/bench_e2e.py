"""End to end: tickets/s through the worker, and events/s accepted by serve, side by side.

    python -m tests.bench.bench_e2e [--tickets N] [--seconds S]

In one run, on scratch databases of the benchmark server (ENRICHQ_TEST_DATABASE_URL or
the local default): `enrichq worker --drain` processes with 1 and 2 workers, once with a
no-op enricher (the queue and runtime alone) and once with the built-in warehouse lookup
against a seeded warehouse in the same PostgreSQL; then `enrichq serve` accepting signed
webhook events (single and batches of 100). Throughput is taken from the database's own
run log (first worker start to last worker finish), so process start-up is excluded.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
from pathlib import Path

import httpx
import sqlalchemy as sa

from enrichq_schema.db import create_engine
from enrichq_service import queue, seed
from enrichq_service.queue import EnqueueRequest
from tests.bench.bench_http import SECRET, run_mode
from tests.bench.common import print_table, scratch_database
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.settings import make_settings


def drain(url: str, tickets: int, workers: int, enricher: str, logs: Path) -> float:
    """Tickets/s of `workers` draining processes over a freshly seeded, enqueued world."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "TRUNCATE enrichq.queue, enrichq.runs, enrichq.ticket_orders,"
                    " enrichq.ticket_enrichments, enrichq.lookup_log"
                )
            )
            keys = [r[0] for r in conn.execute(sa.text("SELECT id FROM helpdesk.tickets"))]
            queue.enqueue(
                conn,
                [EnqueueRequest.build(key=k) for k in keys[:tickets]],
                settings=make_settings(url),
            )
            conn.execute(sa.text("ANALYZE enrichq.queue"))
        env = enrichq_env(url, enricher=enricher, concurrency=16)
        procs = [spawn(["worker", "--drain"], env, log=logs / f"w{i}.log") for i in range(workers)]
        for p in procs:
            p.wait(600)
        with engine.connect() as conn:
            done, seconds = conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM enrichq.queue WHERE state = 'done'),"
                    " extract(epoch FROM max(finished_at) - min(started_at)) FROM enrichq.runs"
                )
            ).one()
        assert done == tickets, f"{done} of {tickets} done"
        return float(done) / float(seconds)
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tickets", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="enrichq-bench-e2e-"))
    rows: list[list[object]] = []
    with scratch_database("e2e") as url:
        engine = create_engine(url)
        with engine.begin() as conn:
            seed.seed_world(conn, tickets=args.tickets)
        # VACUUM cannot run in a transaction block
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE"))
        engine.dispose()
        for workers in (1, 2):
            noop = drain(url, args.tickets, workers, "tests.support.enrichers:noop", logs)
            real = drain(
                url, args.tickets, workers, "enrichq_service.enrich:warehouse_lookup", logs
            )
            rows.append([f"worker x{workers}: no-op enricher", "tickets/s", noop, 1.0])
            rows.append([f"worker x{workers}: built-in lookup", "tickets/s", real, real / noop])
        reference = float(rows[0][2])  # type: ignore[arg-type]  # the figures column is numeric
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve = spawn(
            ["serve"],
            enrichq_env(
                url,
                http_host="127.0.0.1",
                http_port=port,
                webhook_secret=SECRET,
                delay_created_seconds=3600,
            ),
            log=logs / "serve.log",
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: _ready(base), timeout=60, what="serve")
            for mode, batch in (("single", 1), ("batch100", 100)):
                fig = run_mode(
                    base, serve.pid, mode=mode, batch=batch, threads=4, seconds=args.seconds
                )
                rate = fig.events / fig.seconds
                rows.append(
                    [f"serve: POST /v1/events ({mode})", "events/s", rate, rate / reference]
                )
        finally:
            stop(serve)
    print_table(
        f"enrichq end to end ({args.tickets:,} tickets, concurrency 16 per worker)",
        ["what", "unit", "rate", "÷ worker x1 no-op"],
        rows,
        note=f"logs: {logs}",
    )


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
