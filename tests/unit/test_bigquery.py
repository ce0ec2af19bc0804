"""The BigQuery lookup's pure parts: the statement as BigQuery SQL with named parameters,
the mapping of BigQuery's errors, when its quotas reset (issue 30)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from google.api_core import exceptions as api
from sqlalchemy_bigquery import BigQueryDialect

from enrichq_service.bigquery import DATA_REASONS, compiled, mapped, quota_reset
from enrichq_service.enrich import _asked, _statement
from enrichq_service.errors import Deferral, PermanentError, TransientError

# as an engine makes it: BigQuery's DB-API writes parameters in pyformat
DIALECT = BigQueryDialect(paramstyle="pyformat")


def test_the_lookup_statement_becomes_bigquery_sql_with_named_parameters() -> None:
    stmt = _statement(
        "enrich_warehouse_orders_batch",
        asked=_asked(3),
        customers="`d`.`customers`",
        orders="`d`.`orders`",
    )
    sql, params = compiled(DIALECT, stmt, {"asked_0": "a@x", "asked_1": "B@x", "asked_2": "c"})
    assert "%(" not in sql
    assert ":asked" not in sql
    assert [f"@asked_{i}" in sql for i in range(3)] == [True, True, True]
    assert [(p.name, p.type_, p.value) for p in params] == [
        ("asked_0", "STRING", "a@x"),
        ("asked_1", "STRING", "B@x"),
        ("asked_2", "STRING", "c"),
    ]


def test_an_untyped_placeholder_is_named_too() -> None:
    sql, params = compiled(DIALECT, sa.text("SELECT :n AS n, :s AS s"), {"n": 3, "s": "x"})
    assert sql == "SELECT @n AS n, @s AS s"
    assert [(p.name, p.type_) for p in params] == [("n", "INT64"), ("s", "STRING")]


def _error(cls: type[api.GoogleAPICallError], reason: str) -> api.GoogleAPICallError:
    return cls(
        "boom\nLocation: US\nJob ID: x", errors=[{"reason": reason, "message": "it broke\nmore"}]
    )


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (_error(api.Forbidden, "rateLimitExceeded"), TransientError),
        (_error(api.InternalServerError, "backendError"), TransientError),
        (_error(api.ServiceUnavailable, "whatever"), TransientError),
        (_error(api.Forbidden, "quotaExceeded"), Deferral),
        (_error(api.BadRequest, "invalidQuery"), PermanentError),
        (_error(api.NotFound, "notFound"), PermanentError),
        (_error(api.Forbidden, "accessDenied"), PermanentError),
        (_error(api.BadRequest, "bytesBilledLimitExceeded"), PermanentError),
        (TimeoutError(), TransientError),
    ],
)
def test_errors_are_mapped_in_one_line(error: BaseException, outcome: type[Exception]) -> None:
    got = mapped(error, max_bytes=10)
    assert isinstance(got, outcome)
    assert "\n" not in str(got)
    if outcome is TransientError:
        assert not isinstance(got, PermanentError | Deferral)


def test_quotas_reset_at_midnight_pacific_time() -> None:
    # 07:59 UTC on 5 Dec is 23:59 the day before in Los Angeles (PST, UTC-8)
    assert quota_reset(datetime(2026, 12, 5, 7, 59, tzinfo=UTC)) == datetime(
        2026, 12, 5, 8, 0, tzinfo=UTC
    )
    # in summer (PDT, UTC-7)
    assert quota_reset(datetime(2026, 7, 1, 12, 0, tzinfo=UTC)) == datetime(
        2026, 7, 2, 7, 0, tzinfo=UTC
    )


def test_only_an_invalid_query_may_be_the_data() -> None:
    assert {"invalidQuery"} == DATA_REASONS
