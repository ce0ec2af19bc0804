"""Benchmark: signed events per second accepted by POST /v1/events and /v1/zendesk on one
uvicorn process.

Run: ``python -m tests.bench.bench_http [--seconds 10] [--threads 4]``. It uses the server of
ENRICHQ_TEST_DATABASE_URL (else an embedded Postgres), creates a migrated database of its
own, starts the HTTP app under uvicorn in a child process, posts signed single events and
batches of 100 to /v1/events and Zendesk ticket events to /v1/zendesk from httpx client
threads, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from enrichq_schema.db import create_engine
from tests.support.pg import Databases, server_url

SECRET = "bench-webhook-secret"
ZENDESK_SECRET = "bench-zendesk-signing-secret"


@dataclass
class Tally:
    """What one client thread saw."""

    requests: int = 0
    events: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Figure:
    """One row of the table."""

    mode: str
    threads: int
    seconds: float
    requests: int
    events: int
    errors: int
    p50_ms: float
    p99_ms: float
    server_cpu_seconds: float | None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid` (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_main(database_url: str) -> None:
    """Child process: the app under uvicorn on a free port; prints it, stops at stdin EOF."""
    from enrichq_schema.settings import Settings
    from enrichq_service.http import create_app, start_server_thread

    settings = Settings.load(
        database_url=database_url, webhook_secret=SECRET, zendesk_signing_secret=ZENDESK_SECRET
    )
    engine = create_engine(database_url, pool_size=16)
    server = start_server_thread(create_app(settings, engine))
    print(f"PORT {server.port}", flush=True)
    sys.stdin.read()
    server.stop()
    engine.dispose()


def body_of(mode: str, thread: int, n: int, batch: int) -> bytes:
    events = [
        {
            "ticket_id": f"{mode}-{thread}-{n}-{i}",
            "type": "created",
            "tenant": f"tenant-{(n + i) % 7}",
            "occurred_at": "2024-05-01T12:00:00Z",
        }
        for i in range(batch)
    ]
    return json.dumps(events[0] if batch == 1 else {"events": events}).encode()


def client_loop(
    base_url: str, *, mode: str, thread: int, batch: int, until: float, tally: Tally
) -> None:
    from enrichq_service.http import sign
    from tests.support.zendesk import encode, ticket_event, zendesk_headers

    with httpx.Client(base_url=base_url, timeout=30) as http:
        n = 0
        while time.monotonic() < until:
            if mode == "zendesk":
                path = "/v1/zendesk"
                body = encode(
                    ticket_event(ticket=f"z-{thread}-{n}", event_id=f"bench-{thread}-{n}")
                )
                headers = zendesk_headers(body, ZENDESK_SECRET)
            else:
                path = "/v1/events"
                body = body_of(mode, thread, n, batch)
                stamp = str(int(time.time()))
                headers = {
                    "Content-Type": "application/json",
                    "X-Enrichq-Timestamp": stamp,
                    "X-Enrichq-Signature": sign(SECRET, stamp, body),
                }
            started = time.perf_counter()
            response = http.post(path, content=body, headers=headers)
            tally.latencies.append(time.perf_counter() - started)
            tally.requests += 1
            if response.status_code == 202:
                tally.events += response.json()["accepted"]
            else:
                tally.errors += 1
            n += 1


def run_mode(
    base_url: str, server_pid: int, *, mode: str, batch: int, threads: int, seconds: float
) -> Figure:
    cpu_before = cpu_seconds(server_pid)
    tallies = [Tally() for _ in range(threads)]
    until = time.monotonic() + seconds
    started = time.monotonic()
    workers = [
        threading.Thread(
            target=client_loop,
            args=(base_url,),
            kwargs={"mode": mode, "thread": i, "batch": batch, "until": until, "tally": tallies[i]},
        )
        for i in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - started
    cpu_after = cpu_seconds(server_pid)
    latencies = sorted(x for t in tallies for x in t.latencies)
    return Figure(
        mode=mode,
        threads=threads,
        seconds=elapsed,
        requests=sum(t.requests for t in tallies),
        events=sum(t.events for t in tallies),
        errors=sum(t.errors for t in tallies),
        p50_ms=1000 * statistics.median(latencies) if latencies else 0.0,
        p99_ms=1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else 0.0,
        server_cpu_seconds=(
            cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--serve", metavar="DATABASE_URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_main(args.serve)
        return

    console = Console(width=120)
    with server_url(Path(tempfile.mkdtemp(prefix="enrichq-bench-"))) as admin_url:
        dbs = Databases(admin_url)
        try:
            dbs.create_template()
            url = dbs.clone("bench_http")
            child = subprocess.Popen(
                [sys.executable, "-m", "tests.bench.bench_http", "--serve", url],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            try:
                assert child.stdout is not None
                line = child.stdout.readline()
                if not line.startswith("PORT "):
                    raise SystemExit(f"the server did not start: {line!r}")
                base_url = f"http://127.0.0.1:{int(line.split()[1])}"
                console.print(f"server up at {base_url}; {args.threads} client threads")
                figures = [
                    run_mode(
                        base_url,
                        child.pid,
                        mode=mode,
                        batch=batch,
                        threads=args.threads,
                        seconds=args.seconds,
                    )
                    for mode, batch in (("single", 1), ("zendesk", 1), ("batch100", 100))
                ]
            finally:
                if child.stdin is not None:
                    child.stdin.close()
                child.wait(timeout=30)
            engine = create_engine(url, pool_size=1)
            try:
                with engine.connect() as conn:
                    rows = conn.execute(sa.text("SELECT count(*) FROM enrichq.queue")).scalar_one()
            finally:
                engine.dispose()
        finally:
            dbs.drop_all()

    table = Table(title="POST /v1/events and /v1/zendesk on one uvicorn process (signed)")
    for col in ("mode", "threads", "seconds", "requests", "events", "errors"):
        table.add_column(col, justify="right")
    for col in ("requests/s", "events/s", "p50 ms", "p99 ms", "server CPU ms/req"):
        table.add_column(col, justify="right")
    for f in figures:
        table.add_row(
            f.mode,
            str(f.threads),
            f"{f.seconds:.1f}",
            str(f.requests),
            str(f.events),
            str(f.errors),
            f"{f.requests / f.seconds:,.0f}",
            f"{f.events / f.seconds:,.0f}",
            f"{f.p50_ms:.1f}",
            f"{f.p99_ms:.1f}",
            "-"
            if f.server_cpu_seconds is None
            else f"{1000 * f.server_cpu_seconds / max(f.requests, 1):.2f}",
        )
    console.print(table)
    accepted = sum(f.events for f in figures)
    console.print(f"queue rows: {rows} (events accepted: {accepted})")
    if rows != accepted:
        raise SystemExit("the queue does not hold every accepted event")


if __name__ == "__main__":
    main()
