"""Enrichers for tests, importable by path (``tests.support.enrichers:name``) in subprocesses."""

from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

from enrichq_service.enrich import (
    EnrichContext,
    Enrichment,
    Order,
    Ticket,
    warehouse_lookup,
    warehouse_lookup_batch,
)
from enrichq_service.errors import Deferral, PermanentError, TransientError


def tagged(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """One order named after the ticket and this process's ENRICHQ_TEST_TAG, 1,000 bytes."""
    tag = os.environ.get("ENRICHQ_TEST_TAG", "x")
    return Enrichment((Order(f"O-{ticket.id}-{tag}"),), job_id=f"job-{tag}", bytes_billed=1000)


def slow(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Sleep ENRICHQ_TEST_SLOW_SECONDS (stopping early when cancelled), then `tagged`."""
    seconds = float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "1"))
    marker = os.environ.get("ENRICHQ_TEST_STARTED_DIR")
    if marker:
        with open(os.path.join(marker, ticket.id), "w") as f:
            f.write(str(os.getpid()))
    if context.cancelled.wait(seconds) and os.environ.get("ENRICHQ_TEST_HONOUR_CANCEL"):
        raise PermanentError("cancelled")
    return tagged(ticket, context)


def permanent(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Never works for this ticket."""
    raise PermanentError(f"ticket {ticket.id} has a malformed requester")


def defer_an_hour(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Cannot run yet."""
    raise Deferral(datetime.now(UTC) + timedelta(hours=1), "quota")


def flaky(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """An unexpected exception: counts as transient."""
    raise ValueError("warehouse hiccup")


def crash_on_poison(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """The process dies on ticket POISON (every time); other tickets use the warehouse."""
    if ticket.id == "POISON":
        os._exit(13)
    return warehouse_lookup(ticket, context)


def sleepy_warehouse(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """A slow warehouse: the lookup holds a warehouse connection for a while. Each start is
    marked in ENRICHQ_TEST_STARTED_DIR, if set (a file per ticket)."""
    marker = os.environ.get("ENRICHQ_TEST_STARTED_DIR")
    if marker:
        with open(os.path.join(marker, ticket.id), "w") as f:
            f.write(str(os.getpid()))
    time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "0.2")))
    return warehouse_lookup(ticket, context)


def slow_query(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """A slow warehouse: each lookup holds a warehouse connection in pg_sleep first."""
    import sqlalchemy as sa

    seconds = float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "1"))
    with context.warehouse.connect() as conn:
        conn.execute(sa.text("SELECT pg_sleep(:s)"), {"s": seconds})
    return warehouse_lookup(ticket, context)


def noop(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """No lookup at all: what the queue and worker runtime cost on their own."""
    return Enrichment(())


def tries_legacy_write(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Attempt a write to the legacy output, then look the ticket up as usual.

    The job id of the result says whether the database refused the legacy write.
    """
    import sqlalchemy as sa
    import sqlalchemy.exc as sa_exc

    try:
        with context.warehouse.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO legacy.ticket_orders VALUES (:t, 'O-shadow-leak', now())"),
                {"t": ticket.id},
            )
        verdict = "legacy-write-ALLOWED"
    except sa_exc.ProgrammingError as exc:
        refused = getattr(exc.orig, "sqlstate", None) == "42501"  # insufficient_privilege
        verdict = "legacy-write-refused" if refused else f"legacy-write-error-{exc.orig}"
    found = warehouse_lookup(ticket, context)
    return Enrichment(found.orders, job_id=verdict, bytes_billed=found.bytes_billed)


# -- results the database (or enrichq) must refuse, for ticket ENRICHQ_TEST_BAD_TICKET only

BAD_KINDS = (
    "nul_order_id",
    "nul_customer_id",
    "nul_job_id",
    "nul_error",
    "total_not_number",
    "order_id_missing",
    "dict_orders",
    "surrogate_order_id",
    "surrogate_job_id",
    "surrogate_error",
    "huge_bytes",
    "huge_total",
    "unreadable_error",
)
# what `bytes.decode("utf-8", "surrogateescape")` makes of a byte that is not UTF-8: a lone
# surrogate, which no UTF-8 text (and so no PostgreSQL text) can hold
SURROGATE = b"\xff".decode("utf-8", "surrogateescape")
# errors a plug-in raises (not results): kept, escaped, retried as usual
ERROR_KINDS = ("nul_error", "surrogate_error", "unreadable_error")


class Unreadable(TransientError):
    """A plug-in's error whose message cannot even be made into text."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


# the field each invalid result's `last_error` names
BAD_FIELDS = {
    "nul_order_id": "orders[0].order_id",
    "nul_customer_id": "orders[0].customer_id",
    "nul_job_id": "job_id",
    "total_not_number": "orders[0].total",
    "order_id_missing": "orders[0].order_id",
    "dict_orders": "orders[0]",
    "surrogate_order_id": "orders[0].order_id",
    "surrogate_job_id": "job_id",
    "huge_bytes": "bytes_billed",
    "huge_total": "orders[0].total",
}


def bad_result(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """The warehouse lookup, except that ticket ENRICHQ_TEST_BAD_TICKET gets a result of the
    kind ENRICHQ_TEST_BAD_KIND (one of BAD_KINDS)."""
    if ticket.id != os.environ.get("ENRICHQ_TEST_BAD_TICKET"):
        return warehouse_lookup(ticket, context)
    return bad_enrichment(os.environ["ENRICHQ_TEST_BAD_KIND"])


def bad_enrichment(kind: str) -> Enrichment:
    """A result of one of BAD_KINDS (or the error "nul_error" raises)."""
    if kind == "nul_error":
        raise TransientError("warehouse said \x00 and hung up")
    if kind == "surrogate_error":
        raise TransientError(f"warehouse said {SURROGATE} and hung up")
    if kind == "unreadable_error":
        raise Unreadable
    orders: object = {
        "nul_order_id": (Order("O-\x00-1"),),
        "nul_customer_id": (Order("O-1", customer_id="C-\x00"),),
        "nul_job_id": (Order("O-1"),),
        "total_not_number": (Order("O-1", total="lots"),),  # type: ignore[arg-type]  # the bad data under test
        "order_id_missing": (Order(None),),  # type: ignore[arg-type]  # the bad data under test
        "dict_orders": ({"order_id": "O-1"},),
        "surrogate_order_id": (Order(f"O-{SURROGATE}-1"),),
        "surrogate_job_id": (Order("O-1"),),
        "huge_bytes": (Order("O-1"),),
        # past numeric's 131072 digits, and past what str() makes of an int
        "huge_total": (Order("O-1", total=10**131072),),
    }[kind]
    job_id = {"nul_job_id": "job-\x00", "surrogate_job_id": f"job-{SURROGATE}"}.get(kind, "job-1")
    billed = 2**63 - 1 if kind == "huge_bytes" else 10  # a bigint, but no warehouse's bill
    return Enrichment(orders, job_id=job_id, bytes_billed=billed)  # type: ignore[arg-type]  # as above


def sixty_bytes(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """A lookup that takes ENRICHQ_TEST_SLOW_SECONDS and bills 60 bytes (budget tests)."""
    time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "0.5")))
    return Enrichment((Order(f"O-{ticket.id}"),), job_id=f"job-{ticket.id}", bytes_billed=60)


def hang_on_h(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Tickets whose id starts with 'H' hang ENRICHQ_TEST_SLOW_SECONDS, deaf to cancellation
    (a plug-in stuck in a call it cannot interrupt); every start is marked in
    ENRICHQ_TEST_STARTED_DIR (one file per start)."""
    marker = os.environ.get("ENRICHQ_TEST_STARTED_DIR")
    if marker:
        path = os.path.join(marker, f"{ticket.id}.{time.monotonic_ns()}")
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    if ticket.id.startswith("H"):
        time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "20")))
    return Enrichment((Order(f"O-{ticket.id}"),), job_id="job", bytes_billed=1)


