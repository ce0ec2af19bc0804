"""Table metadata: the single source of truth for the schema; migrations are generated from it."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as pg

from enrichq_schema.states import (
    EVENT_ID_MAX_LENGTH,
    KEY_MAX_LENGTH,
    LOOKUP_STATUSES,
    AuditCommand,
    Component,
    DeadReason,
    Kind,
    Plan,
    Reason,
    State,
    StopReason,
)

SCHEMA = "enrichq"
PUBLIC_SCHEMA = "enrichq_public"

metadata = sa.MetaData(
    schema=SCHEMA,
    naming_convention={
        "ix": "%(table_name)s_%(column_0_N_name)s_idx",
        "uq": "%(table_name)s_%(column_0_N_name)s_key",
        "ck": "%(table_name)s_%(constraint_name)s",
        "fk": "%(table_name)s_%(column_0_name)s_fkey",
        "pk": "%(table_name)s_pkey",
    },
)


def _one_of(column: str, values: object) -> str:
    """SQL `column IN (...)` over an enum's values, for CHECK constraints."""
    items = ", ".join(f"'{v}'" for v in values)  # type: ignore[attr-defined]  # an enum class, typed object
    return f"{column} IN ({items})"


def _now() -> sa.TextClause:
    return sa.text("now()")


def _at(name: str, *, nullable: bool = False, **options: Any) -> sa.Column[object]:
    """A point in time (timestamptz: every time enrichq keeps is the database's, zoned)."""
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable, **options)


def _created_at() -> sa.Column[object]:
    return _at("created_at", server_default=_now())


# The partial unique index that makes a second enqueue of a queued (kind, key) a merge.
QUEUED_KEY_INDEX = "queue_queued_key_uq"
# The partial unique index that allows one lease per ticket, whatever the kind: a claim that
# would lease a second row of a key fails on it instead (see queue_claim_batch).
LEASED_KEY_INDEX = "queue_leased_key_uq"

# Text of the partial-index predicates. Queries must imply them, so they are written once.
QUEUED = "state = 'queued'"
LEASED = "state = 'leased'"
FINISHED = "state IN ('done', 'failed')"
DEAD = "state = 'dead_letter'"
# Rows that say the queue gave up on their ticket (refresh leaves such a ticket alone until
# it is redriven); a superseded row did not give up, a newer row took its work over.
GIVEN_UP = "state = 'failed' OR (state = 'dead_letter' AND dead_reason <> 'superseded')"

