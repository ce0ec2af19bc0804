"""Run the chaos scenarios at a larger size and write docs/reliability.md.

    python -m tests.chaos.report [--tickets N] [--only NAME ...] [--out docs/reliability.md]
                                 [--blackhole-cap S]

Uses ENRICHQ_TEST_DATABASE_URL's server (default: the local one) for scratch databases;
the restart scenario starts a PostgreSQL of its own. ENRICHQ_CHAOS_FULL=1 (or the
default here) means 3,000 tickets per scenario; CI runs the bounded pytest version.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from tests.chaos import blackhole
from tests.chaos.scenarios import MISSING, SCENARIOS, Outcome
from tests.support.pg import Databases

REPO = Path(__file__).resolve().parents[2]
FULL_TICKETS = 3000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tickets", type=int, default=FULL_TICKETS)
    parser.add_argument("--only", nargs="*", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "reliability.md")
    parser.add_argument(
        "--blackhole-cap",
        type=float,
        default=150.0,
        help="heal a blackholed call after this long (0: skip that table)",
    )
    args = parser.parse_args(argv)
    admin = os.environ.get(
        "ENRICHQ_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    dbs = Databases(admin)
    dbs.create_template()
    outcomes: list[Outcome] = []
    try:
        for name in args.only:
            why = MISSING.get(name, lambda: None)()
            if why:
                print(f"== {name}: skipped, {why}", flush=True)
                continue
            url = dbs.clone(name)
            logs = Path(tempfile.mkdtemp(prefix=f"enrichq-chaos-{name}-"))
            print(f"== {name} ({args.tickets} tickets) logs: {logs}", flush=True)
            started = time.monotonic()
            outcome = SCENARIOS[name](url, logs, args.tickets, random.Random(name))
            print(f"   {outcome} in {time.monotonic() - started:.0f} s", flush=True)
            outcomes.append(outcome)
            dbs.drop(url)
    finally:
        dbs.drop_all()
    table = None
    if args.blackhole_cap > 0:
        print(f"== blackhole (cap {args.blackhole_cap:g} s)", flush=True)
        table = blackhole.table(admin, args.blackhole_cap)
    args.out.write_text(render(outcomes, args.tickets, table), encoding="utf-8")
    print(f"wrote {args.out}")
    bad = [o for o in outcomes if o.lost or o.duplicate_writes or o.not_done or o.wrong_orders]
    return 1 if bad else 0


def render(outcomes: list[Outcome], tickets: int, blackhole: list[str] | None = None) -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    lines = [
        "# Reliability under faults",
        "",
        "enrichq promises that no ticket is lost and no result is written twice, whatever",
        "happens to its processes or its database. These figures come from real processes",
        "(three `enrichq worker`s and an `enrichq sweep`, 3 s leases) against a real",
        "PostgreSQL, with the faults injected by `tests/chaos/scenarios.py`. A trigger on",
        "`enrichq.ticket_enrichments` records every result write, so a second write for a",
        "ticket cannot go unseen.",
        "",
        f"Produced by `python -m tests.chaos.report` on {datetime.now(UTC):%Y-%m-%d} "
        f"(commit {commit or 'unknown'}, {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}); {tickets} tickets per scenario unless noted. "
        "CI runs the same scenarios with 300 tickets on every push (`tests/chaos/`).",
        "",
        "| scenario | tickets | faults injected | tickets lost | duplicate result writes "
        "| fenced writes refused | wrong results | dead letters | time to recover | run time "
        "| notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.name} | {o.tickets:,} | {o.faults:,} | {o.lost} | {o.duplicate_writes} "
            f"| {o.fenced} | {o.wrong_orders} | {o.dead_letters} | {o.time_to_recover:.1f} s "
            f"| {o.seconds:.0f} s | {o.notes} |"
        )
    lines += [
        "",
        "How to read it:",
        "",
        "- *tickets lost*: tickets with no enrichment at the end; *duplicate result writes*:",
        "  result writes beyond the first per ticket; *wrong results*: orders that differ from",
        "  the warehouse, or a result not written by the queue row that completed.",
        "- *fenced writes refused*: lookups whose results did not land because their attempt",
        "  no longer held the lease when it settled (the work was redone by the new holder).",
        "- *time to recover*: from the last fault to an empty queue (all work done).",
        "- *faults injected*: processes killed, backends terminated, restarts, or frozen",
        "  workers; for the slow warehouse, lookups that each held a connection for 1.5 s.",
        "- The sweeper scenario counts expired leases instead of tickets; its row checks that",
        "  each key ends with exactly one queued row (the newest) and every other row is",
        "  dead-lettered as superseded by it.",
        "- The poison scenario's dead letter is the poison ticket itself (attempts exhausted);",
        "  its enrichment runs in a child process once its worker has died on it, so the",
        "  tickets beside it are unaffected.",
        "- *kill -9 workers*: a kill every 0.3-1.2 s, one per 30 tickets, while work remains;",
        "  *pg_terminate_backend storm*: every worker backend terminated every 0.1-0.5 s while",
        "  work remains. In both the lookups are slowed to about 50 tickets a second (the",
        "  built-in batch lookup behind a 0.6 s wait, 5 tickets a call, 2 calls at a time per",
        "  worker), so the work outlasts the faults and each finds lookups running.",
        "- *behind PgBouncer*: every process through a real PgBouncer 1.18 in transaction",
        "  pooling (`ENRICHQ_POOL_MODE=transaction`: settings per transaction, nothing",
        "  prepared, the sweeper leading by a lease row, no LISTEN).",
        "- *network partition*: one of three workers reaches the database through a TCP proxy",
        "  that stops forwarding (no FIN, no RST) for 10 s, then heals. It runs with",
        "  `ENRICHQ_NETWORK_TIMEOUT_SECONDS=2` and a 2 s statement timeout; its lookups take",
        "  5 s, so the cut finds its handlers running. *late writes accepted*: completions of a",
        "  lease it held at the cut (its claim token) made by it; the time to recover runs",
        "  from the cut to an empty queue.",
        "- *claim COMMIT replies lost*: every process reaches the database through a proxy",
        "  that drops the reply to a claim's COMMIT 12 times (the server committed the",
        "  leases; the worker sees its connection die). *rows given back*: leases a worker",
        "  found it held without knowing, returned with their attempt before it claimed",
        "  again; *rows that waited for their lease to expire* went back through the sweeper",
        "  instead, as suspects with an attempt spent (before the give-back, every row of such a",
        "  claim did).",
        "- *failover*: a private primary and `pg_basebackup` standby; processes on",
        "  `host=primary,standby` with `target_session_attrs=read-write`. Replication is",
        "  blackholed for 1 s, the primary stopped with an immediate shutdown, the standby",
        "  promoted a second later; every count is on the new primary. The time to recover",
        "  runs from the crash to an empty queue.",
        "",
    ]
    if blackhole:
        lines += [
            "## How long a blackholed connection hangs",
            "",
            "A statement on an open connection, and a new connection, through the proxy while",
            "it forwards nothing (`python -m tests.chaos.blackhole`); a network timeout of 0 is",
            "what enrichq did before `ENRICHQ_NETWORK_TIMEOUT_SECONDS`.",
            "",
            *blackhole,
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
