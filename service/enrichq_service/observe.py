"""Scrape-time database gauges: queue depth, leases, vacuum, budget, read from Postgres when
Prometheus scrapes (``sql/observe.sql``) and cached for a few seconds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version

import sqlalchemy as sa
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from enrichq_schema import metrics
from enrichq_schema.errors import SettingsError
from enrichq_schema.metrics import metrics_port_problem
from enrichq_schema.queries import load
from enrichq_schema.states import DeadReason, Kind, State
from enrichq_service.controls import pauses as pause_controls

log = logging.getLogger(__name__)

SQL = load("enrichq_service", "sql/observe.sql")
CACHE_SECONDS_DEFAULT = 5.0
# A scrape must answer quickly even when the database is slow; Prometheus times out at 10 s.
STATEMENT_TIMEOUT = "2s"
ROW_STATES = tuple(s.value for s in State)
OPEN_STATES = (State.QUEUED.value, State.LEASED.value)


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """What one read of the database says; the source of every database gauge."""

    rows: Mapping[tuple[str, str], int] = field(default_factory=dict)
    dead_letters: Mapping[tuple[str, str], int] = field(default_factory=dict)
    oldest_visible_age_seconds: Mapping[str, float] = field(default_factory=dict)
    live_leases: int = 0
    expired_leases: int = 0
    dead_tuples: int | None = None
    last_autovacuum_timestamp_seconds: float = 0.0
    oldest_transaction_age_seconds: float = 0.0
    budget_bytes_billed_today: int = 0
    counted_at: float = 0.0  # unix time of the terminal counts (0 = never counted)
    # (kind, tenant) of each pause in place ('*' = all) → unix time it began
    pauses: Mapping[tuple[str, str], float] = field(default_factory=dict)


def read_snapshot(conn: sa.Connection, *, now: datetime | None = None) -> QueueSnapshot:
    """Run the observe queries on `conn` (the caller owns the transaction)."""
    kinds = {k.value for k in Kind}
    rows: dict[tuple[str, str], int] = {}
    for kind, state, n in conn.execute(SQL("observe_open_counts")):
        rows[(kind, state)] = int(n)
        kinds.add(kind)
    dead: dict[tuple[str, str], int] = {}
    counted_at = 0.0
    for r in conn.execute(SQL("observe_counted")):
        rows[(r.kind, r.state)] = rows.get((r.kind, r.state), 0) + int(r.rows)
        if r.state == State.DEAD_LETTER:
            dead[(r.kind, r.dead_reason)] = int(r.rows)
        counted_at = max(counted_at, float(r.counted_at))
        kinds.add(r.kind)
    oldest: dict[str, float] = {}
    for kind, age in conn.execute(SQL("observe_oldest_visible"), {"now": now}):
        oldest[kind] = max(0.0, float(age))
        kinds.add(kind)
    # Zero-fill every kind the service knows, so absent series never hide a problem; the
    # terminal states only once a sweeper has counted them (before that a 0 would claim a
    # count nobody made: enrichq_queue_counted_timestamp_seconds is 0 then).
    counted = counted_at > 0
    for kind in kinds:
        for state in ROW_STATES if counted else OPEN_STATES:
            rows.setdefault((kind, state), 0)
        if counted:
            for reason in DeadReason:
                dead.setdefault((kind, reason.value), 0)
        oldest.setdefault(kind, 0.0)
    leases = conn.execute(SQL("observe_leases"), {"now": now}).one()
    vacuum = conn.execute(SQL("observe_vacuum")).one_or_none()
    oldest_tx = conn.execute(SQL("observe_oldest_transaction")).scalar_one()
    budget = conn.execute(SQL("observe_budget_today"), {"now": now}).scalar_one()
    pauses = {
        (p.scope.kind or "*", p.scope.tenant or "*"): p.paused_at.timestamp()
        for p in pause_controls.in_place(conn, now=now)
    }
    return QueueSnapshot(
        rows=rows,
        dead_letters=dead,
        oldest_visible_age_seconds=oldest,
        live_leases=int(leases.live),
        expired_leases=int(leases.expired),
        dead_tuples=None if vacuum is None else int(vacuum.dead_tuples),
        last_autovacuum_timestamp_seconds=(
            float(vacuum.last_vacuum_epoch)
            if vacuum is not None and vacuum.last_vacuum_epoch is not None
            else 0.0
        ),
        oldest_transaction_age_seconds=float(oldest_tx),
        budget_bytes_billed_today=int(budget),
        counted_at=counted_at,
        pauses=pauses,
    )


def _labelled(
    name: str,
    documentation: str,
    labels: list[str],
    values: Iterable[tuple[tuple[str, ...], float]],
) -> GaugeMetricFamily:
    """A gauge family with one sample per (label values, value) of `values`, in label order."""
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for label_values, value in sorted(values):
        family.add_metric(list(label_values), value)
    return family


def families(snapshot: QueueSnapshot) -> list[Metric]:
    """The Prometheus metric families of a snapshot."""
    rows = _labelled(
        "enrichq_queue_rows",
        "Queue rows by kind and state (open rows live; done, failed and dead_letter as of "
        "the sweeper's last count).",
        ["kind", "state"],
        snapshot.rows.items(),
    )
    dead = _labelled(
        "enrichq_queue_dead_letters",
        "Dead-letter rows by kind and reason.",
        ["kind", "reason"],
        snapshot.dead_letters.items(),
    )
    oldest = _labelled(
        "enrichq_queue_oldest_visible_age_seconds",
        "Seconds since the oldest visible queued row became visible (0 when none).",
        ["kind"],
        (((kind,), age) for kind, age in snapshot.oldest_visible_age_seconds.items()),
    )
    out: list[Metric] = [
        rows,
        dead,
        oldest,
        GaugeMetricFamily(
            "enrichq_queue_live_leases", "Leased rows whose lease is live.", snapshot.live_leases
        ),
        GaugeMetricFamily(
            "enrichq_queue_expired_leases",
            "Leased rows whose lease expired (awaiting the sweeper).",
            snapshot.expired_leases,
        ),
        GaugeMetricFamily(
            "enrichq_queue_last_autovacuum_timestamp_seconds",
            "Unix time of the last (auto)vacuum of the queue table (0 = never).",
            snapshot.last_autovacuum_timestamp_seconds,
        ),
        GaugeMetricFamily(
            "enrichq_oldest_transaction_age_seconds",
            "Age of the oldest transaction holding back the vacuum horizon in this database.",
            snapshot.oldest_transaction_age_seconds,
        ),
        GaugeMetricFamily(
            "enrichq_queue_counted_timestamp_seconds",
            "Unix time of the sweeper's last count of done, failed and dead-letter rows "
            "(0 = never).",
            snapshot.counted_at,
        ),
        GaugeMetricFamily(
            "enrichq_budget_bytes_billed_today",
            "Warehouse bytes billed on the current UTC day.",
            snapshot.budget_bytes_billed_today,
        ),
    ]
    paused = GaugeMetricFamily(
        "enrichq_paused",
        "1 for each pause in place (`enrichq pause`); '*' means every kind or every tenant.",
        labels=["kind", "tenant"],
    )
    paused_since = GaugeMetricFamily(
        "enrichq_paused_since_timestamp_seconds",
        "Unix time each pause in place began.",
        labels=["kind", "tenant"],
    )
    for (kind, tenant), since in sorted(snapshot.pauses.items()):
        paused.add_metric([kind, tenant], 1)
        paused_since.add_metric([kind, tenant], since)
    out += [paused, paused_since]
    if snapshot.dead_tuples is not None:
        out.append(
            GaugeMetricFamily(
                "enrichq_queue_dead_tuples",
                "Dead tuples in the queue table (pg_stat_user_tables.n_dead_tup).",
                snapshot.dead_tuples,
            )
        )
    return out


class QueueCollector(Collector):
    """Yields the database gauges, read at most once per `cache_seconds` (errors included)."""

    def __init__(
        self,
        engine: sa.Engine,
        cache_seconds: float = CACHE_SECONDS_DEFAULT,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self.cache_seconds = cache_seconds
        self._clock = clock
        # Held while reading, so concurrent scrapes wait for one read instead of each reading.
        self._lock = threading.Lock()
        self._cached: QueueSnapshot | None = None
        self._expires_at = float("-inf")

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def bind(self, engine: sa.Engine, cache_seconds: float | None = None) -> None:
        """Read from `engine` from now on (and forget what was cached)."""
        with self._lock:
            self._engine = engine
            if cache_seconds is not None:
                self.cache_seconds = cache_seconds
            self._cached = None
            self._expires_at = float("-inf")

    def describe(self) -> list[Metric]:
        """The family names without reading the database (used at registration)."""
        return families(QueueSnapshot(dead_tuples=0))

    def collect(self) -> Iterator[Metric]:
        """The gauges of a fresh or cached snapshot; nothing when the database failed."""
        snapshot = self.snapshot()
        if snapshot is not None:
            yield from families(snapshot)

    def snapshot(self) -> QueueSnapshot | None:
        """The cached snapshot, read again when older than `cache_seconds`; None on error."""
        with self._lock:
            now = self._clock()
            if now < self._expires_at:
                return self._cached
            try:
                with self._engine.connect() as conn, conn.begin() as tx:
                    conn.execute(SQL("observe_statement_timeout"), {"timeout": STATEMENT_TIMEOUT})
                    snapshot: QueueSnapshot | None = read_snapshot(conn)
                    tx.rollback()
            except Exception as exc:
                # A scrape must never fail on the database: count it, log it, yield no gauges.
                metrics.observe_errors_total.inc()
                log.warning(
                    "reading the queue gauges failed: %s: %s",
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                )
                snapshot = None
            # A failure is cached too: a storm of scrapes must not hammer a database in trouble.
            self._cached = snapshot
            self._expires_at = self._clock() + self.cache_seconds
            return snapshot


_registered: QueueCollector | None = None
_register_lock = threading.Lock()


def register_queue_collector(
    engine: sa.Engine,
    *,
    cache_seconds: float = CACHE_SECONDS_DEFAULT,
    registry: CollectorRegistry = REGISTRY,
) -> QueueCollector:
    """Register the process's one queue collector (a later call points it at `engine`)."""
    global _registered  # noqa: PLW0603 -- one collector per process registry, by design
    with _register_lock:
        if registry is REGISTRY and _registered is not None:
            _registered.bind(engine, cache_seconds)
            return _registered
        collector = QueueCollector(engine, cache_seconds)
        registry.register(collector)
        if registry is REGISTRY:
            _registered = collector
        return collector


def set_build_info(mode: str = "shadow") -> str:
    """Fill ``enrichq_build_info`` with the package version and the mode; the version."""
    try:
        ver = version("enrichq")
    except PackageNotFoundError:
        ver = "unknown"
    metrics.build_info.info({"version": ver, "mode": mode})
    return ver


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running /metrics endpoint of a process without the HTTP server."""

    port: int
    _stop: Callable[[], None]

    def stop(self) -> None:
        """Stop serving and release the port."""
        self._stop()


def start_metrics_server(
    port: int,
    *,
    addr: str = "0.0.0.0",  # noqa: S104 -- Prometheus scrapes the process from outside its container
    registry: CollectorRegistry = REGISTRY,
) -> MetricsServer | None:
    """Serve /metrics on `port` in a daemon thread; port 0 means disabled (None). A port
    that cannot be bound (another process on this machine has it) is a SettingsError."""
    if port == 0:
        return None
    try:
        httpd, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise SettingsError(metrics_port_problem(port, exc)) from None

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    return MetricsServer(port=httpd.server_port, _stop=stop)
