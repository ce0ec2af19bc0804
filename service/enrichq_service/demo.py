"""`enrichq demo`: the whole product in a minute on a fresh machine, from seeded help desk
to the cutover of one tenant, in a database of its own."""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import SecretStr

from enrichq_schema.db import create_engine, migrate, normalize_url
from enrichq_schema.settings import Settings

DEMO_DATABASE = "enrichq_demo"
EVENTS_PER_REQUEST = 100
REPORT_DIR = Path("enrichq-demo-report")
DEMO_REVIEWER = "demo-reviewer"
DEMO_TENANT = "acme"
HISTORY_SHARE = 5
"""One ticket in this many was created before the shadow run began: legacy rows only."""
HISTORY_AGE = timedelta(days=30)
PARITY_WINDOW_DAYS = 3
# The accept file the demo's reviewer writes after reading the first report: the seeded
# legacy flow's known losses, for the days the demo's tickets were created on.
ACCEPT_FILE = '''\
# Reviewed differences for the demo's cutover (written by `enrichq demo`).
# Every rule covers one kind of legacy fault over the days the demo's tickets were created.

[[rule]]
class = "legacy_missing"
first_day = {first_day}
last_day = {last_day}
reason = """The legacy flow drops a ticket when it restarts mid-lookup, and writes no row \\
for a customer without orders at lookup time: enrichq found their orders, and the \\
warehouse confirms them."""
author = "{author}"

[[rule]]
class = "extra_only"
first_day = {first_day}
last_day = {last_day}
reason = """The legacy flow saved some tickets' orders only in part, and never looks a \\
ticket up again: the orders it missed are confirmed by the warehouse."""
author = "{author}"
'''


