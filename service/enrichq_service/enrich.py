"""Enrichment: read the ticket, look its customer up, write what was found; the plug-in
forms (per ticket, per batch), the checks on what a plug-in returns, and the built-in
warehouse lookup."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from functools import cache
from typing import Any, Protocol
from uuid import UUID

import sqlalchemy as sa

from enrichq_schema import metrics
from enrichq_schema.errors import SettingsError
from enrichq_schema.identifiers import qualified, qualified_parts, render
from enrichq_schema.process import PluginError, load_callable
from enrichq_schema.queries import load
from enrichq_schema.settings import BUILTIN_BATCH_ENRICHER, Settings
from enrichq_schema.text import error_line
from enrichq_service.errors import PermanentError, ServiceError, TransientError

SQL = load("enrichq_service", "sql/enrich.sql")
log = logging.getLogger(__name__)
ID_MAX_LENGTH = 1000  # order, customer and warehouse job ids
# The most bytes one lookup may bill: a pebibyte (2^50). No warehouse bills a query
# anywhere near it (BigQuery's on-demand price makes it a six-figure query), and a day's
# ledger of 2^13 such lookups still fits its bigint. A larger figure is a plug-in's bug
# (a sentinel, an overflow): it fails that job alone and is charged as nothing.
BYTES_MAX = 2**50
ERROR_MAX_LENGTH = 4000
# PostgreSQL's numeric (a total): at most 131072 digits before the decimal point, 16383 after
NUMERIC_DIGITS_MAX = 131_071  # the largest exponent of a leading digit
NUMERIC_SCALE_MAX = 16_383


@dataclass(frozen=True, slots=True)
class Ticket:
    """A ticket as mirrored from the help desk."""

    id: str
    requester_email: str | None
    tenant: str | None
    created_at: datetime | None
    updated_at: datetime | None


@dataclass(frozen=True, slots=True)
class Order:
    """One order found for a ticket's customer."""

    order_id: str
    customer_id: str | None = None
    placed_at: datetime | None = None
    total: Decimal | float | None = None  # `validate` makes it a Decimal


@dataclass(frozen=True, slots=True)
class Enrichment:
    """What an enricher found: the orders, and what the warehouse charged for the lookup."""

    orders: Sequence[Order] = ()
    job_id: str | None = None
    bytes_billed: int = 0


Interrupt = Callable[[Callable[[], None]], AbstractContextManager[None]]


def _no_interrupt(cancel: Callable[[], None]) -> AbstractContextManager[None]:
    return nullcontext()


@dataclass(frozen=True, slots=True)
class EnrichContext:
    """What an enricher may use: settings, the warehouse, and ways to stop early.

    `cancelled` is set when the attempt is abandoned (its deadline passed) or its lease was
    lost; `deadline` is that moment (time.monotonic()); `interruptible(cancel)` is a context
    manager during which abandoning or losing the attempt calls `cancel` (the built-in
    lookup cancels its running warehouse query with it).
    """

    settings: Settings
    warehouse: sa.Engine
    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None
    interruptible: Interrupt = _no_interrupt
    kind: str = "enrich"  # the queue kind(s) of the tickets, for the warehouse job's labels

    def remaining_seconds(self) -> float | None:
        """Seconds left before the attempt's deadline (None: no deadline)."""
        import time

        return None if self.deadline is None else self.deadline - time.monotonic()


class Enricher(Protocol):
    """A per-ticket enrichment plug-in."""

    def __call__(self, ticket: Ticket, context: EnrichContext, /) -> Enrichment: ...


class BatchEnricher(Protocol):
    """A batch enrichment plug-in: a result or an exception per ticket id."""

    def __call__(
        self, tickets: Sequence[Ticket], context: EnrichContext, /
    ) -> Mapping[str, Enrichment | BaseException]: ...