queue = sa.Table(
    "queue",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("tenant", sa.Text, nullable=True),
    sa.Column("priority", sa.SmallInteger, nullable=False, server_default="1"),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("payload", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("state", sa.Text, nullable=False, server_default=State.QUEUED.value),
    _at("visible_at", server_default=_now()),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("lease_owner", sa.Text),
    _at("lease_expires_at", nullable=True),
    _at("heartbeat_at", nullable=True),
    sa.Column("last_error", sa.Text),
    sa.Column("dead_reason", sa.Text),
    sa.Column("superseded_by", sa.BigInteger),
    # New at every claim, for the row's whole life: what fences the claim's later writes
    # (an attempt number repeats after a defer, a redrive or a claim a crash undid).
    sa.Column("claim_token", pg.UUID(as_uuid=True)),
    _created_at(),
    _at("updated_at", server_default=_now()),
    _at("finished_at", nullable=True),
    # When an event last merged into this row while it was queued: an operator's cancel
    # leaves a row that new work merged into after the cancel began (the work survives).
    _at("merged_at", nullable=True),
    sa.CheckConstraint(_one_of("state", State), name="state_known"),
    sa.CheckConstraint(_one_of("reason", Reason), name="reason_known"),
    sa.CheckConstraint(f"char_length(key) BETWEEN 1 AND {KEY_MAX_LENGTH}", name="key_length"),
    sa.CheckConstraint("attempts >= 0 AND attempts <= max_attempts", name="attempts_in_range"),
    sa.CheckConstraint("max_attempts >= 1", name="max_attempts_positive"),
    sa.CheckConstraint(
        "(state = 'leased') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
        name="lease_iff_leased",
    ),
    sa.CheckConstraint(
        "(state IN ('done', 'failed', 'dead_letter')) = (finished_at IS NOT NULL)",
        name="finished_iff_terminal",
    ),
    sa.CheckConstraint(
        f"(state = 'dead_letter') = (dead_reason IS NOT NULL)"
        f" AND (dead_reason IS NULL OR {_one_of('dead_reason', DeadReason)})",
        name="dead_reason_iff_dead",
    ),
    sa.CheckConstraint(
        "superseded_by IS NULL OR dead_reason = 'superseded'", name="superseded_has_reason"
    ),
    # Merge: one queued row per (kind, key); a second enqueue is a no-op.
    sa.Index(QUEUED_KEY_INDEX, "kind", "key", unique=True, postgresql_where=sa.text(QUEUED)),
    # Claim: per kind and tenant, visible rows oldest first: the claim reads a pair's rows
    # (its head says which pairs) and the head refresh finds a pair's oldest row by it.
    sa.Index(
        "queue_claim_idx",
        "kind",
        sa.text("coalesce(tenant, '')"),
        "visible_at",
        postgresql_where=sa.text(QUEUED),
    ),
    # One lease per ticket, whatever the kind: the claim skips keys that have one, and this
    # index refuses a claim whose snapshot could not see a lease committed meanwhile.
    sa.Index(LEASED_KEY_INDEX, "key", unique=True, postgresql_where=sa.text(LEASED)),
    # No index by lease owner: the heartbeat and the settles find their rows by id, and
    # every index over leased rows is one more write per claimed row (migration 0002).
    # Sweeper: expired leases.
    sa.Index("queue_leased_expiry_idx", "lease_expires_at", postgresql_where=sa.text(LEASED)),
    # Retention and the sweeper's terminal counts: done/failed rows by age, dead letters by
    # age, each its own index so that pruning one never walks the other, and each carrying
    # what the counts group by, so counting them is an index-only scan.
    sa.Index(
        "queue_finished_idx",
        "finished_at",
        postgresql_include=["kind", "state"],
        postgresql_where=sa.text(FINISHED),
    ),
    sa.Index(
        "queue_dead_finished_idx",
        "finished_at",
        postgresql_include=["kind", "dead_reason"],
        postgresql_where=sa.text(DEAD),
    ),
    # Dead-letter listing and redrive by reason.
    sa.Index("queue_dead_reason_idx", "dead_reason", "id", postgresql_where=sa.text(DEAD)),
    # The dlq verbs by ticket (`--key`), and their selection walked in pages, a ticket's
    # dead letters together (the newest of each is the one a redrive queues again).
    sa.Index("queue_dead_key_idx", "key", "kind", "id", postgresql_where=sa.text(DEAD)),
    # Refresh: has the queue given up on this ticket since its last enrichment?
    sa.Index("queue_given_up_key_idx", "key", "id", postgresql_where=sa.text(GIVEN_UP)),
    # The queue table churns: vacuum it early and often so dead tuples never pile up.
    postgresql_with={
        "autovacuum_vacuum_scale_factor": "0.01",
        "autovacuum_vacuum_threshold": "1000",
        "autovacuum_vacuum_insert_scale_factor": "0.05",
        "autovacuum_analyze_scale_factor": "0.02",
        "autovacuum_vacuum_cost_delay": "1",
        "fillfactor": "80",
    },
)

tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    sa.Column("plan", sa.Text, nullable=False, server_default=Plan.STANDARD.value),
    sa.Column("priority", sa.SmallInteger, nullable=False, server_default="1"),
    sa.CheckConstraint(_one_of("plan", Plan), name="plan_known"),
)

