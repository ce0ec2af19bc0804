"""Engines per pool mode (enrichq_schema.pooling): where the session settings land, what
is prepared, and what the pooler probe says about a direct connection."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from tests.support.settings import make_settings

from enrichq_schema import db
from enrichq_schema.db import CLIENT_CHECK_INTERVAL_MS, create_engine
from enrichq_schema.pooling import install, network_params, transaction_pooled
from enrichq_schema.states import PoolMode
from enrichq_service import queue
from enrichq_service.queue import EnqueueRequest

SETTINGS = {
    "statement_timeout_seconds": 7,
    "idle_in_transaction_timeout_seconds": 9,
    "asynchronous_commit": True,
    "generic_plans": True,
}
SHOW = (
    "SELECT current_setting('statement_timeout'), "
    "current_setting('idle_in_transaction_session_timeout'), "
    "current_setting('synchronous_commit'), current_setting('plan_cache_mode')"
)


def raw_show(conn: sa.Connection) -> tuple[str, ...]:
    """The settings as the server session has them, bypassing SQLAlchemy (and its events)."""
    driver = conn.connection.driver_connection
    assert driver is not None
    cursor = driver.execute(SHOW)
    row = cursor.fetchone()
    driver.rollback()
    assert row is not None
    return tuple(row)


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_every_transaction_runs_with_the_settings(db_url: str, mode: PoolMode) -> None:
    # generic plans need prepared statements: none behind a transaction pooler
    plans = "force_generic_plan" if mode is PoolMode.SESSION else "auto"
    eng = create_engine(db_url, pool_size=1, pool_mode=mode, **SETTINGS)  # type: ignore[arg-type]
    try:
        with eng.connect() as conn:
            for _ in range(3):
                with conn.begin():
                    assert tuple(conn.execute(sa.text(SHOW)).one()) == ("7s", "9s", "off", plans)
            with conn.begin(), conn.begin_nested():  # a savepoint first: set before it
                assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "7s"
            with conn.begin():  # no parameters: do_execute_no_params
                assert conn.exec_driver_sql("SHOW statement_timeout").scalar_one() == "7s"
            with conn.begin():  # every engine's: a statement whose process died ends
                check = conn.execute(sa.text("SHOW client_connection_check_interval"))
                assert check.scalar_one() == f"{CLIENT_CHECK_INTERVAL_MS}ms"
    finally:
        eng.dispose()


def test_transaction_mode_sets_nothing_on_the_session(db_url: str) -> None:
    """Behind a transaction pooler the session is someone else's once the transaction
    ends: the settings are transaction-local, and the session itself keeps the defaults."""
    eng = create_engine(db_url, pool_size=1, pool_mode=PoolMode.TRANSACTION, **SETTINGS)  # type: ignore[arg-type]
    try:
        with eng.connect() as conn:
            with conn.begin():
                assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "7s"
            assert raw_show(conn) == ("0", "0", "on", "auto")
    finally:
        eng.dispose()
    direct = create_engine(db_url, pool_size=1, pool_mode=PoolMode.SESSION, **SETTINGS)  # type: ignore[arg-type]
    try:
        with direct.connect() as conn:
            assert raw_show(conn) == ("7s", "9s", "off", "force_generic_plan")
    finally:
        direct.dispose()


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_a_parameter_the_server_does_not_know_is_left_out(db_url: str, mode: PoolMode) -> None:
    """client_connection_check_interval came with PostgreSQL 14: on an older server the
    session's other settings still apply and the connection still works (a parameter it
    does not know, here a made-up one, is left out instead of failing every session)."""
    eng = sa.create_engine(make_url(db_url).set(drivername="postgresql+psycopg"), pool_size=1)
    install(eng, mode, {"statement_timeout": "7000", "no_such_parameter": "1"})
    try:
        with eng.connect() as conn, conn.begin():
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "7s"
    finally:
        eng.dispose()


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_a_client_check_the_server_refuses_is_left_out(
    db_url: str, mode: PoolMode, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that knows client_connection_check_interval may still refuse a non-zero
    value (PostgreSQL 14+ on a platform without POLLRDHUP: macOS, the BSDs, Windows). The
    check is a safeguard, not a requirement: the sessions work without it, with the other
    settings, and the engine says once that it is off. Here the server refuses -1."""
    monkeypatch.setattr(db, "CLIENT_CHECK_INTERVAL_MS", -1)
    eng = create_engine(db_url, pool_size=2, pool_mode=mode, statement_timeout_seconds=7)
    try:
        with eng.connect() as a, eng.connect() as b:
            for conn in (a, b):
                with conn.begin():
                    assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "7s"
                    check = conn.execute(sa.text("SHOW client_connection_check_interval"))
                    assert check.scalar_one() == "0"
    finally:
        eng.dispose()
    refused = [r for r in caplog.records if "client_connection_check_interval" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in refused]
    assert refused[0].levelname == "WARNING"


