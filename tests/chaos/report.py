"""Run the chaos scenarios at a larger size and write docs/reliability.md.

    python -m tests.chaos.report [--tickets N] [--only NAME ...] [--out docs/reliability.md]
                                 [--blackhole-cap S] [--fuzz-draws N] [--fuzz-seed S]
                                 [--fuzz-only]

`--fuzz-only` runs only the generative fault harness's draws (`tests.chaos.fuzz`) and
replaces its section of the file, leaving the scenarios' table as it is.

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

from tests.chaos import blackhole, fuzz
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
    parser.add_argument("--fuzz-draws", type=int, default=20, help="0: skip the harness")
    parser.add_argument("--fuzz-seed", type=int, default=1)
    parser.add_argument(
        "--fuzz-only", action="store_true", help="run only the harness; rewrite its section"
    )
    args = parser.parse_args(argv)
    fuzzed: list[str] = []
    fuzz_bad = False
    if args.fuzz_draws > 0:
        seeds = range(args.fuzz_seed, args.fuzz_seed + args.fuzz_draws)
        print(f"== fuzz: {args.fuzz_draws} draws from seed {args.fuzz_seed}", flush=True)
        results = fuzz.run_draws(seeds, fuzz.KNOWN_DEFECTS)
        fuzzed = fuzz_section(results, args.fuzz_seed)
        fuzz_bad = any(r.violations for r in results)
    if args.fuzz_only:
        args.out.write_text(replace_section(args.out.read_text(encoding="utf-8"), fuzzed))
        print(f"wrote {args.out}")
        return 1 if fuzz_bad else 0
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
    text = render(outcomes, args.tickets, table)
    args.out.write_text(replace_section(text, fuzzed), encoding="utf-8")
    print(f"wrote {args.out}")
    bad = [o for o in outcomes if o.lost or o.duplicate_writes or o.not_done or o.wrong_orders]
    return 1 if bad or fuzz_bad else 0


FUZZ_HEADING = "## Generative fault harness"


def fuzz_section(results: list[fuzz.Result], seed: int) -> list[str]:
    """The harness's figures: draws, faults injected, violations, and how to run it."""
    if not results:
        return []
    violations = sum(len(r.violations) for r in results)
    faults = sum(r.faults for r in results)
    seconds = sum(r.seconds for r in results)
    failed = ", ".join(str(r.draw.seed) for r in results if r.violations) or "none"
    lines = [
        FUZZ_HEADING,
        "",
        "`tests/chaos/fuzz.py` draws random combinations of plug-in behaviours, faults and",
        "settings, runs each against a fleet of real processes, and checks every invariant at",
        "the end of the draw (see [how to run it](#running-the-harness)).",
        "",
        f"Produced by `python -m tests.chaos.report --fuzz-only --fuzz-draws {len(results)}"
        f" --fuzz-seed {seed}` on {datetime.now(UTC):%Y-%m-%d} ({_commit() or 'unknown'}).",
        "",
        "| draws | faults injected | tickets | run time | violations | draws that broke one |",
        "|---:|---:|---:|---:|---:|---|",
        f"| {len(results)} | {faults} | {sum(r.draw.tickets for r in results):,}"
        f" | {seconds:.0f} s | {violations} | {failed} |",
        "",
    ]
    if fuzz.KNOWN_DEFECTS:
        lines += [
            "Left out of these draws, as known defects being fixed (`KNOWN_DEFECTS` in"
            " `tests/chaos/fuzz.py` says what each breaks):"
            f" {', '.join(f'`{k}`' for k in sorted(fuzz.KNOWN_DEFECTS))}.",
            "",
        ]
    return [*lines, *FUZZ_HOWTO]


FUZZ_HOWTO = [
    "### Running the harness",
    "",
    "- A draw, from its seed alone: a world of 30-120 tickets, each given a plug-in",
    "  behaviour (`tests/support/behaviours.py`: good, or good after a hang deaf to",
    "  cancellation, an exception of any kind, a BaseException, a deferral, an `os._exit`",
    "  or prints; or bad: a permanent error, errors every time, an invalid result of",
    "  every kind (NUL, surrogates, NaN, infinities, numbers past numeric or bigint, wrong",
    "  types, answers for tickets not asked, tickets left out), bytes billed 0, 1,000 or",
    "  2^40); a per-ticket plug-in or batches of 1 or 50; 2-3 workers with leases of 2-5 s",
    "  and attempt deadlines of 1.5-10 s; the budget and the warehouse cap on or off; and",
    "  0-4 faults at random moments: SIGKILL of a worker or the sweeper, SIGSTOP/SIGCONT,",
    "  SIGTERM to a worker or its process group, a restart or crash of the database, a",
    "  proxy that drops the reply to claims' or settles' COMMITs or blackholes every",
    "  connection for up to two leases.",
    "- The invariants, checked at the end of every draw: each good ticket `done` with",
    "  exactly the warehouse's orders, written once (an audit trigger); each bad one",
    "  `failed` or dead-lettered naming its reason (or `lease expired` where the draw's",
    "  faults lose leases, or the attempt deadline where it is shorter than isolating its",
    "  unit's suspects takes: the README's settings table); no row left `leased`; the completing",
    "  lookup of every ticket logged with its bytes, every lookup that ran logged exactly",
    "  once (when nothing was lost); ledger = log; a budget overspent by at most one",
    "  lookup per worker; never more warehouse queries at once than the cap (an observer",
    "  samples the workers' and isolated children's in `pg_stat_activity` every 10 ms),",
    "  but for the queries a freeze or a partition leaves running, within the overlap",
    "  docs/operations.md gives (a frozen worker's and its isolated child's, told by the",
    "  process holding the connection; in a partition, those begun before it); every",
    "  process's exit code the documented one.",
    "- `python -m tests.chaos.fuzz --draws N --seed S` runs draws S to S+N-1",
    "  (`--skip-known` leaves out the known defects, `--exclude NAME ...` any behaviour or",
    "  fault); a draw that breaks an invariant prints its seed, what broke, its logs and",
    "  `reproduce: python -m tests.chaos.fuzz --draws 1 --seed S --exclude …` (a seed",
    "  reproduces the draw, not the timing of its processes). CI runs a fixed set of",
    "  draws (`tests/chaos/test_fuzz.py`, about 90 s).",
    "",
]


def replace_section(text: str, section: list[str]) -> str:
    """`text` with its harness section (up to the next `## ` heading) replaced by
    `section`, or `section` put before the first other `## ` section when it has none."""
    if not section:
        return text
    lines = text.split("\n")
    new = [*section]
    if FUZZ_HEADING in lines:
        start = lines.index(FUZZ_HEADING)
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        return "\n".join([*lines[:start], *new, *lines[end:]])
    first = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    return "\n".join([*lines[:first], *new, *lines[first:]])


def _commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()


def render(outcomes: list[Outcome], tickets: int, blackhole: list[str] | None = None) -> str:
    commit = _commit()
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
