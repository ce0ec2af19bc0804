"""`enrichq serve`: HTTP ingest, health and /metrics, and a worker, in one process."""

from __future__ import annotations

import logging
import threading

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from enrichq_schema import connections
from enrichq_schema.errors import describe_database_error
from enrichq_schema.settings import Settings
from enrichq_schema.states import StopReason

log = logging.getLogger(__name__)
PARITY_EXPORT_SECONDS = 60.0


def export_parity_gauges(engine: sa.Engine, stop: threading.Event) -> None:
    """Keep the enrichq_parity_* gauges at the latest parity run until `stop` is set."""
    from enrichq_parity.parity import export_latest

    while True:
        try:
            with engine.connect() as conn:
                export_latest(conn)
        except sa_exc.DBAPIError as exc:
            log.debug("parity gauges not refreshed: %s", exc)
        if stop.wait(PARITY_EXPORT_SECONDS):
            return


def run_serve(settings: Settings, url: str) -> int:
    """Serve HTTP on ENRICHQ_HTTP_PORT and work the queue until SIGTERM/SIGINT."""
    from enrichq_schema.process import stop_on_signals
    from enrichq_service.http import bind_socket, create_app, start_server_thread
    from enrichq_service.worker import worker_process

    # the port first: a port in use is a one-line error before any connection is made
    sock = bind_socket(settings.http_host, settings.http_port)
    try:
        connections.preflight(settings, url)
    except sa_exc.OperationalError as exc:
        # serve starts anyway: /readyz says the database is unavailable until it is back
        log.warning("database unavailable at start-up: %s", describe_database_error(exc))
    with worker_process(settings, url) as (worker, engines):
        engine = engines.queue
        app = create_app(settings, engine, health=worker.health)
        server = start_server_thread(
            app, host=settings.http_host, port=settings.http_port, sock=sock
        )
        log.info("serving HTTP on %s", server.url)
        exporter = threading.Thread(
            target=export_parity_gauges, args=(engine, worker.stop), daemon=True
        )
        exporter.start()
        try:
            with stop_on_signals(worker.stop):
                result = worker.run()
        finally:
            server.stop()
    if result.stop_reason is StopReason.ERROR:
        log.error("serve stopped: its worker stopped on an error: %s", result.error)
        return 1
    return 0