def test_transaction_mode_says_an_autocommit_statement_runs_without_the_settings(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Behind a transaction pooler a setting lives for its transaction, and a statement in
    autocommit is a transaction of its own: it runs with the server's defaults (a plug-in's
    own warehouse query, say, without the deadline's statement timeout). The engine says so
    once instead of letting it pass for bounded."""
    eng = create_engine(
        db_url, pool_size=1, pool_mode=PoolMode.TRANSACTION, statement_timeout_seconds=7
    )
    try:
        # one statement a connection (a begin each), then several on one
        for statements in (1, 1, 3):
            with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                for _ in range(statements):
                    assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "0"
            if statements == 1:
                said = [r for r in caplog.records if "autocommit" in r.getMessage()]
                assert said, "the first statement of a connection went unmentioned"
        with eng.connect() as conn, conn.begin():
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "7s"
    finally:
        eng.dispose()
    said = [r for r in caplog.records if "autocommit" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert "statement_timeout" in said[0].getMessage()


def prepared(conn: sa.Connection) -> int:
    return int(conn.execute(sa.text("SELECT count(*) FROM pg_prepared_statements")).scalar_one())


@pytest.mark.parametrize(("mode", "expected"), [(PoolMode.SESSION, 1), (PoolMode.TRANSACTION, 0)])
def test_only_session_mode_prepares_the_marked_statements(
    db_url: str, mode: PoolMode, expected: int
) -> None:
    eng = create_engine(db_url, pool_size=1, pool_mode=mode)
    try:
        with eng.begin() as conn:
            queue.enqueue(
                conn,
                [EnqueueRequest.build(key=f"T-{i}") for i in range(10)],
                settings=make_settings(),
            )
        with eng.connect() as conn:
            for _ in range(7):  # past psycopg's own threshold of 5, too
                with conn.begin():
                    queue.claim(conn, kinds=("enrich",), owner="w", limit=1, lease_seconds=30)
            assert prepared(conn) == expected
            conn.rollback()
    finally:
        eng.dispose()


def test_many_rows_at_once_get_the_settings_too(db_url: str) -> None:
    eng = create_engine(
        db_url, pool_size=1, pool_mode=PoolMode.TRANSACTION, statement_timeout_seconds=5
    )
    try:
        with eng.begin() as conn:
            conn.execute(sa.text("CREATE TEMP TABLE t (x int)"))
        with eng.begin() as conn:  # executemany is the first statement of its transaction
            conn.execute(
                sa.text("UPDATE enrichq.queue SET priority = priority WHERE id = :i"),
                [{"i": 1}, {"i": 2}],
            )
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "5s"
    finally:
        eng.dispose()


def test_network_timeouts_become_libpq_options_the_url_may_override(db_url: str) -> None:
    assert network_params(10) == {
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": 10_000,
        "connect_timeout": 10,
    }
    # the URL may have a query already (the embedded server's socket, on a laptop run)
    with_option = make_url(db_url).update_query_dict({"keepalives_idle": "42"})
    eng = create_engine(
        with_option.render_as_string(hide_password=False),
        pool_size=1,
        network_timeout_seconds=10,
        statement_timeout_seconds=3,
    )
    try:
        with eng.connect() as conn:
            driver = conn.connection.driver_connection
            assert driver is not None
            params = driver.info.get_parameters()
            assert (params["keepalives_idle"], params["tcp_user_timeout"]) == ("42", "10000")
            assert driver.reply_timeout == 13
    finally:
        eng.dispose()


def test_a_direct_connection_is_not_taken_for_a_transaction_pooler(db_url: str) -> None:
    eng = create_engine(db_url, pool_size=2, isolation_level="AUTOCOMMIT")
    try:
        assert transaction_pooled(eng) is None
    finally:
        eng.dispose()
