"""ENRICHQ_NETWORK_TIMEOUT_SECONDS on real connections through the tests' TCP proxy: a
blackholed connection (no FIN, no RST, nothing forwarded) fails while the partition lasts
instead of hanging until it heals, and a new connection gives up as well."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from tests.support.tcpproxy import TcpProxy, target_of, via

from enrichq_schema.db import create_engine
from enrichq_schema.pooling import NoReply

# Heal this long after the blackhole at the latest: far past every bound below, so a call
# still waiting then was not bounded at all.
HEAL_AFTER_SECONDS = 30.0


@pytest.fixture
def proxy(db_url: str) -> Iterator[TcpProxy]:
    with TcpProxy(target_of(db_url)) as p:
        yield p


def through(proxy: TcpProxy, db_url: str) -> str:
    return via(proxy, db_url)


def run_blackholed(
    engine: sa.Engine, proxy: TcpProxy, heal_after: float = HEAL_AFTER_SECONDS
) -> tuple[BaseException | None, bool]:
    """Run a statement on an open connection while the proxy is blackholed (healed after
    `heal_after` seconds); what it raised, and whether the partition still lasted then."""
    healer = threading.Timer(heal_after, proxy.heal)
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
        conn.commit()
        proxy.blackhole()
        healer.start()
        try:
            conn.execute(sa.text("SELECT 1"))
        except sa_exc.DBAPIError as exc:
            return exc, proxy.blackholed
        finally:
            still = proxy.blackholed
            if conn.in_transaction():
                with contextlib.suppress(sa_exc.DBAPIError):
                    conn.rollback()
            healer.cancel()
            proxy.heal()
    return None, still


def test_a_blackholed_statement_fails_while_the_partition_lasts(
    proxy: TcpProxy, db_url: str
) -> None:
    engine = create_engine(
        through(proxy, db_url),
        pool_size=1,
        statement_timeout_seconds=1,
        network_timeout_seconds=1,
    )
    try:
        raised, during = run_blackholed(engine, proxy)
        assert isinstance(raised, sa_exc.OperationalError)
        assert isinstance(raised.orig, NoReply)
        assert raised.connection_invalidated  # the pool drops it
        assert during
        with engine.connect() as conn:  # healed: a fresh connection works
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()


def test_without_a_network_timeout_it_hangs_until_the_partition_heals(
    proxy: TcpProxy, db_url: str
) -> None:
    """What enrichq did before ENRICHQ_NETWORK_TIMEOUT_SECONDS (and does with it at 0)."""
    engine = create_engine(through(proxy, db_url), pool_size=1, statement_timeout_seconds=1)
    try:
        raised, during = run_blackholed(engine, proxy, heal_after=3.0)
        assert raised is None  # it waited, then got its answer
        assert not during
    finally:
        engine.dispose()


def test_connecting_through_a_blackholed_network_gives_up(proxy: TcpProxy, db_url: str) -> None:
    engine = create_engine(through(proxy, db_url), pool_size=1, network_timeout_seconds=2)
    proxy.blackhole()
    healer = threading.Timer(HEAL_AFTER_SECONDS, proxy.heal)
    healer.start()
    try:
        with pytest.raises(sa_exc.OperationalError, match="timeout"), engine.connect():
            pass
        assert proxy.blackholed
    finally:
        healer.cancel()
        proxy.heal()
        engine.dispose()