# Claims per (kind, tenant, hour): what the claim's fairness term reads. Counting at claim
# time makes in-flight work count as served, and the claim reads at most 25 rows per tenant
# however long the queue's history is. Ownerless work is counted under tenant ''.
tenant_served = sa.Table(
    "tenant_served",
    metadata,
    sa.Column("kind", sa.Text, primary_key=True),
    sa.Column("tenant", sa.Text, primary_key=True),
    _at("bucket", primary_key=True),
    sa.Column("served", sa.BigInteger, nullable=False),
    # Retention drops old buckets of every tenant without reading the others.
    sa.Index("tenant_served_bucket_idx", "bucket"),
)

# One row per (kind, tenant) that has had queued work: where the claim starts, so its cost
# follows the batch, not the number of tenants with queued rows (issue 26). Kept by the
# queue's own triggers (migration 0010: any statement that queues a row makes or lowers its
# pair's head, so `oldest` is never after any queued row of the pair) and by the claim,
# which re-evaluates the heads that are due (`due_at`: visible, one aging step further, a
# served hour leaving the day, or a periodic look) and the pairs it took rows from.
# `behind` (levels below the top plan's; NULL: nothing visible), `served` (claims of the
# last day) and `oldest` are the claim order's terms as of that evaluation, all ascending,
# so the claim walks the order index one entry at a time; ownerless work is tenant ''.
queue_heads = sa.Table(
    "queue_heads",
    metadata,
    sa.Column("kind", sa.Text, primary_key=True),
    sa.Column("tenant", sa.Text, primary_key=True),
    _at("oldest"),
    sa.Column("behind", sa.SmallInteger),
    sa.Column("served", sa.BigInteger, nullable=False, server_default="0"),
    _at("due_at"),
    # The claim order: the pairs with visible work, best first; read a few entries a claim.
    sa.Index(
        "queue_heads_order_idx",
        "behind",
        "served",
        "oldest",
        "kind",
        "tenant",
        postgresql_where=sa.text("behind IS NOT NULL"),
    ),
    # The heads to evaluate again, soonest first.
    sa.Index("queue_heads_due_idx", "due_at"),
)

# Terminal rows by kind, state and dead reason ('' when none), counted by the sweeper leader
# once a pass: what every process's /metrics reads, so a scrape costs the same whatever the
# size of the history (open rows are counted live, through their partial indexes).
queue_counts = sa.Table(
    "queue_counts",
    metadata,
    sa.Column("kind", sa.Text, primary_key=True),
    sa.Column("state", sa.Text, primary_key=True),
    sa.Column("dead_reason", sa.Text, primary_key=True),
    sa.Column("rows", sa.BigInteger, nullable=False),
    _at("counted_at"),
)

ticket_orders = sa.Table(
    "ticket_orders",
    metadata,
    sa.Column("ticket_id", sa.Text, primary_key=True),
    sa.Column("order_id", sa.Text, primary_key=True),
    sa.Column("customer_id", sa.Text),
    _at("placed_at", nullable=True),
    sa.Column("total", sa.Numeric),
    _at("looked_up_at"),
    sa.Column("queue_id", sa.BigInteger, nullable=False),
)

# One row per enriched ticket, also when it had no orders: "enriched, empty" and "never
# enriched" are different answers for parity and for the refresh schedule.
ticket_enrichments = sa.Table(
    "ticket_enrichments",
    metadata,
    sa.Column("ticket_id", sa.Text, primary_key=True),
    _at("enriched_at"),
    sa.Column("order_count", sa.Integer, nullable=False),
    sa.Column("queue_id", sa.BigInteger, nullable=False),
    sa.Index("ticket_enrichments_enriched_at_idx", "enriched_at"),
)