def _recreate(url: str) -> str:
    """A fresh, migrated `enrichq_demo` database on the server of `url`; its URL."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT", pool_size=1)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {DEMO_DATABASE} WITH (FORCE)"))
            conn.execute(sa.text(f"CREATE DATABASE {DEMO_DATABASE}"))
    finally:
        admin.dispose()
    demo_url = normalize_url(url).set(database=DEMO_DATABASE)
    rendered = demo_url.render_as_string(hide_password=False)
    migrate(rendered)
    return rendered


def run_demo(  # noqa: PLR0915 -- the demo is one story, told in order
    settings: Settings, url: str, *, keep_running: bool, tickets: int
) -> int:
    """Run the demo; 0 when every ticket was enriched and a parity report was written."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from enrichq_schema.process import stop_on_signals
    from enrichq_service import seed
    from enrichq_service.http import create_app, start_server_thread
    from enrichq_service.worker import worker_process
    from enrichq_sweeper import recovery, refresh, retention

    console = Console()
    started = time.monotonic()
    console.print("[bold]enrichq demo[/]: shadow run, parity report, in a database of its own")
    demo_url = _recreate(url)
    secret = secrets.token_hex(16)
    demo = settings.model_copy(
        update={
            "database_url": demo_url,
            "delay_created_seconds": 1.0,
            "delay_updated_seconds": 1.0,
            # cohorts a second apart: batched lookups, and a demo that ends in seconds
            "lookup_window_seconds": 1.0,
            "lease_seconds": 10.0,
            "heartbeat_seconds": 2.0,
            "poll_seconds": 0.5,
            "webhook_secret": SecretStr(secret),
            "parity_grace_seconds": 60.0,
            # the demo's tickets span two days: its parity window is three
            "parity_window_days": float(PARITY_WINDOW_DAYS),
        }
    )
    wiring = contextlib.ExitStack()
    worker, engines = wiring.enter_context(worker_process(demo, demo_url))
    engine = engines.queue
    with engine.begin() as conn:
        world = seed.seed_world(conn, tickets=tickets)
        history = _make_history(conn, tickets // HISTORY_SHARE)
        ticket_rows = conn.execute(
            sa.text(
                "SELECT id, tenant, created_at FROM helpdesk.tickets"
                " WHERE NOT (id = ANY(CAST(:history AS text[]))) ORDER BY created_at"
            ),
            {"history": history},
        ).all()
    # what parity over the recent days will find: the history is outside its window
    expected = world.expected_without(history)
    console.print(
        f"seeded {world.tickets:,} tickets and their legacy output ({world.legacy_orders:,} "
        f"legacy orders): the legacy flow lost {world.legacy_lost} tickets and saved "
        f"{world.legacy_partial} in part, and {world.late_orders} orders were placed after its "
        f"lookup; {len(history)} tickets are from before the shadow run (legacy rows only); "
        f"parity over the recent days should find {_classes(expected)}",
        highlight=False,
    )

    port = settings.http_port if _port_free(settings.http_port) else 0
    app = create_app(demo, engine, health=worker.health)
    server = start_server_thread(app, host="127.0.0.1", port=port)
    runner = threading.Thread(target=worker.run, name="enrichq-demo-worker", daemon=True)
    runner.start()
    try:
        with Progress(
            TextColumn("{task.description:<22}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=console,
            transient=False,
        ) as bar:
            posted = bar.add_task("webhook events posted", total=len(ticket_rows))
            _post_events(server.url, secret, ticket_rows, lambda n: bar.advance(posted, n))
            enriched = bar.add_task("tickets enriched", total=len(ticket_rows))
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                with engine.connect() as conn:
                    done = conn.execute(
                        sa.text("SELECT count(*) FROM enrichq.queue WHERE state = 'done'")
                    ).scalar_one()
                bar.update(enriched, completed=done)
                if done >= len(ticket_rows):
                    break
                time.sleep(0.2)
        recovered = recovery.run_once(engine)
        pruned = retention.run_once(
            engine,
            retention_days=demo.retention_days,
            dead_letter_retention_days=demo.dead_letter_retention_days,
        )
        refreshed = refresh.run_once(engine, demo)
        console.print(
            f"sweeper: {recovered.promoted} leases recovered, {pruned.pruned} rows pruned, "
            f"{refreshed} refreshes enqueued"
        )
        REPORT_DIR.mkdir(exist_ok=True)
        before = _consumer_tickets(engine, DEMO_TENANT)
        _backfill(demo, demo_url, engine, console)
        review = _review(demo, demo_url, console, expected)
        after = _consumer_tickets(engine, DEMO_TENANT)
        lost = before - after
        console.print(
            f"consumers of tenant {DEMO_TENANT}: {len(before)} tickets with orders before the "
            f"cutover, {len(after)} after; "
            + ("none lost" if not lost else f"[red]{len(lost)} LOST[/]: {sorted(lost)[:5]}")
        )
        if lost:
            return 1
        metrics_url = f"{server.url}/metrics"
        console.print(
            Panel.fit(
                f"[bold]{len(ticket_rows)} tickets[/] enriched in shadow mode and "
                f"{len(history)} older ones backfilled, reviewed and one tenant cut over in "
                f"{time.monotonic() - started:.0f} s, no ticket lost to its consumers\n"
                f"parity run #{review.first_run}: {review.first_state}; the differences are "
                "the legacy flow's lost and partial tickets\n"
                f"parity run #{review.second_run} with {review.accept_file}: "
                f"{review.second_state}, approved by {DEMO_REVIEWER}\n"
                f"cutover: tenant {DEMO_TENANT} reads enrichq's rows, the others the legacy "
                "rows\n"
                f"report: [link]{review.html.resolve()}[/]  (JSON and CSV beside it)\n"
                f"metrics: {metrics_url}"
                + ("" if keep_running else " (stopped; use --keep to keep it up)")
                + "\nexplore: run `enrichq demo --keep`, then paste the export line it "
                "prints into another shell and walk README's tour on this data",
                title="enrichq demo",
            )
        )
        if keep_running:
            # on a line of its own, outside any box, so a copy picks up nothing else
            console.print("the demo's database, for another shell:", highlight=False)
            print(f"export ENRICHQ_DATABASE_URL='{normalize_url(demo_url).render_as_string()}'")
            console.print("serve, /metrics and the database keep running; Ctrl-C stops them")
            with stop_on_signals(worker.stop):
                while not worker.stop.wait(1):
                    pass
    finally:
        worker.stop.set()
        runner.join(timeout=30)
        server.stop()
        wiring.close()
    return 0


def _make_history(conn: sa.Connection, n: int) -> list[str]:
    """Move `n` tickets (every HISTORY_SHARE-th) and their legacy rows HISTORY_AGE back:
    tickets created before the shadow run, which enrichq never hears of. Their ids."""
    ids: list[str] = list(
        conn.execute(
            sa.text("SELECT id FROM helpdesk.tickets ORDER BY id LIMIT :n * :share"),
            {"n": n, "share": HISTORY_SHARE},
        ).scalars()
    )[::HISTORY_SHARE][:n]
    shift = {"ids": ids, "age": HISTORY_AGE}
    conn.execute(
        sa.text(
            "UPDATE helpdesk.tickets SET created_at = created_at - :age,"
            " updated_at = updated_at - :age WHERE id = ANY(CAST(:ids AS text[]))"
        ),
        shift,
    )
    conn.execute(
        sa.text(
            "UPDATE legacy.ticket_orders SET looked_up_at = looked_up_at - :age"
            " WHERE ticket_id = ANY(CAST(:ids AS text[]))"
        ),
        shift,
    )
    return ids


def _consumer_tickets(engine: sa.Engine, tenant: str) -> set[str]:
    """The tickets of `tenant` consumers read orders for (the view, or before it exists the
    legacy table it will start on)."""
    from enrichq_parity.cutover import VIEW

    with engine.connect() as conn:
        exists = conn.execute(sa.text("SELECT to_regclass(:v)"), {"v": VIEW}).scalar()
        rows = conn.execute(
            _READ_VIEW if exists is not None else _READ_LEGACY, {"tenant": tenant}
        ).scalars()
        return set(rows)


_READ_VIEW = sa.text(
    "SELECT DISTINCT o.ticket_id FROM enrichq_public.ticket_orders AS o"
    " JOIN helpdesk.tickets AS t ON t.id = o.ticket_id WHERE t.tenant = :tenant"
)
_READ_LEGACY = sa.text(
    "SELECT DISTINCT o.ticket_id FROM legacy.ticket_orders AS o"
    " JOIN helpdesk.tickets AS t ON t.id = o.ticket_id WHERE t.tenant = :tenant"
)


def _backfill(demo: Settings, demo_url: str, engine: sa.Engine, console: Any) -> None:
    """Step 1b of docs/cutover.md: backfill, then wait for the worker to drain it."""
    from enrichq_service.commands import backfill
    from enrichq_service.commands.base import Context

    console.rule("backfill: tickets from before the shadow run")
    backfill.run(
        Context.given(demo, demo_url), tenant=None, since=None, dry_run=False, page_size=1000,
        actor=DEMO_REVIEWER,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            left = conn.execute(
                sa.text(
                    "SELECT count(*) FROM enrichq.queue"
                    " WHERE kind = 'backfill' AND state IN ('queued', 'leased')"
                )
            ).scalar_one()
        if left == 0:
            break
        time.sleep(0.2)
    console.print("backfill drained: every ticket consumers can read is enriched")


@dataclass(frozen=True, slots=True)
class _Review:
    """What the demo's review did: the two runs, the accept file, the report."""

    first_run: int
    first_state: str
    second_run: int
    second_state: str
    accept_file: Path
    html: Path


_STATE_WORDS = {
    "pass": "pass, every legacy fault accepted",
    "review": "shadow bars met, legacy faults still to accept",
    "fail": "below the bars",
    "empty": "nothing to judge",
}


def _classes(counts: Mapping[str, int]) -> str:
    """Ticket counts per parity class, in the report's words and order."""
    from enrichq_parity.model import CLASS_LABELS, TicketClass

    return ", ".join(
        f"{CLASS_LABELS[c].lower()} {counts.get(c.value, 0):,}"
        for c in TicketClass
        if counts.get(c.value, 0)
    )


def _review(demo: Settings, demo_url: str, console: Any, expected: Mapping[str, int]) -> _Review:
    """The review path of docs/cutover.md: parity, an accept file, parity again, approve,
    cut one tenant over, status; each step through the command it documents."""
    from enrichq_parity import report as render
    from enrichq_parity import review
    from enrichq_service.commands import cutover, parity
    from enrichq_service.commands.base import Context

    ctx = Context.given(demo, demo_url)

    def latest() -> review.RunRow:
        engine = create_engine(demo_url, pool_size=1)
        try:
            with engine.connect() as conn:
                return review.list_runs(conn, 1)[0]
        finally:
            engine.dispose()

    now = datetime.now(UTC)
    since = now - timedelta(days=PARITY_WINDOW_DAYS)
    first_html = REPORT_DIR / "parity-first.html"
    console.rule("parity, before review")
    parity.run(
        ctx, since=since, until=now, json_path=REPORT_DIR / "parity-first.json",
        html_path=first_html,
    )  # fmt: skip
    first = latest()
    _reconcile(demo_url, first.id, expected, console)
    accept_file = REPORT_DIR / "accept.toml"
    accept_file.write_text(
        ACCEPT_FILE.format(
            first_day=since.date().isoformat(),
            last_day=now.date().isoformat(),
            author=DEMO_REVIEWER,
        ),
        encoding="utf-8",
    )
    console.rule(f"parity again, with {accept_file}")
    html, report_json = REPORT_DIR / "parity.html", REPORT_DIR / "parity.json"
    parity.run(
        ctx, since=since, until=now, json_path=report_json, html_path=None,
        csv_path=REPORT_DIR / "mismatches.csv", accept_path=accept_file,
    )  # fmt: skip
    second = latest()
    console.rule("sign-off and a staged cutover")
    parity.approve(
        ctx, run_id=second.id, by=DEMO_REVIEWER,
        note="read the fault groups; every legacy fault is covered by a rule",
    )  # fmt: skip
    cutover.run(ctx, rollback=False, actor=DEMO_REVIEWER, tenants=[DEMO_TENANT])
    cutover.run(ctx, rollback=False, actor=None, show_status=True)
    # the report of the signed run, with its approval on it (what `parity show` writes)
    engine = create_engine(demo_url, pool_size=1)
    try:
        with engine.connect() as conn:
            signed, approvals = review.load_report(conn, second.id)
    finally:
        engine.dispose()
    html.write_text(render.to_html(signed, approvals), encoding="utf-8")
    report_json.write_text(render.to_json(signed, approvals), encoding="utf-8")
    return _Review(
        first.id,
        _STATE_WORDS.get(first.state, first.state),
        second.id,
        _STATE_WORDS.get(second.state, second.state),
        accept_file,
        html,
    )


def _reconcile(demo_url: str, run_id: int, expected: Mapping[str, int], console: Any) -> None:
    """Say whether the first parity run found what the seed put there, class by class."""
    from enrichq_parity import review
    from enrichq_parity.model import TicketClass

    engine = create_engine(demo_url, pool_size=1)
    try:
        with engine.connect() as conn:
            report, _ = review.load_report(conn, run_id)
    finally:
        engine.dispose()
    t = report.total
    found = {c.value: t.count(c) for c in TicketClass if t.count(c)}
    if found == dict(expected):
        console.print(
            f"parity run #{run_id} found what was seeded: {_classes(found)} "
            f"({t.legacy_orders:,} legacy orders)",
            highlight=False,
        )
    else:
        console.print(
            f"[yellow]parity run #{run_id} differs from the seed[/]: found {_classes(found)}, "
            f"seeded {_classes(expected)} ({t.excluded:,} tickets left out of the comparison)",
            highlight=False,
        )


def _post_events(
    base_url: str, secret: str, tickets: Sequence[Any], advance: Callable[[int], None]
) -> None:
    """POST every ticket as a signed `created` event, EVENTS_PER_REQUEST at a time."""
    import httpx

    from enrichq_service.http import sign

    with httpx.Client(base_url=base_url, timeout=30) as client:
        for i in range(0, len(tickets), EVENTS_PER_REQUEST):
            chunk = tickets[i : i + EVENTS_PER_REQUEST]
            events = [
                {
                    "ticket_id": r.id,
                    "type": "created",
                    "tenant": r.tenant,
                    "occurred_at": r.created_at.isoformat(),
                }
                for r in chunk
            ]
            body = json.dumps({"events": events}).encode()
            stamp = str(int(time.time()))
            response = client.post(
                "/v1/events",
                content=body,
                headers={
                    "Content-Type": "application/json",
                    "X-Enrichq-Timestamp": stamp,
                    "X-Enrichq-Signature": sign(secret, stamp, body),
                },
            )
            response.raise_for_status()
            advance(len(chunk))


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
