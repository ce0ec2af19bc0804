"""What a plug-in returns is checked where it enters; a batch's bytes are shared out
exactly; a settle whose COMMIT reply was lost is read back to what it really did."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from decimal import Decimal

import pytest

from enrichq_schema.states import Outcome
from enrichq_service.enrich import (
    Enrichment,
    InvalidResult,
    Order,
    charge_of,
    error_text,
    load_enricher,
    split_bytes,
    validate,
)
from enrichq_service.errors import TransientError
from enrichq_service.queue import Job, Settle, SettleAction, committed

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_good_result_passes_with_its_numbers_and_times_normalized() -> None:
    naive = datetime(2026, 1, 1, 12, 0)
    result = validate(
        Enrichment(
            [
                Order("O-1", "C-1", naive, 12),
                Order("O-2", total=Decimal("1.50")),
                Order("O-3", total=2.5),
            ],
            job_id="job-1",
            bytes_billed=10,
        )
    )
    assert [o.total for o in result.orders] == [Decimal(12), Decimal("1.50"), Decimal("2.5")]
    assert result.orders[0].placed_at == naive.replace(tzinfo=UTC)
    assert isinstance(result.orders, tuple)


class BrokenZone(tzinfo):
    """A plug-in's own time zone whose offset no datetime accepts."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        return timedelta(hours=30)

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)

    def tzname(self, dt: datetime | None) -> str:
        return "broken"


BAD = [
    (Enrichment([Order("O-\x00")]), "orders[0].order_id: contains a NUL byte"),
    (Enrichment([Order("O-1"), Order("O-2", customer_id="C\x00")]), "orders[1].customer_id"),
    (Enrichment([Order("O-1")], job_id="j\x00"), "job_id: contains a NUL byte"),
    (Enrichment([Order("O-1", total="lots")]), "orders[0].total: expected a number, got str"),  # type: ignore[arg-type]  # the bad value under test
    (Enrichment([Order("O-1", total=float("nan"))]), "orders[0].total: must be a finite number"),
    (Enrichment([Order("O-1", total=True)]), "orders[0].total: expected a number"),
    # past what PostgreSQL's numeric holds (and an int too long for str())
    (Enrichment([Order("O-1", total=Decimal("1e131072"))]), "orders[0].total: out of the range"),
    (Enrichment([Order("O-1", total=Decimal("1e-16384"))]), "orders[0].total: out of the range"),
    (Enrichment([Order("O-1", total=10**131072)]), "orders[0].total: out of the range"),
    (Enrichment([Order(None)]), "orders[0].order_id: expected text, got NoneType"),  # type: ignore[arg-type]  # as above
    (Enrichment([Order("")]), "orders[0].order_id: must be 1 to"),
    (Enrichment([Order("x" * 1001)]), "orders[0].order_id: must be 1 to"),
    (Enrichment([{"order_id": "O-1"}]), "orders[0]: expected an Order, got dict"),  # type: ignore[list-item]  # as above
    (Enrichment("O-1"), "orders: expected a sequence of Order"),  # type: ignore[arg-type]  # as above
    (
        Enrichment([Order("O-1", placed_at="2026-01-01")]),  # type: ignore[arg-type]  # as above
        "orders[0].placed_at: expected a datetime",
    ),
    (Enrichment([], bytes_billed=-1), "bytes_billed: expected an integer"),
    (Enrichment([], bytes_billed=2**63), "bytes_billed: expected an integer"),
    # a bigint, but no warehouse's bill: it would overflow the day's ledger
    (Enrichment([], bytes_billed=2**63 - 1), "bytes_billed: expected an integer from 0 to 2^50"),
    (Enrichment([], bytes_billed=2**50 + 1), "bytes_billed: expected an integer from 0 to 2^50"),
    # lone surrogates, as bytes.decode("utf-8", "surrogateescape") makes them
    (Enrichment([Order("O-\udcff")]), "orders[0].order_id: contains a lone surrogate (U+DCFF)"),
    (Enrichment([Order("O-1", customer_id="\ud800")]), "orders[0].customer_id: contains a lone"),
    (Enrichment([Order("O-1")], job_id="j\udc80"), "job_id: contains a lone surrogate"),
    (
        Enrichment([Order("O-1", placed_at=datetime(2026, 1, 1, tzinfo=BrokenZone()))]),
        "orders[0].placed_at: its time zone gives no valid UTC offset",
    ),
    ({"orders": []}, "expected an Enrichment, got dict"),
    (None, "expected an Enrichment, got NoneType"),
]


@pytest.mark.parametrize(("result", "message"), BAD)
def test_a_bad_result_is_refused_naming_the_field(result: object, message: str) -> None:
    with pytest.raises(InvalidResult) as refused:
        validate(result)
    assert message in str(refused.value)
    assert "\x00" not in str(refused.value)


