"""Suspects against fresh jobs: what a worker's drain costs after a database outage.

    python -m tests.bench.bench_suspects [--tickets N]

After an outage longer than a lease, every job that was in flight comes back a suspect
(its lease expired) and is enriched in a child process (`enrichq_service.isolate`). In one
run, on a scratch database of the benchmark server (ENRICHQ_TEST_DATABASE_URL or the local
default) seeded with N tickets (default 1,000), one `enrichq worker --drain` with the
built-in batch lookup drains them twice, side by side: as fresh jobs, then as suspects.
Throughput comes from the database's run log (process start-up excluded); the ratio is
suspects to fresh.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.bench.bench_e2e import LOOKUP_BATCH, drain, seed_analyzed
from tests.bench.common import print_table, scratch_database


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tickets", type=int, default=1_000)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="enrichq-bench-suspects-"))
    with scratch_database("suspects") as url:
        seed_analyzed(url, args.tickets)
        fresh = drain(url, args.tickets, 1, LOOKUP_BATCH, logs)
        suspects = drain(url, args.tickets, 1, LOOKUP_BATCH, logs, suspects=True)
    print_table(
        f"one worker draining {args.tickets:,} tickets, built-in batch lookup",
        ["jobs", "tickets/s", "x fresh"],
        [["fresh", fresh, 1.0], ["suspects (after an outage)", suspects, suspects / fresh]],
        note=f"worker logs: {logs}",
    )


if __name__ == "__main__":
    main()
