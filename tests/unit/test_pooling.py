"""What the pool relies on from psycopg: the exception its bounded waits raise."""

from __future__ import annotations

from enrichq_schema.pooling import WAIT_TIMEOUT


def test_psycopg_still_names_its_wait_timeout() -> None:
    assert WAIT_TIMEOUT.__module__ == "psycopg.errors"