def test_the_largest_totals_postgres_holds_pass() -> None:
    totals: list[Decimal | float] = [
        Decimal("9e131071"),
        Decimal("1e-16383"),
        10**5000,
        Decimal(0),
        Decimal("-0E-20000"),
    ]
    result = validate(Enrichment([Order(f"O-{i}", total=t) for i, t in enumerate(totals)]))
    assert [o.total for o in result.orders] == [Decimal(t) for t in totals]
    assert str(result.orders[-1].total) == "0"  # 0E-20000 would overflow numeric


def test_the_largest_bill_passes_and_is_charged() -> None:
    assert validate(Enrichment([], bytes_billed=2**50)).bytes_billed == 2**50
    assert charge_of(Enrichment([], job_id="j", bytes_billed=2**50)) == ("j", 2**50)
    assert charge_of(Enrichment([], job_id="j\udcff", bytes_billed=2**63 - 1)) == (None, 0)


def test_an_error_text_escapes_lone_surrogates() -> None:
    text = error_text(TransientError(b"said \xff".decode("utf-8", "surrogateescape")))
    assert text == "TransientError: said \\udcff"
    text.encode("utf-8")  # storable


def test_an_error_text_survives_an_exception_whose_message_raises() -> None:
    class Odd(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    assert error_text(Odd()) == "Odd: (its message could not be read)"


def test_an_error_text_is_one_printable_bounded_line() -> None:
    text = error_text(ValueError("warehouse said \x00 and\nthen \x1b[2J more"))
    assert text == "ValueError: warehouse said \\x00 and"
    assert len(error_text(RuntimeError("x" * 10_000))) == 4000


@pytest.mark.parametrize(
    ("billed", "tickets", "shares"),
    [(0, 3, [0, 0, 0]), (10, 3, [4, 3, 3]), (11, 3, [4, 4, 3]), (9, 3, [3, 3, 3]), (5, 1, [5])],
)
def test_a_batch_bill_is_shared_out_exactly(billed: int, tickets: int, shares: list[int]) -> None:
    assert split_bytes(billed, tickets) == shares
    assert sum(split_bytes(billed, tickets)) == billed


# -- read back


@dataclass(frozen=True)
class Row:
    state: str
    claim_token: uuid.UUID
    attempts: int
    last_error: str | None = None
    dead_reason: str | None = None


def job(attempts: int = 2) -> Job:
    return Job(1, "enrich", "T-1", None, "manual", {}, attempts, 5, uuid.uuid4(), T0, T0)


@pytest.mark.parametrize(
    ("action", "row", "outcome"),
    [
        (SettleAction.COMPLETE, ("done", 2, None), Outcome.DONE),
        (SettleAction.FAIL, ("failed", 2, "bad"), Outcome.FAILED),
        (SettleAction.RETRY, ("queued", 2, "bad"), Outcome.RETRY),
        (SettleAction.RETRY, ("dead_letter", 2, "bad"), Outcome.DEAD_LETTER),
        (SettleAction.DEFER, ("queued", 1, None), Outcome.DEFERRED),
        # the sweeper recovered the expired lease instead: not this settle's doing
        (SettleAction.RETRY, ("queued", 2, "lease expired"), None),
        (SettleAction.DEFER, ("queued", 2, "lease expired"), None),
        (SettleAction.COMPLETE, ("queued", 2, "lease expired"), None),
        (SettleAction.COMPLETE, ("leased", 2, None), None),
    ],
)
def test_a_lost_commit_is_read_back_to_what_it_did(
    action: SettleAction, row: tuple[str, int, str | None], outcome: Outcome | None
) -> None:
    j = job()
    error = "bad" if action in (SettleAction.RETRY, SettleAction.FAIL) else None
    state, attempts, last_error = row
    found = Row(state, j.claim_token, attempts, last_error)
    assert committed(Settle(j, action, error=error), found) is outcome


def test_a_row_claimed_again_since_was_not_settled_by_this_claim() -> None:
    j = job()
    assert committed(Settle(j, SettleAction.COMPLETE), Row("done", uuid.uuid4(), 2)) is None
    assert committed(Settle(j, SettleAction.COMPLETE), None) is None


def test_enricher_plug_in_path_errors_are_settings_errors() -> None:
    from enrichq_schema.errors import SettingsError

    with pytest.raises(SettingsError, match="ENRICHQ_ENRICHER"):
        load_enricher("tests.support.enrichers:nope")
    with pytest.raises(SettingsError, match="ENRICHQ_ENRICHER"):
        load_enricher("no.such.module:fn")