lookup_log = sa.Table(
    "lookup_log",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    sa.Column("queue_id", sa.BigInteger, nullable=False),
    # The claim the lookup belongs to: one row per claim, however often its settle runs.
    sa.Column("claim_token", pg.UUID(as_uuid=True)),
    sa.Column("ticket_id", sa.Text, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    # Warehouse job ids are opaque text (BigQuery's are not UUIDs).
    sa.Column("job_id", sa.Text),
    # One BigQuery run can bill more than 2.1 GB: bigint, never int.
    sa.Column("bytes_billed", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("rows", sa.Integer, nullable=False, server_default="0"),
    sa.Column("duration_ms", sa.Float, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("error", sa.Text),
    _created_at(),
    sa.CheckConstraint(_one_of("status", LOOKUP_STATUSES), name="status_known"),
    sa.CheckConstraint("bytes_billed >= 0", name="bytes_billed_non_negative"),
    sa.Index("lookup_log_ticket_id_idx", "ticket_id"),
    sa.Index("lookup_log_claim_key", "queue_id", "claim_token", unique=True),
    # Retention deletes the oldest rows first, a page at a time.
    sa.Index("lookup_log_created_at_idx", "created_at"),
)

# Warehouse lookups running now, fleet-wide: each one's slot under
# ENRICHQ_WAREHOUSE_MAX_CONCURRENCY and the bytes it reserved against the daily budget, from
# its admission to the settle that charges it. A row whose owner stopped heartbeating
# expires one lease later (admissions count only live rows); retention deletes those.
# Rows are admitted by the function enrichq.admission_take (migration 0015), one statement.
lookups_in_flight = sa.Table(
    "lookups_in_flight",
    metadata,
    sa.Column("token", pg.UUID(as_uuid=True), primary_key=True),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("reserved_bytes", sa.BigInteger, nullable=False),
    _at("started_at"),
    _at("expires_at"),
    # what the lookup's query really cost, once it returned (migration 0018): held until its
    # settle charges it, and the fleet's worst known query cost meanwhile
    sa.Column("cost", sa.BigInteger),
    sa.CheckConstraint("reserved_bytes >= 0", name="reserved_bytes_non_negative"),
    sa.CheckConstraint("cost >= 0", name="cost_non_negative"),
)

# Leadership among replicas by a lease row, where no session can hold an advisory lock
# (ENRICHQ_POOL_MODE=transaction: behind a transaction pooler a session is not ours between
# transactions). One row per led task; its owner leads until expires_at (the database
# clock) and renews well before then; anyone may take a row whose lease has run out.
leader_leases = sa.Table(
    "leader_leases",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("owner", sa.Text, nullable=False),
    _at("acquired_at"),
    _at("renewed_at"),
    _at("expires_at"),
    sa.CheckConstraint("expires_at > renewed_at", name="expires_after_renewal"),
)

budget_ledger = sa.Table(
    "budget_ledger",
    metadata,
    sa.Column("day", sa.Date, primary_key=True),
    sa.Column("bytes_billed", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("lookups", sa.BigInteger, nullable=False, server_default="0"),
    # warehouse queries charged (a batch is one) and the costliest of them (migration 0018):
    # what the admission reserves per query
    sa.Column("queries", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("query_bytes_max", sa.BigInteger, nullable=False, server_default="0"),
    _at("updated_at", server_default=_now()),
    sa.CheckConstraint("bytes_billed >= 0", name="bytes_billed_non_negative"),
    sa.CheckConstraint("queries >= 0", name="queries_non_negative"),
    sa.CheckConstraint("query_bytes_max >= 0", name="query_bytes_max_non_negative"),
)

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    sa.Column("component", sa.Text, nullable=False),
    sa.Column("owner", sa.Text, nullable=False),
    _at("started_at", server_default=_now()),
    _at("finished_at", nullable=True),
    # the run's last sign of life: its start, then each of its worker's heartbeats
    _at("seen_at", server_default=_now()),
    sa.Column("stop_reason", sa.Text),
    sa.Column("counts", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("error", sa.Text),
    sa.CheckConstraint(_one_of("component", Component), name="component_known"),
    sa.CheckConstraint(
        f"stop_reason IS NULL OR {_one_of('stop_reason', StopReason)}", name="stop_reason_known"
    ),
    sa.CheckConstraint("(finished_at IS NULL) = (stop_reason IS NULL)", name="finished_iff_reason"),
    sa.Index("runs_component_started_at_idx", "component", "started_at"),
    # Retention deletes the runs that ended longest ago first, a page at a time.
    sa.Index("runs_finished_at_idx", "finished_at"),
    # The sweeper closes the open runs that went silent (stop reason `lost`).
    sa.Index("runs_open_seen_at_idx", "seen_at", postgresql_where=sa.text("finished_at IS NULL")),
)

parity_runs = sa.Table(
    "parity_runs",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    _at("started_at", server_default=_now()),
    _at("finished_at", nullable=True),
    _at("window_since"),
    _at("window_until"),
    sa.Column("tickets_compared", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("tickets_excluded", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("exact_matches", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("order_coverage", sa.Float),
    sa.Column("ticket_match_rate", sa.Float),
    sa.Column("min_order_coverage", sa.Float, nullable=False),
    sa.Column("min_ticket_match_rate", sa.Float, nullable=False),
    sa.Column("passed", sa.Boolean),
    sa.Column("report", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    # The verdict by fault (migration 0003): tickets whose difference is enrichq's fault,
    # the legacy flow's, and how many of the latter an accepted rule covers. NULL rate and
    # bar: a run recorded before faults were told apart.
    sa.Column("shadow_faults", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("shadow_fault_rate", sa.Float),
    sa.Column("max_shadow_fault_rate", sa.Float),
    sa.Column("legacy_faults", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("accepted_legacy_faults", sa.BigInteger, nullable=False, server_default="0"),
    # The reviewed accept file the run applied (its rules are in the report): how many rules
    # and the SHA-256 of its bytes, so a reviewer can tell which file was signed.
    sa.Column("accept_rules", sa.Integer, nullable=False, server_default="0"),
    sa.Column("accept_sha256", sa.Text),
    # What the run read (migration 0013): the time its data is as of (a standby's last
    # replayed commit), how far that standby's replay was behind, and, per tenant, what the
    # shadow table held and how many tickets consumers can read that enrichq never enriched
    # (the gate checks them again at cutover time).
    _at("data_at", nullable=True),
    sa.Column("replica_lag_seconds", sa.Float),
    sa.Column("coverage", pg.JSONB),
    sa.CheckConstraint(
        "accepted_legacy_faults BETWEEN 0 AND legacy_faults", name="accepted_within_faults"
    ),
    sa.Index("parity_runs_finished_at_idx", "finished_at"),
)

# A reviewer's signature on a finished, passing parity run; cutover needs one on the run it
# judges. One per reviewer and run.
APPROVER_MAX_LENGTH = 200
APPROVAL_NOTE_MAX_LENGTH = 2000

parity_approvals = sa.Table(
    "parity_approvals",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    sa.Column(
        "parity_run_id", sa.BigInteger, sa.ForeignKey("enrichq.parity_runs.id"), nullable=False
    ),
    sa.Column("approved_by", sa.Text, nullable=False),
    sa.Column("note", sa.Text),
    _at("approved_at", server_default=_now()),
    # one approval per reviewer and run, whatever the case of the name (--by alice, --by
    # Alice): the name case-folded by Python, so the database's collation does not decide
    sa.Column("reviewer_key", sa.Text, nullable=False),
    sa.UniqueConstraint("parity_run_id", "reviewer_key"),
    sa.CheckConstraint(
        f"char_length(approved_by) BETWEEN 1 AND {APPROVER_MAX_LENGTH}", name="approver_length"
    ),
    sa.CheckConstraint(
        f"note IS NULL OR char_length(note) <= {APPROVAL_NOTE_MAX_LENGTH}", name="note_length"
    ),
)

cutover_events = sa.Table(
    "cutover_events",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("target", sa.Text, nullable=False),
    sa.Column("parity_run_id", sa.BigInteger, sa.ForeignKey("enrichq.parity_runs.id")),
    sa.Column("actor", sa.Text, nullable=False),
    _at("at", server_default=_now()),
    sa.Column("note", sa.Text),
    # The tenant moved by a staged cutover or rollback; NULL: every tenant at once.
    sa.Column("tenant", sa.Text),
    sa.CheckConstraint("action IN ('cutover', 'rollback')", name="action_known"),
)

# Help-desk event ids seen by `POST /v1/events` within ENRICHQ_EVENT_DEDUPE_HOURS: a
# redelivered event is acknowledged and enqueues nothing, even after its row was claimed,
# done or pruned. The sweeper's retention pass deletes ids older than the window (by
# seen_at, hence the index). queue_id is the row the event went into; it is no foreign key,
# as queue rows are pruned long before anyone asks.
seen_events = sa.Table(
    "seen_events",
    metadata,
    sa.Column("event_id", sa.Text, primary_key=True),
    _at("seen_at", server_default=_now()),
    sa.Column("queue_id", sa.BigInteger),
    sa.CheckConstraint(
        f"char_length(event_id) BETWEEN 1 AND {EVENT_ID_MAX_LENGTH}", name="event_id_length"
    ),
    sa.Index("seen_events_seen_at_idx", "seen_at"),
)

# Every operator action on the queue (cancel, dlq discard, dlq redrive, pause, resume): who,
# from where, when, the filter it was given (JSON), and how many rows it changed.
# A batched action opens its row first (finished_at NULL) and adds each batch's rows in that
# batch's own transaction, so the row always says what was committed; an action that was
# interrupted keeps finished_at NULL. Listed newest first by `enrichq audit` (by id).
audit_log = sa.Table(
    "audit_log",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    _at("at", server_default=_now()),
    _at("finished_at", nullable=True),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("origin", sa.Text, nullable=False),
    sa.Column("command", sa.Text, nullable=False),
    sa.Column("filter", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("rows_affected", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("detail", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("note", sa.Text),
    sa.CheckConstraint(_one_of("command", AuditCommand), name="command_known"),
    sa.CheckConstraint("rows_affected >= 0", name="rows_affected_non_negative"),
    sa.CheckConstraint("finished_at IS NULL OR finished_at >= at", name="finished_after_start"),
)

# Claims stopped by an operator (`enrichq pause`), per scope: a kind, a tenant, both, or
# neither (NULL matches every kind or every tenant). The claim skips every (kind, tenant)
# pair a pause covers before reading any of its rows; ingest goes on. `enrichq resume`
# deletes the row. One row per scope (NULLs compare equal).
pauses = sa.Table(
    "pauses",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
    sa.Column("kind", sa.Text),
    sa.Column("tenant", sa.Text),
    sa.Column("reason", sa.Text),
    sa.Column("paused_by", sa.Text, nullable=False),
    _at("paused_at", server_default=_now()),
    sa.UniqueConstraint("kind", "tenant", postgresql_nulls_not_distinct=True),
    sa.CheckConstraint(f"kind IS NULL OR {_one_of('kind', Kind)}", name="kind_known"),
)

# The tenants whose consumers read enrichq's rows while a cutover is staged: the consumer
# view's shadow side joins it. It lives beside the view in the consumer-facing schema, where
# the service's role has no rights: only `enrichq cutover` changes what consumers read.
cutover_tenants = sa.Table(
    "cutover_tenants",
    metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    sa.Column(
        "event_id", sa.BigInteger, sa.ForeignKey("enrichq.cutover_events.id"), nullable=False
    ),
    schema=PUBLIC_SCHEMA,
)
