"""Prometheus metrics of every enrichq process (prefix ``enrichq_``, DESIGN §6).

Counters and histograms are updated where things happen; the queue and database gauges
are read from Postgres by a collector at scrape time and cached for a few seconds, so a
scrape storm cannot load the database.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Info

JOB_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)

build_info = Info("enrichq_build", "Version of the running enrichq.")

# -- queue operations (worker side)
claims_total = Counter("enrichq_claims_total", "Rows claimed.", ["kind"])
claim_batch_size = Histogram(
    "enrichq_claim_batch_size", "Rows returned by one claim.", ["kind"], buckets=BATCH_BUCKETS
)
job_duration_seconds = Histogram(
    "enrichq_job_duration_seconds",
    "Time from claim to settle of one job.",
    ["kind", "outcome"],
    buckets=JOB_DURATION_BUCKETS,
)
job_outcomes_total = Counter(
    "enrichq_job_outcomes_total",
    "Claimed jobs by what became of them (done/retry/failed/dead_letter/deferred/lost).",
    ["kind", "outcome"],
)
fenced_writes_refused_total = Counter(
    "enrichq_fenced_writes_refused_total",
    "Writes refused because the lease was no longer held (operation: complete/retry/...).",
    ["operation"],
)
heartbeat_failures_total = Counter(
    "enrichq_heartbeat_failures_total", "Heartbeats that failed to reach the database."
)
heartbeat_lost_leases_total = Counter(
    "enrichq_heartbeat_lost_leases_total", "Leases a heartbeat found no longer held."
)
heartbeat_lag_seconds = Gauge(
    "enrichq_heartbeat_lag_seconds", "Seconds since this worker's last successful heartbeat."
)
jobs_in_flight = Gauge("enrichq_jobs_in_flight", "Jobs this process is working on now.")
oldest_unsettled_seconds = Gauge(
    "enrichq_oldest_unsettled_seconds",
    "Seconds the oldest finished job of this worker has waited to be settled (0 = none).",
)
worker_errors_total = Counter(
    "enrichq_worker_errors_total",
    "Errors a part of the worker runtime could not handle (the worker then stops), by thread.",
    ["thread"],
)

# -- enrichment
lookups_total = Counter("enrichq_lookups_total", "Warehouse lookups by status.", ["status"])
batch_unasked_answers_total = Counter(
    "enrichq_batch_unasked_answers_total",
    "Answers a batch enricher gave under ticket ids it was not asked for (dropped; their"
    " bytes billed are charged to the batch's tickets).",
)
warehouse_bytes_billed_total = Counter(
    "enrichq_warehouse_bytes_billed_total", "Bytes billed by the warehouse for lookups."
)
budget_exhausted = Gauge(
    "enrichq_budget_exhausted", "1 while today's warehouse bytes budget is spent."
)
warehouse_slot_waits_total = Counter(
    "enrichq_warehouse_slot_waits_total",
    "Lookups that waited for a slot under ENRICHQ_WAREHOUSE_MAX_CONCURRENCY (or an estimate).",
)
warehouse_deferrals_total = Counter(
    "enrichq_warehouse_deferrals_total",
    "Lookups refused admission, their jobs deferred, by reason (budget, cap, estimate).",
    ["reason"],
)

# -- ingest
events_total = Counter("enrichq_events_total", "Events received over HTTP by result.", ["result"])
http_connections_closed_total = Counter(
    "enrichq_http_connections_closed_total",
    "HTTP connections serve closed on the client: too slow to send its request's head or"
    " body, one too many (ENRICHQ_HTTP_MAX_CONNECTIONS), or a request with both"
    " Content-Length and Transfer-Encoding.",
    ["reason"],
)
enqueued_total = Counter(
    "enrichq_enqueued_total", "Enqueue requests by result (inserted/merged).", ["kind", "result"]
)

# -- sweeper
sweeper_promoted_total = Counter(
    "enrichq_sweeper_promoted_total", "Expired leases put back in the queue."
)
sweeper_dead_letters_total = Counter(
    "enrichq_sweeper_dead_letters_total", "Rows the sweeper dead-lettered, by reason.", ["reason"]
)
sweeper_lease_expiries_total = Counter(
    "enrichq_sweeper_lease_expiries_total", "Expired leases the sweeper recovered (any outcome)."
)
sweeper_pruned_total = Counter(
    "enrichq_sweeper_pruned_total", "Terminal rows deleted by retention, by state.", ["state"]
)
sweeper_refresh_enqueued_total = Counter(
    "enrichq_sweeper_refresh_enqueued_total", "Refresh rows enqueued by the sweeper."
)
reconciled_total = Counter(
    "enrichq_reconciled_total",
    "Tickets the reconcile pass enqueued: changed in the mirror with no event for the change"
    " (events lost upstream), by tenant ('' = none).",
    ["tenant"],
)
sweeper_last_pass_timestamp_seconds = Gauge(
    "enrichq_sweeper_last_pass_timestamp_seconds",
    "Unix time of the last finished pass, by task.",
    ["task"],
)
sweeper_is_leader = Gauge("enrichq_sweeper_is_leader", "1 while this sweeper holds the lock.")

# -- parity (the latest run, as read from enrichq.parity_runs)
parity_order_coverage = Gauge(
    "enrichq_parity_order_coverage", "Order coverage of the latest parity run (0..1)."
)
parity_ticket_match_rate = Gauge(
    "enrichq_parity_ticket_match_rate", "Ticket match rate of the latest parity run (0..1)."
)
parity_pass = Gauge("enrichq_parity_pass", "1 if the latest parity run passed, else 0.")
parity_last_run_timestamp_seconds = Gauge(
    "enrichq_parity_last_run_timestamp_seconds", "Unix time the latest parity run finished."
)

observe_errors_total = Counter(
    "enrichq_observe_errors_total",
    "Scrape-time reads of the database gauges that failed (the scrape then has none).",
)

# Gauges read from the database at scrape time (see enrichq_service.observe):
#   enrichq_queue_rows{kind,state} (terminal states as of the sweeper's last count)
#   enrichq_queue_dead_letters{kind,reason}, enrichq_queue_counted_timestamp_seconds
#   enrichq_queue_oldest_visible_age_seconds{kind}
#   enrichq_queue_live_leases, enrichq_queue_expired_leases
#   enrichq_queue_dead_tuples, enrichq_queue_last_autovacuum_timestamp_seconds
#   enrichq_oldest_transaction_age_seconds
#   enrichq_budget_bytes_billed_today


def start_counters_at_zero(kinds: tuple[str, ...]) -> None:
    """Create every labelled counter a worker can bump, at 0, so `increase()` sees the first."""
    from enrichq_schema.states import Outcome

    for kind in kinds:
        for outcome in Outcome:
            job_outcomes_total.labels(kind, outcome.value)
        claims_total.labels(kind)
    for operation in ("complete", "retry", "fail", "defer"):
        fenced_writes_refused_total.labels(operation)
    for status in ("ok", "empty", "not_found", "error", "deferred"):
        lookups_total.labels(status)
    for reason in ("budget", "cap", "estimate"):
        warehouse_deferrals_total.labels(reason)
    for thread in ("claims", "runner", "settler", "heartbeat", "listener"):
        worker_errors_total.labels(thread)


def metrics_port_problem(port: int, exc: OSError) -> str:
    """One line saying why /metrics cannot be served on `port`, and what to set instead."""
    return (
        f"cannot serve /metrics on port {port}: {exc.strerror or exc}; set "
        "ENRICHQ_METRICS_PORT to a free port, or 0 for none (several workers on one machine: "
        "a port each, or 0)"
    )