@dataclass(frozen=True, slots=True)
class EnricherChoice:
    """Which plug-in a process runs: a per-ticket or a batch enricher."""

    per_ticket: Enricher | None
    batch: BatchEnricher | None
    batch_size: int

    @property
    def unit_size(self) -> int:
        """Jobs one call enriches: the batch size, or 1 for a per-ticket enricher."""
        return self.batch_size if self.batch is not None else 1


def choose(settings: Settings) -> EnricherChoice:
    """The enricher the settings name (the built-in batch lookup unless told otherwise)."""
    if settings.enricher is not None:
        return EnricherChoice(load_enricher(settings.enricher), None, 1)
    path = settings.batch_enricher or BUILTIN_BATCH_ENRICHER
    return EnricherChoice(None, load_batch_enricher(path), settings.lookup_batch_size)


# What the error of a plug-in call that raised a BaseException begins with (the claim loop
# retries such a job as a suspect, in a child process: `isolate.is_suspect`).
ABORTED = "the enricher raised a BaseException"


class PluginAborted(TransientError):
    """The plug-in raised a BaseException that is not an Exception (asyncio's
    CancelledError, a library's KeyboardInterrupt or SystemExit): that call's tickets'
    error, retried, never the process's. `shared`: the call was for several tickets (a
    batch), so which of them caused it is not known."""

    def __init__(self, message: str, *, shared: bool = False) -> None:
        super().__init__(message)
        self.shared = shared

    @classmethod
    def of(cls, exc: BaseException, *, shared: bool) -> PluginAborted:
        """The error of a call that raised `exc`."""
        return cls(f"{ABORTED} ({error_text(exc)})", shared=shared)