def past_the_deadline(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Ignores cancellation and returns a 1 GB lookup a moment after its attempt's deadline."""
    assert context.deadline is not None
    time.sleep(max(0.0, context.deadline - time.monotonic()) + 0.3)
    return Enrichment((Order(f"O-{ticket.id}"),), job_id="big", bytes_billed=10**9)


def two_seconds(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """A lookup that takes two seconds."""
    time.sleep(2)
    return Enrichment((Order(f"O-{ticket.id}"),))


def bad_data_fate(ticket_id: str) -> str:
    """What `bad_data` does to a ticket: "good", "hang" (its first start hangs past the
    attempt deadline) or one of BAD_KINDS but ERROR_KINDS (an invalid result, every
    time). About 1% of tickets each hang and get a bad result; stable across processes."""
    h = zlib.crc32(ticket_id.encode())
    if h % 100 == 0:
        kinds = [k for k in BAD_KINDS if k not in ERROR_KINDS]
        return kinds[(h // 100) % len(kinds)]
    if h % 100 == 1:
        return "hang"
    return "good"


def bad_data(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """The warehouse lookup, except for the tickets `bad_data_fate` picks: an invalid result,
    or a first start deaf to cancellation that sleeps past the deadline (marked in
    ENRICHQ_TEST_STARTED_DIR, so the next attempt runs normally)."""
    fate = bad_data_fate(ticket.id)
    if fate == "hang":
        marker = os.path.join(os.environ["ENRICHQ_TEST_STARTED_DIR"], ticket.id)
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.close(fd)
            assert context.deadline is not None
            time.sleep(max(0.0, context.deadline - time.monotonic()) + 1.0)
        return warehouse_lookup(ticket, context)
    if fate == "good":
        return warehouse_lookup(ticket, context)
    return bad_enrichment(fate)


# -- batch enrichers


def noop_batch(tickets: Sequence[Ticket], context: EnrichContext) -> Mapping[str, Enrichment]:
    """No lookup at all, a batch at a time: what the queue and worker runtime cost."""
    empty = Enrichment(())
    return {t.id: empty for t in tickets}


def sleepy_batch(
    tickets: Sequence[Ticket], context: EnrichContext
) -> Mapping[str, Enrichment | BaseException]:
    """The built-in batch lookup behind a slow warehouse: each call first waits
    ENRICHQ_TEST_SLOW_SECONDS (default 0.2), its tickets' leases held meanwhile."""
    time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "0.2")))
    return warehouse_lookup_batch(tickets, context)


def batch_outcomes(
    tickets: Sequence[Ticket], context: EnrichContext
) -> Mapping[str, Enrichment | BaseException]:
    """Each ticket's outcome by the prefix of its id: "perm-" a PermanentError, "defer-" a
    Deferral of an hour, "trans-" a TransientError, "odd-" a ValueError, "gone-" left out of
    the mapping, "bad-" an invalid result (a NUL in its order id); any other ticket one
    order named after it. The call itself raises for a batch holding a "boom-" ticket."""
    if any(t.id.startswith("boom-") for t in tickets):
        raise ConnectionError("warehouse connection reset")
    out: dict[str, Enrichment | BaseException] = {}
    for t in tickets:
        if t.id.startswith("perm-"):
            out[t.id] = PermanentError(f"ticket {t.id} cannot be looked up")
        elif t.id.startswith("defer-"):
            out[t.id] = Deferral(datetime.now(UTC) + timedelta(hours=1), "quota")
        elif t.id.startswith("trans-"):
            out[t.id] = TransientError("warehouse busy")
        elif t.id.startswith("odd-"):
            out[t.id] = ValueError("unexpected")
        elif t.id.startswith("bad-"):
            out[t.id] = Enrichment((Order("O-\x00"),), job_id="batch-job", bytes_billed=7)
        elif not t.id.startswith("gone-"):
            out[t.id] = Enrichment((Order(f"O-{t.id}"),), job_id="batch-job", bytes_billed=7)
    return out


def slot_probe(tickets: Sequence[Ticket], context: EnrichContext) -> Mapping[str, Enrichment]:
    """A warehouse call that takes ENRICHQ_TEST_SLOW_SECONDS and records itself in
    ENRICHQ_TEST_STARTED_DIR: a file per call, named `pid-start` (monotonic ns, comparable
    across processes on Linux) and holding the end once the call returns; a call whose
    process was killed has an empty file."""
    folder = os.environ["ENRICHQ_TEST_STARTED_DIR"]
    path = os.path.join(folder, f"{os.getpid()}-{time.monotonic_ns()}")
    with open(path, "w"):
        pass
    time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "1")))
    end = time.monotonic_ns()
    with open(path, "w") as f:
        f.write(str(end))
    return {t.id: Enrichment((Order(f"O-{t.id}"),), job_id=f"probe-{end}") for t in tickets}


