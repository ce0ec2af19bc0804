"""How long a blackholed database connection hangs, with and without enrichq's network
timeouts (ENRICHQ_NETWORK_TIMEOUT_SECONDS); the figures of docs/reliability.md.

    python -m tests.chaos.blackhole [--cap 60]

Through the tests' TCP proxy (tests/support/tcpproxy.py), to the server of
ENRICHQ_TEST_DATABASE_URL (default: the local one): a statement on an open connection,
and a new connection, while nothing is forwarded. A call still waiting after `--cap`
seconds is released by healing the partition, and reported as "until healed".
`network timeout 0` is what enrichq did before the setting existed (libpq's defaults, and
psycopg's own 130 s limit on connecting).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from enrichq_schema.db import create_engine
from tests.support.tcpproxy import TcpProxy, target_of, via

STATEMENT_TIMEOUT_SECONDS = 30  # ENRICHQ_STATEMENT_TIMEOUT_SECONDS' default
CASES = [(0.0, STATEMENT_TIMEOUT_SECONDS), (10.0, STATEMENT_TIMEOUT_SECONDS), (2.0, 2.0)]


def measure(url: str, network: float, statement: float, cap: float, *, connect: bool) -> str:
    """Seconds until the blackholed call failed, or "≥ cap (until healed)"."""
    with TcpProxy(target_of(url)) as proxy:
        engine = create_engine(
            via(proxy, url),
            pool_size=1,
            statement_timeout_seconds=statement,
            network_timeout_seconds=network or None,
        )
        healer = threading.Timer(cap, proxy.heal)
        try:
            conn = None if connect else engine.connect()
            if conn is not None:
                conn.execute(sa.text("SELECT 1"))
                conn.commit()
            proxy.blackhole()
            healer.start()
            started = time.monotonic()
            try:
                if conn is None:
                    with engine.connect() as fresh:
                        fresh.execute(sa.text("SELECT 1"))
                else:
                    conn.execute(sa.text("SELECT 1"))
                    conn.commit()
            except sa_exc.DBAPIError:
                pass
            took = time.monotonic() - started
            healed = not proxy.blackholed
            if conn is not None:
                conn.close()
        finally:
            healer.cancel()
            proxy.heal()
            engine.dispose()
    return f"≥ {cap:g} s (until healed)" if healed else f"{took:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=60.0, help="heal after this long")
    args = parser.parse_args(argv)
    url = os.environ.get(
        "ENRICHQ_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    for line in table(url, args.cap):
        print(line, flush=True)
    return 0


def table(url: str, cap: float) -> list[str]:
    """The Markdown table of every case."""
    lines = [
        "| network timeout | statement timeout | a statement hangs | a new connection hangs |",
        "|---:|---:|---:|---:|",
    ]
    for network, statement in CASES:
        on_open = measure(url, network, statement, cap, connect=False)
        on_new = measure(url, network, statement, cap, connect=True)
        lines.append(f"| {network:g} s | {statement:g} s | {on_open} | {on_new} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