def _plugin_error(exc: BaseException, *, shared: bool) -> BaseException:
    """What a plug-in call that raised `exc` comes to for its tickets: an Exception as it
    is, any other BaseException as PluginAborted. Only a KeyboardInterrupt that a SIGINT
    to this process may have raised (in the main thread, under Python's default SIGINT
    handler) is not the plug-in's: it goes on up, as an interrupt of the process."""
    if isinstance(exc, Exception):
        return exc
    if (
        isinstance(exc, KeyboardInterrupt)
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        raise exc
    return PluginAborted.of(exc, shared=shared)


class Missing(TransientError):
    """The batch enricher returned nothing for this ticket."""


@dataclass(frozen=True, slots=True)
class Surcharge:
    """A ticket's outcome (`value`, a result or an exception, as the plug-in gave it) and
    its share of bytes billed that came under answers for tickets the batch was not asked
    for: the query ran and billed them, so the batch's tickets are charged them."""

    value: object
    bytes_billed: int
    job_id: str | None = None


def enrich_all(
    choice: EnricherChoice, tickets: Sequence[Ticket], context: EnrichContext
) -> dict[str, object]:
    """Each ticket's outcome, by ticket id, from the plug-in as it came (a result, not yet
    validated, or an exception): a batch enricher is called once for them all, and a call
    that raises is every ticket's outcome; a per-ticket enricher once per ticket. A call
    that raises a BaseException that is not an Exception gets PluginAborted (`_plugin_error`):
    the plug-in's failure, never the caller's. Used alike in the worker and in an isolated
    child."""
    if choice.per_ticket is not None:
        outcomes: dict[str, object] = {}
        for ticket in tickets:
            try:
                outcomes[ticket.id] = choice.per_ticket(ticket, context)
            except BaseException as exc:
                outcomes[ticket.id] = _plugin_error(exc, shared=False)
        return outcomes
    assert choice.batch is not None
    try:
        results = choice.batch(tickets, context)
    except BaseException as exc:
        error = _plugin_error(exc, shared=len(tickets) > 1)
        return {t.id: error for t in tickets}
    if not isinstance(results, Mapping):
        bad = PermanentError(f"the batch enricher returned {type(results).__name__}, not a mapping")
        return {t.id: bad for t in tickets}
    missing = Missing("the batch enricher returned nothing for it")
    outcomes = {t.id: results.get(t.id, missing) for t in tickets}
    return _charge_unasked(outcomes, results, tickets)


def _charge_unasked(
    outcomes: dict[str, object], results: Mapping[Any, object], tickets: Sequence[Ticket]
) -> dict[str, object]:
    """`outcomes`, with the bytes billed under answers for ids the batch was not asked for
    shared among its tickets (`Surcharge`): those answers are dropped, logged and counted
    (`enrichq_batch_unasked_answers_total`), never their bytes."""
    asked = {t.id for t in tickets}
    unasked = [k for k in results if k not in asked]
    if not unasked:
        return outcomes
    metrics.batch_unasked_answers_total.inc(len(unasked))
    job_id, billed = None, 0
    for key in unasked:
        their_job, their_bytes = charge_of(results[key])
        job_id = job_id or their_job
        billed += their_bytes
    log.warning(
        "a batch enricher answered for %d ticket id(s) it was not asked for (%s): answers"
        " dropped, their %d bytes billed charged to the batch's %d tickets",
        len(unasked),
        ", ".join(repr(k) for k in unasked[:3]) + (", …" if len(unasked) > 3 else ""),
        billed,
        len(tickets),
    )
    if not billed:
        return outcomes
    shares = split_bytes(min(billed, BYTES_MAX), len(tickets))
    return {
        t.id: Surcharge(outcomes[t.id], share, job_id) if share else outcomes[t.id]
        for t, share in zip(tickets, shares, strict=True)
    }


def _load(path: str, setting: str) -> Any:
    try:
        return load_callable(path)
    except PluginError as exc:
        raise SettingsError(f"invalid setting {setting}: {exc}") from None


@cache
def load_enricher(path: str) -> Enricher:
    """Import ``package.module:function``; a bad path is a SettingsError naming it."""
    enricher: Enricher = _load(path, "ENRICHQ_ENRICHER")
    return enricher


@cache
def load_batch_enricher(path: str) -> BatchEnricher:
    """Import ``package.module:function``; a bad path is a SettingsError naming it."""
    enricher: BatchEnricher = _load(path, "ENRICHQ_BATCH_ENRICHER")
    return enricher


# -- checking what a plug-in returns, where it enters


class InvalidResult(PermanentError):
    """An enricher returned a result enrichq cannot store; the message names the field."""


def validate(result: object) -> Enrichment:
    """`result` as a storable Enrichment (a total as Decimal, a naive time as UTC), or
    InvalidResult naming the first field that is wrong."""
    if not isinstance(result, Enrichment):
        raise InvalidResult(f"expected an Enrichment, got {type(result).__name__}")
    orders = result.orders
    if isinstance(orders, str | bytes) or not isinstance(orders, Sequence):
        raise InvalidResult(f"orders: expected a sequence of Order, got {type(orders).__name__}")
    checked = tuple(_order(o, f"orders[{i}]") for i, o in enumerate(orders))
    job_id = _text(result.job_id, "job_id", required=False)
    billed = result.bytes_billed
    if isinstance(billed, bool) or not isinstance(billed, int) or not 0 <= billed <= BYTES_MAX:
        raise InvalidResult(f"bytes_billed: expected an integer from 0 to 2^50, got {billed!r}")
    return Enrichment(checked, job_id=job_id, bytes_billed=billed)


def charge_of(result: object, ticket_id: str | None = None) -> tuple[str | None, int]:
    """The warehouse job id and bytes billed that a result reports, as far as they are
    valid themselves: a result refused for a bad order still cost what its lookup billed,
    and that is charged (a job id or byte count that is itself bad counts as none). An
    error reports what the built-in lookup recorded on it for `ticket_id` (`charged`)."""
    if isinstance(result, BaseException):
        charges = getattr(result, CHARGE_ATTRIBUTE, None)
        if not isinstance(charges, dict) or ticket_id not in charges:
            return None, 0
        result = Enrichment((), *charges[ticket_id])
    if not isinstance(result, Enrichment):
        return None, 0
    try:
        job_id = _text(result.job_id, "job_id", required=False)
    except InvalidResult:
        job_id = None
    billed = result.bytes_billed
    if isinstance(billed, bool) or not isinstance(billed, int) or not 0 <= billed <= BYTES_MAX:
        billed = 0
    return job_id, billed


def _order(order: object, where: str) -> Order:
    if not isinstance(order, Order):
        raise InvalidResult(f"{where}: expected an Order, got {type(order).__name__}")
    order_id = _text(order.order_id, f"{where}.order_id", required=True)
    assert order_id is not None
    customer_id = _text(order.customer_id, f"{where}.customer_id", required=False)
    placed_at = checked_time(order.placed_at, f"{where}.placed_at")
    total = _number(order.total, f"{where}.total")
    if (
        type(order) is Order  # a subclass's fields may not read the same twice
        and order_id is order.order_id
        and customer_id is order.customer_id
        and placed_at is order.placed_at
        and total is order.total
    ):
        return order  # storable as it is (the built-in lookup's orders): no copy
    return Order(order_id, customer_id, placed_at, total)


def _text(value: object, where: str, *, required: bool) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise InvalidResult(f"{where}: expected text, got {type(value).__name__}")
    if not value or len(value) > ID_MAX_LENGTH:
        raise InvalidResult(f"{where}: must be 1 to {ID_MAX_LENGTH} characters")
    if "\x00" in value:
        raise InvalidResult(f"{where}: contains a NUL byte")
    if (surrogate := _surrogate(value)) is not None:
        raise InvalidResult(f"{where}: contains a lone surrogate ({surrogate}), not UTF-8 text")
    return value


def _surrogate(value: str) -> str | None:
    """The first lone surrogate of `value` as ``U+XXXX`` (no UTF-8 text holds one), or None."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"U+{ord(value[exc.start]):04X}"
    return None


def checked_time(value: object, where: str) -> datetime | None:
    """A plug-in's time as PostgreSQL will read it: one without a UTC offset (naive, or
    whose time zone gives none) as UTC; InvalidResult for anything but a datetime, or a
    time zone that fails."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidResult(f"{where}: expected a datetime, got {type(value).__name__}")
    try:
        offset = value.utcoffset()  # what the driver asks when it sends the time
    except Exception:  # a plug-in's own tzinfo may raise anything
        raise InvalidResult(f"{where}: its time zone gives no valid UTC offset") from None
    return value if offset is not None else value.replace(tzinfo=UTC)