def warehouse_session(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Orders that describe the warehouse connection this enricher was given: its libpq
    tcp_user_timeout and psycopg prepare threshold (what the settings should have set)."""
    with context.warehouse.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        timeout = driver.info.get_parameters().get("tcp_user_timeout", "unset")
        threshold = driver.prepare_threshold
    return Enrichment((Order(f"tcp_user_timeout={timeout}"), Order(f"prepare={threshold}")))


def marks_its_process(
    tickets: Sequence[Ticket], context: EnrichContext
) -> Mapping[str, Enrichment]:
    """One order named after each ticket; each call appends its process id to a file per
    ticket in ENRICHQ_TEST_STARTED_DIR, then the process dies (exit 13) if the batch holds
    ticket POISON."""
    folder = os.environ["ENRICHQ_TEST_STARTED_DIR"]
    for t in tickets:
        with open(os.path.join(folder, t.id), "a") as f:
            f.write(f"{os.getpid()}\n")
    if any(t.id == "POISON" for t in tickets):
        os._exit(13)
    return {t.id: Enrichment((Order(f"O-{t.id}"),)) for t in tickets}


def bad_in_batch(
    tickets: Sequence[Ticket], context: EnrichContext
) -> Mapping[str, Enrichment | BaseException]:
    """One order named after each ticket, 1,000 bytes billed each; except ticket
    ENRICHQ_TEST_BAD_TICKET, whose outcome is of the kind ENRICHQ_TEST_BAD_KIND (one of
    BAD_KINDS). The whole batch reaches the settler at once, so the bad outcome is settled
    in one group with the good ones."""
    bad = os.environ.get("ENRICHQ_TEST_BAD_TICKET")
    out: dict[str, Enrichment | BaseException] = {}
    for t in tickets:
        if t.id == bad:
            try:
                out[t.id] = bad_enrichment(os.environ["ENRICHQ_TEST_BAD_KIND"])
            except TransientError as exc:
                out[t.id] = exc
        else:
            out[t.id] = Enrichment((Order(f"O-{t.id}"),), job_id="batch-job", bytes_billed=1000)
    return out


# -- plug-ins that misbehave towards their process (issue 25)

BASE_EXCEPTIONS = ("cancelled", "keyboard_interrupt", "system_exit")


def raises_base_exception(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Tickets whose id starts with 'B' raise the BaseException (not an Exception) named by
    ENRICHQ_TEST_BASE_KIND, one of BASE_EXCEPTIONS, as a library may (asyncio's
    CancelledError, a KeyboardInterrupt or SystemExit of its own); the others get `tagged`."""
    if ticket.id.startswith("B"):
        kind = os.environ.get("ENRICHQ_TEST_BASE_KIND", "cancelled")
        if kind == "cancelled":
            import asyncio

            raise asyncio.CancelledError("the library's event loop went away")
        if kind == "keyboard_interrupt":
            raise KeyboardInterrupt("raised by a library, not a signal")
        raise SystemExit(3)
    return tagged(ticket, context)


def raises_base_exception_batch(
    tickets: Sequence[Ticket], context: EnrichContext
) -> Mapping[str, Enrichment]:
    """The batch form: the call raises ENRICHQ_TEST_BASE_KIND's BaseException when its
    batch holds a ticket whose id starts with 'B'; otherwise `tagged` for each."""
    for t in tickets:
        if t.id.startswith("B"):
            raises_base_exception(t, context)
    return {t.id: tagged(t, context) for t in tickets}


STDOUT_NOISE = "a plug-in's chatter on stdout"


def prints_to_stdout(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Prints to stdout, through Python and straight to fd 1 (as a C library would), then
    returns `tagged` (1,000 bytes billed)."""
    import sys

    print(f"{STDOUT_NOISE} (print) {{not json")
    sys.stdout.flush()
    os.write(1, f"{STDOUT_NOISE} (fd 1)\n".encode())
    return tagged(ticket, context)


def ignores_cancellation(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Marks its start in ENRICHQ_TEST_STARTED_DIR, then sleeps ENRICHQ_TEST_SLOW_SECONDS
    deaf to cancellation, and bills 500 bytes."""
    marker = os.environ.get("ENRICHQ_TEST_STARTED_DIR")
    if marker:
        with open(os.path.join(marker, ticket.id), "w") as f:
            f.write(str(os.getpid()))
    time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "3")))
    return Enrichment((Order(f"O-{ticket.id}"),), job_id=f"late-{ticket.id}", bytes_billed=500)


