"""A plug-in that behaves, per ticket, as a table says: the generative fault harness's
(`tests/chaos/fuzz.py`) enricher, per ticket (`tests.support.behaviours:per_ticket`) or per
batch (`tests.support.behaviours:batch`).

The table (JSON, path in ENRICHQ_TEST_BEHAVIOURS) maps each ticket id to a behaviour name
and the bytes its good lookups bill. Every behaviour says what must become of its ticket
(`BEHAVIOURS`): a *good* one ends `done` with exactly the warehouse's orders however it
got there (a hang, an error or an exit the first time, a print); a *bad* one ends `failed`
or dead-lettered (`attempts_exhausted`) with a `last_error` naming its reason.

Behaviours that act once (`*_once`) remember it in ENRICHQ_TEST_MARKERS (a file per
ticket, made with O_EXCL, so across processes). Every call is recorded in
ENRICHQ_TEST_CALLS (a file per process): `start TICKET` when it begins and `end TICKET
BYTES` when it returns a result or an error for it (BYTES: what that outcome bills, as
enrichq may charge it), so the harness can hold the lookup log to what ran.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from functools import cache
from typing import Any

import sqlalchemy as sa

from enrichq_service.enrich import (
    BYTES_MAX,
    EnrichContext,
    Enrichment,
    Order,
    Ticket,
    warehouse_lookup_batch,
)
from enrichq_service.errors import Deferral, PermanentError, TransientError

EXIT_CODE = 13  # what a plug-in that exits the process exits with


class PluginBaseError(BaseException):
    """A BaseException that is none of Python's own (a plug-in's framework may raise one)."""


@dataclass(frozen=True, slots=True)
class Behaviour:
    """What a ticket's enrichment does, and what must become of the ticket: `states` it may
    end in (done: with the warehouse's orders; dead_letter: attempts exhausted) and a text
    its `last_error` must hold (None for done; alternatives separated by "|")."""

    name: str
    states: frozenset[str]
    reason: str | None
    batch_only: bool = False
    per_ticket_only: bool = False
    process_loss: bool = False  # it ends the process running it (os._exit)

    @property
    def good(self) -> bool:
        return self.states == DONE

    def names_reason(self, last_error: str | None) -> bool:
        """Does `last_error` hold (one of) the reason(s) this behaviour must be failed for?"""
        return not self.reason or any(r in (last_error or "") for r in self.reason.split("|"))


DONE = frozenset({"done"})
FAILED = frozenset({"failed"})
EXHAUSTED = frozenset({"dead_letter"})


def _b(name: str, states: frozenset[str], reason: str | None = None, **kw: Any) -> Behaviour:
    return Behaviour(name, states, reason, **kw)


BEHAVIOURS: dict[str, Behaviour] = {
    b.name: b
    for b in (
        # -- good: done with the warehouse's orders
        _b("good", DONE),
        _b("print", DONE),  # 20 kB to stdout and stderr, then good
        _b("hang_once", DONE),  # first start: a warehouse query past the deadline, deaf
        _b("transient_once", DONE),
        _b("error_once", DONE),  # an unexpected Exception (ValueError, KeyError, OSError)
        _b("base_once", DONE),  # a BaseException subclass, once
        _b("defer_once", DONE),
        _b("exit_once", DONE, process_loss=True),  # os._exit on the first start
        _b("batch_raise_once", DONE, batch_only=True),  # the whole call raises, once
        _b("extra_answers", DONE, batch_only=True),  # answers for tickets it was not asked
        # -- bad: failed naming the field, or dead-lettered with the reason
        _b("permanent", FAILED, "permanent by behaviour"),
        _b("transient_always", EXHAUSTED, "transient by behaviour"),
        _b("base_always", EXHAUSTED, "PluginBaseError"),
        _b("nul_error_always", EXHAUSTED, "TransientError"),  # a message with NUL, newline
        _b("surrogate_error_always", EXHAUSTED, "TransientError"),  # with a lone surrogate
        # its deaf query returns the right orders late, every time: dead-lettered once the
        # deadlines have spent its attempts, or done (with exactly the warehouse's orders)
        # when its result comes back before the claim loop abandons it, a slow but right
        # result being no broken promise
        _b("hang_always", DONE | EXHAUSTED, ""),
        _b("exit_always", EXHAUSTED, "", process_loss=True),
        _b("missing_always", EXHAUSTED, "returned nothing", batch_only=True),
        _b("none_result", FAILED, "expected an Enrichment", per_ticket_only=True),
        _b("dict_result", FAILED, "expected an Enrichment"),
        _b("str_orders", FAILED, "orders"),
        _b("str_order", FAILED, "orders[0]"),
        _b("int_order_id", FAILED, "orders[0].order_id"),
        _b("nul_order_id", FAILED, "orders[0].order_id"),
        _b("surrogate_order_id", FAILED, "orders[0].order_id"),
        _b("surrogate_customer_id", FAILED, "orders[0].customer_id"),
        _b("surrogate_job_id", FAILED, "job_id"),
        _b("long_order_id", FAILED, "orders[0].order_id"),
        _b("nan_total", FAILED, "orders[0].total"),
        _b("inf_total", FAILED, "orders[0].total"),
        # beyond what numeric stores: refused by validation, or by the database
        _b("huge_total", FAILED, "orders[0].total|value overflows numeric format"),
        _b("str_total", FAILED, "orders[0].total"),
        _b("bad_placed_at", FAILED, "orders[0].placed_at"),
        _b("huge_bytes", FAILED, "bytes_billed"),  # 2^63, one past bigint
        _b("negative_bytes", FAILED, "bytes_billed"),
        _b("float_bytes", FAILED, "bytes_billed"),
        _b("nan_bytes", FAILED, "bytes_billed"),
    )
}

BASE_EXCEPTIONS: tuple[type[BaseException], ...] = (
    PluginBaseError,
    KeyboardInterrupt,
    SystemExit,
    GeneratorExit,
)


@cache
def _table() -> dict[str, dict[str, Any]]:
    with open(os.environ["ENRICHQ_TEST_BEHAVIOURS"], encoding="utf-8") as f:
        table: dict[str, dict[str, Any]] = json.load(f)
    return table


def _record(line: str) -> None:
    folder = os.environ.get("ENRICHQ_TEST_CALLS")
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.calls"), "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _first(ticket_id: str, what: str) -> bool:
    """True the first time, across processes, that `ticket_id` does `what`."""
    path = os.path.join(os.environ["ENRICHQ_TEST_MARKERS"], f"{what}-{ticket_id.encode().hex()}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _hang(context: EnrichContext) -> None:
    """A warehouse query that runs well past the attempt's deadline (3 s), deaf to
    cancellation."""
    remaining = context.remaining_seconds()
    seconds = (remaining if remaining is not None else 1.0) + 3.0
    with context.warehouse.connect() as conn:
        conn.execute(sa.text("SELECT pg_sleep(:s)"), {"s": max(0.1, seconds)})


def _slow(context: EnrichContext) -> None:
    """The warehouse's own time: a query of ENRICHQ_TEST_SLOW_SECONDS (what the cap counts)."""
    seconds = float(os.environ.get("ENRICHQ_TEST_SLOW_SECONDS", "0"))
    if seconds > 0:
        with context.warehouse.connect() as conn:
            conn.execute(sa.text("SELECT pg_sleep(:s)"), {"s": seconds})


def _base(ticket_id: str) -> BaseException:
    kind = BASE_EXCEPTIONS[sum(ticket_id.encode()) % len(BASE_EXCEPTIONS)]
    return kind("base by behaviour")


# What each invalid result changes in a good one (orders, job id, bytes billed).
INVALID: dict[str, dict[str, Any]] = {
    "str_orders": {"orders": "O-1"},
    "str_order": {"orders": ("O-1",)},
    "int_order_id": {"orders": (Order(123),)},  # type: ignore[arg-type]  # bad on purpose
    "nul_order_id": {"orders": (Order("O-\x00"),)},
    "surrogate_order_id": {"orders": (Order("O-\udc80"),)},
    "surrogate_customer_id": {"orders": (Order("O-1", customer_id="C-\ud800"),)},
    "surrogate_job_id": {"job_id": "job-\udfff"},
    "long_order_id": {"orders": (Order("O" * 1001),)},
    "nan_total": {"orders": (Order("O-1", total=math.nan),)},
    "inf_total": {"orders": (Order("O-1", total=Decimal("Infinity")),)},
    "huge_total": {"orders": (Order("O-1", total=Decimal("1e200000")),)},
    "str_total": {"orders": (Order("O-1", total="12.5"),)},  # type: ignore[arg-type]  # as above
    "bad_placed_at": {"orders": (Order("O-1", placed_at="today"),)},  # type: ignore[arg-type]  # as above
    "huge_bytes": {"bytes_billed": BYTES_MAX + 1},
    "negative_bytes": {"bytes_billed": -1},
    "float_bytes": {"bytes_billed": 1.5},
    "nan_bytes": {"bytes_billed": math.nan},
}


def billed(outcome: object) -> int:
    """What an outcome bills as enrichq may charge it: a result's bytes if they are valid."""
    if not isinstance(outcome, Enrichment):
        return 0
    b = outcome.bytes_billed
    return b if isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= BYTES_MAX else 0


Act = Callable[[Ticket, Enrichment, EnrichContext], object]


def _printing(ticket: Ticket, good: Enrichment, context: EnrichContext) -> object:
    print("x" * 20_000, flush=True)
    print("y" * 20_000, file=sys.stderr, flush=True)
    return good


def _hanging(ticket: Ticket, good: Enrichment, context: EnrichContext) -> object:
    _hang(context)
    return good


def _exiting(ticket: Ticket, good: Enrichment, context: EnrichContext) -> object:
    os._exit(EXIT_CODE)


def _error(ticket: Ticket, good: Enrichment, context: EnrichContext) -> object:
    kinds = (ValueError("odd"), KeyError("gone"), OSError(5, "I/O error"))
    return kinds[len(ticket.id) % 3]


def _returns(value: object) -> Act:
    return lambda ticket, good, context: value


# What each behaviour that is not an invalid result does; a `*_once` one does it only the
# first time (and is good after).
ACTS: dict[str, Act] = {
    "good": _returns(None),
    "extra_answers": _returns(None),
    "batch_raise_once": _returns(None),
    "print": _printing,
    "hang_once": _hanging,
    "hang_always": _hanging,
    "transient_once": _returns(TransientError("transient once")),
    "transient_always": _returns(TransientError("transient by behaviour")),
    "error_once": _error,
    "base_once": lambda ticket, good, context: _base(ticket.id),
    "base_always": _returns(PluginBaseError("base by behaviour")),
    "nul_error_always": _returns(TransientError("said \x00 and\nmore")),
    "surrogate_error_always": _returns(TransientError("said \udc80 and more")),
    "defer_once": lambda ticket, good, context: Deferral(
        datetime.now(UTC) + timedelta(seconds=0.5), "once"
    ),
    "exit_once": _exiting,
    "exit_always": _exiting,
    "permanent": _returns(PermanentError("permanent by behaviour")),
    "none_result": _returns(None),
    "dict_result": _returns({"orders": [], "bytes_billed": 0}),
}


def _outcome(ticket: Ticket, found: Enrichment, context: EnrichContext) -> object:
    """One ticket's outcome by its behaviour, `found` being its warehouse result: a result
    (good or not) or an exception to raise or return; may also hang or exit."""
    row = _table().get(ticket.id, {"behaviour": "good", "bytes": 0})
    name = row["behaviour"]
    good = Enrichment(found.orders, job_id=f"job-{ticket.id}", bytes_billed=int(row["bytes"]))
    if name == "missing_always":
        return MISSING
    if name in INVALID:
        return Enrichment(**{"orders": (Order("O-bad"),), "job_id": "job-bad", **INVALID[name]})
    if name.endswith("_once") and name != "batch_raise_once" and not _first(ticket.id, name):
        return good
    value = ACTS[name](ticket, good, context)
    return good if value is None and name not in ("none_result",) else value


MISSING = object()  # a batch leaves the ticket out of its answer
UNASKED_BYTES = 5  # what each answer of extra_answers for a ticket not asked for bills


def per_ticket(ticket: Ticket, context: EnrichContext) -> Enrichment:
    """The per-ticket plug-in: the ticket's behaviour, around the built-in lookup."""
    _record(f"start {ticket.id}")
    _slow(context)
    outcome: object = None
    try:
        found = warehouse_lookup_batch([ticket], context)[ticket.id]
        assert isinstance(found, Enrichment)
        outcome = _outcome(ticket, found, context)
    finally:
        _record(f"end {ticket.id} {billed(outcome)}")
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome  # type: ignore[return-value]  # a bad result, on purpose


def batch(
    tickets: Sequence[Ticket], context: EnrichContext
) -> Mapping[str, Enrichment | BaseException]:
    """The batch plug-in: one built-in lookup for the batch, then each ticket's behaviour."""
    for t in tickets:
        _record(f"start {t.id}")
    outcomes: dict[str, Any] = {}
    surcharge: dict[str, int] = {}
    answered = False  # a call that raises returns nothing, whatever it had computed
    try:
        _slow(context)
        behaviours = {t.id: _table().get(t.id, {}).get("behaviour") for t in tickets}
        for t in tickets:
            if behaviours[t.id] == "batch_raise_once" and _first(t.id, "batch_raise_once"):
                raise ConnectionError("warehouse connection reset by behaviour")
        found = warehouse_lookup_batch(tickets, context)
        for t in tickets:
            value = found[t.id]
            assert isinstance(value, Enrichment)
            outcome = _outcome(t, value, context)
            if outcome is not MISSING:
                outcomes[t.id] = outcome
        if "extra_answers" in behaviours.values():
            # answers for tickets it was not asked about: one of the table's, and nonsense
            asked = set(behaviours)
            others = [k for k in _table() if k not in asked]
            wrong = Enrichment(
                (Order("O-NOT-ASKED"),), job_id="job-wrong", bytes_billed=UNASKED_BYTES
            )
            if others:
                outcomes[others[0]] = wrong
            outcomes["not-a-ticket-\udc80"] = wrong
            # what they billed is the batch's: equal shares, a byte more to the first
            extra = UNASKED_BYTES * (1 + bool(others))
            share, rest = divmod(extra, len(tickets))
            surcharge = {t.id: share + (i < rest) for i, t in enumerate(tickets)}
        answered = True
    finally:
        for t in tickets:
            got = billed(outcomes.get(t.id)) + surcharge.get(t.id, 0) if answered else 0
            _record(f"end {t.id} {got}")
    return outcomes
