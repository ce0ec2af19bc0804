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


def run_serve(settings: Settings, url: str, *, wait_for_schema: bool = True) -> int:
    """Serve HTTP on ENRICHQ_HTTP_PORT and work the queue until SIGTERM/SIGINT.

    Before `enrichq migrate` has run, the worker waits for the schema (saying so; /readyz
    says why) unless told not to (exit 2). A worker that stops on an error leaves ingest
    running: events keep being accepted, /readyz says the worker stopped, the error is
    logged and counted (enrichq_worker_errors_total{thread="serve"})."""
    from enrichq_schema import metrics
    from enrichq_schema.db import await_schema
    from enrichq_schema.process import stop_on_signals
    from enrichq_service.http import bind_socket, create_app, start_server_thread
    from enrichq_service.worker import worker_process

    # the port first: a port in use is a one-line error before any connection is made
    sock = bind_socket(settings.http_host, settings.http_port)
    try:
        # a pool mode the URL contradicts, or no mirror table: exit 2 in one line
        connections.preflight(settings, url, mirror=True)
    except sa_exc.OperationalError as exc:
        # serve starts anyway: /readyz says the database is unavailable until it is back
        log.warning("database unavailable at start-up: %s", describe_database_error(exc))
    with worker_process(settings, url) as (worker, engines):
        engine = engines.queue
        stopped: list[str] = []  # why the worker stopped while ingest goes on

        def health() -> str | None:
            # a worker that stopped for good is no reason to restart the process: ingest
            # works, and a restart would refuse the help desk's events meanwhile
            return None if stopped else worker.health()

        app = create_app(
            settings,
            engine,
            health=health,
            degraded=lambda: stopped[0] if stopped else None,
        )
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
                if not await_schema(engine, wait=wait_for_schema, stop=worker.stop, what="serve"):
                    return 0
                result = worker.run()
                if result.stop_reason is StopReason.ERROR and not worker.stop.is_set():
                    stopped.append(f"the worker stopped on an error: {result.error}")
                    metrics.worker_errors_total.labels("serve").inc()
                    log.error(
                        "serve: its worker stopped on an error: %s; ingest goes on (/readyz "
                        "says so) until serve is stopped and restarted",
                        result.error,
                    )
                    worker.stop.wait()
        finally:
            server.stop()
    return 0