def window_probe(tickets: Sequence[Ticket], context: EnrichContext) -> Mapping[str, Enrichment]:
    """A warehouse call that records itself in ENRICHQ_TEST_STARTED_DIR: a file per call,
    named `pid-start` (monotonic ns), holding how many tickets it got."""
    folder = os.environ["ENRICHQ_TEST_STARTED_DIR"]
    with open(os.path.join(folder, f"{os.getpid()}-{time.monotonic_ns()}"), "w") as f:
        f.write(str(len(tickets)))
    return {t.id: Enrichment((Order(f"O-{t.id}"),), job_id="window-probe") for t in tickets}


def priced_batch(tickets: Sequence[Ticket], context: EnrichContext) -> Mapping[str, Enrichment]:
    """A batch lookup that takes ENRICHQ_TEST_SLOW_SECONDS and bills ENRICHQ_TEST_QUERY_BYTES
    for the query, shared among its tickets (budget tests)."""
    from enrichq_service.enrich import split_bytes

    time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "0.5")))
    billed = int(os.environ.get("ENRICHQ_TEST_QUERY_BYTES", "10000"))
    shares = split_bytes(billed, len(tickets))
    return {
        t.id: Enrichment((Order(f"O-{t.id}"),), job_id=f"query-{tickets[0].id}", bytes_billed=s)
        for t, s in zip(tickets, shares, strict=True)
    }