def _number(value: object, where: str) -> Decimal | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Decimal | int | float):
        raise InvalidResult(f"{where}: expected a number, got {type(value).__name__}")
    try:
        # an int as it is: str() of one past 4300 digits raises ValueError
        number = value if isinstance(value, Decimal | int) else Decimal(str(value))
        if type(number) is not Decimal:  # a Decimal is immutable: kept as it is
            number = Decimal(number)
    except (InvalidOperation, ValueError):
        raise InvalidResult(f"{where}: not a number") from None
    if not number.is_finite() or (isinstance(value, float) and not math.isfinite(value)):
        raise InvalidResult(f"{where}: must be a finite number")
    if not number:
        return Decimal(0)  # a zero of any exponent (0E-20000 would overflow numeric)
    exponent = number.as_tuple().exponent
    assert isinstance(exponent, int)  # a finite number's is
    if number.adjusted() > NUMERIC_DIGITS_MAX or exponent < -NUMERIC_SCALE_MAX:
        raise InvalidResult(f"{where}: out of the range PostgreSQL's numeric holds")
    return number


def error_text(exc: BaseException) -> str:
    """An error as a row's last_error: one printable line (`enrichq_schema.text.error_line`)."""
    return error_line(exc, ERROR_MAX_LENGTH)


# -- the mirror and the built-in warehouse lookup