def priced(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """A lookup that takes ENRICHQ_TEST_SLOW_SECONDS and bills ENRICHQ_TEST_QUERY_BYTES."""
    time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "0.5")))
    billed = int(os.environ.get("ENRICHQ_TEST_QUERY_BYTES", "10000"))
    return Enrichment((Order(f"O-{ticket.id}"),), job_id=f"job-{ticket.id}", bytes_billed=billed)


def unasked_keys(tickets: Sequence[Ticket], context: EnrichContext) -> Mapping[str, Enrichment]:
    """A buggy batch enricher: it answers under ids it was not asked for (each ticket's id
    with a suffix), 3,000 bytes billed each."""
    return {
        f"{t.id}-unasked": Enrichment(
            (Order(f"O-{t.id}"),), job_id="unasked-job", bytes_billed=3000
        )
        for t in tickets
    }


def forks_and_hangs(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Forks a helper that lives ENRICHQ_TEST_SLOW_SECONDS (holding every descriptor the
    plug-in had, the isolated child's answer pipe among them), writes the helper's pid to
    ENRICHQ_TEST_STARTED_DIR/helper, then hangs as long, deaf to cancellation (or, with
    ENRICHQ_TEST_EXIT set, exits its process)."""
    seconds = float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "600"))
    helper = os.fork()
    if helper == 0:
        time.sleep(seconds)
        os._exit(0)
    marker = os.environ["ENRICHQ_TEST_STARTED_DIR"]
    with open(os.path.join(marker, "helper.tmp"), "w") as f:
        f.write(str(helper))
    os.replace(os.path.join(marker, "helper.tmp"), os.path.join(marker, "helper"))
    if os.environ.get("ENRICHQ_TEST_EXIT"):
        os._exit(13)
    time.sleep(seconds)
    return tagged(ticket, context)


def hangs_then_exits(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Ticket POISON hangs ENRICHQ_TEST_SLOW_SECONDS, deaf to cancellation, on its first
    start, and exits its process on every later one (each start is marked in
    ENRICHQ_TEST_STARTED_DIR/POISON.<n>); other tickets are tagged."""
    if ticket.id == "POISON":
        marker = os.environ["ENRICHQ_TEST_STARTED_DIR"]
        starts = [n for n in os.listdir(marker) if n.startswith("POISON.")]
        with open(os.path.join(marker, f"POISON.{len(starts)}"), "w") as f:
            f.write(str(os.getpid()))
        if starts:
            os._exit(13)
        time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "600")))
    return tagged(ticket, context)


def answers_then_lingers(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """A result billing 777 bytes, given at once; but a thread it leaves behind keeps its
    process alive ENRICHQ_TEST_SLOW_SECONDS after it (Python waits for it at exit). The
    answer's moment is marked in ENRICHQ_TEST_STARTED_DIR/<ticket id>."""
    threading.Thread(
        target=time.sleep, args=(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "600")),)
    ).start()
    marker = os.environ["ENRICHQ_TEST_STARTED_DIR"]
    with open(os.path.join(marker, ticket.id), "w") as f:
        f.write(str(os.getpid()))
    return Enrichment((Order(f"O-{ticket.id}"),), job_id=f"job-{ticket.id}", bytes_billed=777)


def slow_in_a_child(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """Tagged at once in the worker's process; in an isolated child, first hangs
    ENRICHQ_TEST_SLOW_SECONDS, deaf to cancellation (a child that cannot answer within the
    attempt's deadline)."""
    main = sys.modules["__main__"]
    if main.__spec__ is not None and main.__spec__.name == "enrichq_service.isolate":
        time.sleep(float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "600")))
    return tagged(ticket, context)