@cache
def _statement(name: str, expanding: tuple[str, ...] = (), **tables: str) -> sa.TextClause:
    # Only validated, quoted identifiers are substituted; values are always bound.
    clause = render(SQL[name], **tables)
    if expanding:
        clause = clause.bindparams(*(sa.bindparam(n, expanding=True) for n in expanding))
    return clause


def read_tickets(conn: sa.Connection, settings: Settings, ids: Sequence[str]) -> dict[str, Ticket]:
    """The mirrored tickets among `ids`, by id."""
    if not ids:
        return {}
    stmt = _statement(
        "enrich_read_tickets", tickets=qualified(conn.dialect, settings.tickets_table)
    )
    return {
        r.id: Ticket(r.id, r.requester_email, r.tenant, r.created_at, r.updated_at)
        for r in conn.execute(stmt, {"ids": list(ids)})
    }


def warehouse_lookup(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """The built-in enricher, per ticket: the requester's orders in the warehouse."""
    outcome = warehouse_lookup_batch([ticket], context)[ticket.id]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def warehouse_lookup_batch(
    tickets: Sequence[Ticket], context: EnrichContext
) -> Mapping[str, Enrichment | BaseException]:
    """The built-in enricher: one warehouse query for the orders of every ticket's
    requester (by e-mail, case folded by the warehouse's lower() on both sides, as parity
    does), bytes billed shared out by `split_bytes`.

    On PostgreSQL the query runs under a statement timeout of the attempt's remaining time,
    and is cancelled when the attempt is abandoned or its lease lost; on BigQuery it runs
    as a query job of enrichq's own making (`enrichq_service.bigquery`), bounded and
    cancelled alike. A row the query returns with a bad value (a NULL order id, say) fails
    its ticket alone, in `validate`. A value the warehouse itself cannot read (a total that
    does not convert to a number) fails the whole query and names no ticket: the batch is
    split in halves, and halves again (at most `SPLIT_DEPTH_MAX` times, `SPLIT_QUERIES_MAX`
    more queries), until the tickets whose rows fail are alone; the others complete. Every
    query that ran is charged, a failed one shared among its tickets.
    """
    lookup = _BatchLookup(context)
    lookup.run(list(tickets), depth=0)
    out: dict[str, Enrichment | BaseException] = {}
    for ticket in tickets:
        job_id, billed = lookup.charges.get(ticket.id, (None, 0))
        outcome = lookup.outcomes[ticket.id]
        if isinstance(outcome, BaseException):
            out[ticket.id] = charged(outcome, ticket.id, job_id, billed)
        else:
            out[ticket.id] = Enrichment(outcome, job_id=job_id, bytes_billed=billed)
    return out


# A batch whose query fails on its data is split in halves at most this often: enough to
# isolate single tickets in the largest batch (ENRICHQ_LOOKUP_BATCH_SIZE is at most 1000).
SPLIT_DEPTH_MAX = 10
# ... and runs at most this many more queries for it: one culprit in the largest batch
# takes 2 per level (20), two take up to 40; data that fails every query whatever it asks
# (a view that cannot be read at all) costs no more than this before the rest fail
# together. On BigQuery each is a billed job (10 MB at least).
SPLIT_QUERIES_MAX = 64


class _BatchLookup:
    """The queries of one batch lookup: each ticket's orders (or error), and the job and
    bytes each ticket is charged (its shares of every query it was part of)."""

    def __init__(self, context: EnrichContext) -> None:
        self.context = context
        self.outcomes: dict[str, tuple[Order, ...] | BaseException] = {}
        self.charges: dict[str, tuple[str | None, int]] = {}
        self.split_queries_left = SPLIT_QUERIES_MAX

    def _charge(self, group: Sequence[Ticket], job_id: str | None, billed: int) -> None:
        for ticket, share in zip(group, split_bytes(billed, len(group)), strict=True):
            before_job, before = self.charges.get(ticket.id, (None, 0))
            self.charges[ticket.id] = (job_id or before_job, before + share)

    def run(self, group: list[Ticket], *, depth: int) -> None:
        # as the help desk has them: the warehouse folds case, on both sides (`_query`)
        emails = sorted({t.requester_email for t in group if t.requester_email})
        found: dict[str, list[Order]] = {e: [] for e in emails}
        if emails and depth and self.context.cancelled.is_set():
            # abandoned while its batch was being split: the rest never runs
            abandoned = TransientError("the lookup was abandoned before this part of its batch ran")
            for ticket in group:
                self.outcomes[ticket.id] = abandoned
            return
        if emails:
            try:
                rows, job_id, billed = _query(self.context, emails)
            except QueryFailed as failed:
                self._charge(group, failed.job_id, failed.bytes_billed)
                if (
                    failed.data
                    and len(group) > 1
                    and depth < SPLIT_DEPTH_MAX
                    and self.split_queries_left >= 2
                    and not self.context.cancelled.is_set()
                ):
                    self.split_queries_left -= 2
                    half = len(group) // 2
                    self.run(group[:half], depth=depth + 1)
                    self.run(group[half:], depth=depth + 1)
                    return
                for ticket in group:
                    self.outcomes[ticket.id] = failed.error
                return
            self._charge(group, job_id, billed)
            for email, order_id, customer_id, placed_at, total in rows:
                order = Order(_id(order_id), _id(customer_id), placed_at, total)
                found.setdefault(str(email), []).append(order)
        for ticket in group:
            email = ticket.requester_email
            self.outcomes[ticket.id] = tuple(found.get(email, [])) if email else ()


class QueryFailed(ServiceError):
    """A warehouse query failed: the error its tickets get, and what it billed. `data`:
    the warehouse could not read a value (a query of fewer tickets may succeed)."""

    def __init__(
        self, error: BaseException, job_id: str | None, bytes_billed: int, *, data: bool
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.job_id = job_id
        self.bytes_billed = bytes_billed
        self.data = data


class WarehouseDataError(PermanentError):
    """The warehouse could not read this ticket's orders (a value that does not convert)."""


def _query(context: EnrichContext, emails: list[str]) -> tuple[list[Any], str | None, int]:
    """The batch statement's rows for `emails`, its warehouse job id and bytes billed;
    QueryFailed when the warehouse refused it for its data (or, on BigQuery, for anything:
    a BigQuery job bills even when it fails)."""
    settings = context.settings
    dialect = context.warehouse.dialect
    stmt = _statement(
        "enrich_warehouse_orders_batch",
        asked=_asked(len(emails)),
        customers=qualified_parts(dialect, settings.customers_table),
        orders=qualified_parts(dialect, settings.orders_table),
    )
    params = {f"asked_{i}": e for i, e in enumerate(emails)}
    if dialect.name == "bigquery":
        return _query_bigquery(context, stmt, params)
    try:
        with (
            context.warehouse.connect() as conn,
            conn.begin(),
            _statement_timeout(conn, context),
            context.interruptible(_canceller(conn)),
        ):
            result = conn.execute(stmt, params)
            # before the rows are read: a result that has returned them all lets its cursor go
            job_id, billed = _warehouse_job(result)
            return list(result), job_id, billed
    except sa.exc.DataError as exc:
        error = WarehouseDataError(f"the warehouse could not read the orders: {error_text(exc)}")
        raise QueryFailed(error, None, 0, data=True) from exc


def _query_bigquery(
    context: EnrichContext, stmt: sa.TextClause, params: dict[str, str]
) -> tuple[list[Any], str | None, int]:
    from enrichq_service import bigquery

    with context.warehouse.connect() as conn:
        try:
            ran = bigquery.run(
                conn,
                stmt,
                params,
                kind=context.kind,
                max_bytes=context.settings.max_bytes_per_query,
                deadline=context.deadline,
                interruptible=context.interruptible,
            )
        except bigquery.JobFailed as failed:
            error = failed.error
            if failed.data:
                error = WarehouseDataError(f"the warehouse could not read the orders: {error}")
            raise QueryFailed(error, failed.job_id, failed.bytes_billed, data=failed.data) from None
    return ran.rows, ran.job_id, ran.bytes_billed


# The attribute of an error returned for a ticket that says what its ticket is charged
# (`charged`, `charge_of`): its share of the warehouse job that failed.
CHARGE_ATTRIBUTE = "enrichq_charges"


def charged(error: BaseException, ticket_id: str, job_id: str | None, billed: int) -> BaseException:
    """`error`, as one ticket's outcome, recording that ticket's charge on it (one error
    may be the outcome of several tickets, each charged its own share)."""
    if job_id is not None or billed:
        charges: dict[str, tuple[str | None, int]] = getattr(error, CHARGE_ATTRIBUTE, None) or {}
        charges[ticket_id] = (job_id, billed)
        setattr(error, CHARGE_ATTRIBUTE, charges)
    return error


def _asked(n: int) -> str:
    """The rows of the e-mails a batch lookup asks for: `n` bound placeholders, one a row
    (the same SQL on every dialect: a portable list of values to join)."""
    return " UNION ALL ".join(f"SELECT :asked_{i} AS asked" for i in range(n))


def _id(value: Any) -> Any:
    """An id as the warehouse gave it, an integer id as its text (warehouses often key
    orders and customers by INT64). Anything else, NULL included, is left for `validate`
    to refuse by field: never `str(None)`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def split_bytes(billed: int, tickets: int) -> list[int]:
    """A batch's bytes billed shared out among its tickets: equal shares, the remainder a
    byte each to the first tickets, so the shares add up to exactly what was billed."""
    if tickets <= 0:
        return []
    share, rest = divmod(billed, tickets)
    return [share + (1 if i < rest else 0) for i in range(tickets)]


@contextmanager
def _statement_timeout(conn: sa.Connection, context: EnrichContext) -> Iterator[None]:
    """On PostgreSQL, limit the transaction's statements to the attempt's remaining time."""
    remaining = context.remaining_seconds()
    if remaining is not None and conn.dialect.name == "postgresql":
        if remaining <= 0:
            raise TransientError("the attempt's deadline passed before the lookup started")
        conn.execute(
            SQL("enrich_statement_timeout"), {"timeout_ms": str(max(1, int(remaining * 1000)))}
        )
    yield


def _canceller(conn: sa.Connection) -> Callable[[], None]:
    """Cancels the statement running on `conn`, from another thread (psycopg's cancel,
    DuckDB's interrupt).

    The cancel request goes over a new connection, which a dead network would hold up:
    it is sent from a thread of its own, so whoever cancels (the heartbeat's watch, the
    claim loop) never waits for it."""
    raw = conn.connection.dbapi_connection

    def cancel() -> None:
        method = (
            getattr(raw, "cancel_safe", None)
            or getattr(raw, "cancel", None)
            or getattr(raw, "interrupt", None)
        )
        if method is not None:
            threading.Thread(
                target=_best_effort, args=(method,), name="enrichq-cancel", daemon=True
            ).start()

    return cancel


def _best_effort(call: Callable[[], object]) -> None:
    # the statement timeout still bounds a lookup whose cancel did not get through
    with contextlib.suppress(Exception):
        call()


def _warehouse_job(result: sa.CursorResult[Any]) -> tuple[str | None, int]:
    """The warehouse's job id and bytes billed, where its DB-API cursor reports them.

    BigQuery's DB-API cursor keeps the query job; other warehouses bill nothing per query.
    """
    job = getattr(getattr(result, "cursor", None), "query_job", None)
    if job is None:
        return None, 0
    return str(getattr(job, "job_id", "") or "") or None, int(
        getattr(job, "total_bytes_billed", 0) or 0
    )


# -- writing results, for the jobs whose settle won


@dataclass(frozen=True, slots=True)
class Lookup:
    """One ticket's share of a warehouse lookup, as the lookup log records it: once per
    claim (queue id and claim token), however often its settle runs."""

    queue_id: int
    claim_token: UUID
    ticket_id: str
    attempt: int
    job_id: str | None
    bytes_billed: int
    rows: int
    duration_ms: float
    status: str
    looked_up_at: datetime | None
    error: str | None = None
    admission: UUID | None = None  # the fleet-wide reservation to release (budget, cap)


@dataclass(frozen=True, slots=True)
class Result:
    """A completed job's orders, written if its settle wins."""

    queue_id: int
    ticket_id: str
    enrichment: Enrichment
    looked_up_at: datetime | None  # None: the database clock now


def write_results(conn: sa.Connection, results: Sequence[Result]) -> None:
    """Replace the rows of each ticket with its new orders.

    Writes of one ticket by concurrent transactions are serialized on its enrichment row:
    the later one replaces, never merges.
    """
    if not results:
        return
    latest: dict[str, Result] = {}
    for result in sorted(results, key=lambda r: r.queue_id):
        latest[result.ticket_id] = result
    tickets = sorted(latest)
    conn.execute(
        SQL("enrich_upsert_enrichments"),
        {
            "tickets": tickets,
            "enriched_ats": [latest[t].looked_up_at for t in tickets],
            "order_counts": [len(latest[t].enrichment.orders) for t in tickets],
            "queue_ids": [latest[t].queue_id for t in tickets],
        },
    )
    conn.execute(SQL("enrich_delete_ticket_orders"), {"tickets": tickets})
    rows: dict[str, list[Any]] = {
        k: []
        for k in (
            "tickets",
            "order_ids",
            "customer_ids",
            "placed_ats",
            "totals",
            "looked_up_ats",
            "queue_ids",
        )
    }
    for ticket_id in tickets:
        result = latest[ticket_id]
        for order in result.enrichment.orders:
            rows["tickets"].append(ticket_id)
            rows["order_ids"].append(order.order_id)
            rows["customer_ids"].append(order.customer_id)
            rows["placed_ats"].append(order.placed_at)
            rows["totals"].append(order.total)
            rows["looked_up_ats"].append(result.looked_up_at)
            rows["queue_ids"].append(result.queue_id)
    if rows["tickets"]:
        conn.execute(SQL("enrich_insert_ticket_orders"), rows)


def log_lookups(conn: sa.Connection, lookups: Sequence[Lookup], *, now: datetime | None) -> int:
    """Record lookups once per claim, add what was recorded to today's budget ledger, and
    release their reservations; how many were recorded now (not before)."""
    if not lookups:
        return 0
    row = conn.execute(
        SQL("enrich_log_lookups"),
        {
            "queue_ids": [x.queue_id for x in lookups],
            "tokens": [x.claim_token for x in lookups],
            "tickets": [x.ticket_id for x in lookups],
            "attempts": [x.attempt for x in lookups],
            "job_ids": [x.job_id for x in lookups],
            "bytes": [x.bytes_billed for x in lookups],
            "rows": [x.rows for x in lookups],
            "durations": [x.duration_ms for x in lookups],
            "statuses": [x.status for x in lookups],
            "errors": [x.error for x in lookups],
            "looked_up_ats": [x.looked_up_at for x in lookups],
            "admissions": sorted({str(x.admission) for x in lookups if x.admission}),
            "now": now,
        },
    ).one()
    return int(row.logged)


@dataclass(frozen=True, slots=True)
class Budget:
    """Today's warehouse spend against the daily budget (0 = no budget)."""

    spent: int
    limit: int
    resets_at: datetime

    @property
    def exhausted(self) -> bool:
        return self.limit > 0 and self.spent >= self.limit


def read_budget(conn: sa.Connection, limit: int, *, now: datetime | None = None) -> Budget:
    """Bytes billed today (UTC) and when the day resets."""
    row = conn.execute(SQL("enrich_budget_today"), {"now": now}).one()
    return Budget(int(row.bytes_billed), limit, row.resets_at)
