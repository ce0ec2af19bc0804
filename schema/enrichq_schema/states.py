"""The queue's vocabulary: states, reasons, kinds and run stop reasons (DESIGN §3, §6)."""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """Where a queue row is in its life."""

    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"
    DEAD_LETTER = "dead_letter"


OPEN_STATES = (State.QUEUED, State.LEASED)
TERMINAL_STATES = (State.DONE, State.FAILED, State.DEAD_LETTER)


class Kind(StrEnum):
    """Kinds of work, in the order a worker serves them (earlier stages win)."""

    ENRICH = "enrich"
    REFRESH = "refresh"
    BACKFILL = "backfill"
    """A ticket consumers can read that enrichq never enriched (`enrichq backfill`): served
    after every other kind, never aged up."""


class Reason(StrEnum):
    """Why a row was enqueued; the created/updated reasons pick the visibility delay."""

    CREATED = "created"
    UPDATED = "updated"
    REFRESH = "refresh"
    REDRIVE = "redrive"
    MANUAL = "manual"
    RECONCILE = "reconcile"
    """The sweeper found the ticket changed in the mirror after its last lookup with no
    event for it (`enrichq_sweeper.reconcile`): an event the help desk never delivered."""


class DeadReason(StrEnum):
    """Why a row ended in the dead-letter state."""

    ATTEMPTS_EXHAUSTED = "attempts_exhausted"
    SUPERSEDED = "superseded"
    CANCELLED = "cancelled"  # by an operator (`enrichq cancel`)


class AuditCommand(StrEnum):
    """An operator action recorded in `enrichq.audit_log` (`enrichq audit` lists them)."""

    CANCEL = "cancel"
    DLQ_DISCARD = "dlq discard"
    DLQ_REDRIVE = "dlq redrive"
    PAUSE = "pause"
    RESUME = "resume"
    BACKFILL = "backfill"


class Outcome(StrEnum):
    """What became of one claimed job (the `outcome` label of the metrics)."""

    DONE = "done"
    RETRY = "retry"
    FAILED = "failed"
    DEAD_LETTER = "dead_letter"
    DEFERRED = "deferred"
    LOST = "lost"


class Component(StrEnum):
    """Which process wrote an `enrichq.runs` row."""

    WORKER = "worker"
    SWEEPER = "sweeper"
    PARITY = "parity"


class StopReason(StrEnum):
    """Why a run ended; all but `error` and `lost` are healthy."""

    NO_WORK = "no_work"
    TIME_BUDGET = "time_budget"
    BUDGET_EXHAUSTED = "budget_exhausted"
    SHUTDOWN = "shutdown"
    ERROR = "error"
    # closed by the sweeper: the process stopped giving signs of life (killed, frozen, cut off)
    LOST = "lost"


class Plan(StrEnum):
    """A tenant's plan; it sets the priority of the tenant's work."""

    FREE = "free"
    STANDARD = "standard"
    PRIORITY = "priority"


PLAN_PRIORITY: dict[Plan, int] = {Plan.FREE: 0, Plan.STANDARD: 1, Plan.PRIORITY: 2}
# Ownerless work (maintenance refreshes, tickets with no tenant) counts as the middle plan:
# housekeeping that always loses never happens.
OWNERLESS_PRIORITY = PLAN_PRIORITY[Plan.STANDARD]

LOOKUP_STATUSES = ("ok", "empty", "not_found", "error", "deferred")
# The channel enqueue, redrive, recovery and resume NOTIFY and workers LISTEN on (every
# statement that notifies takes it as :channel).
NOTIFY_CHANNEL = "enrichq_queue"
# The last_error the sweeper writes on a row whose lease expired; the worker reads it to
# know that the row's previous attempt lost its process (a suspect, see isolate.py).
LEASE_EXPIRED_ERROR = "lease expired"
KEY_MAX_LENGTH = 200
# The longest tenant an operator names (--tenant, a pause's scope, an accept rule).
TENANT_MAX_LENGTH = 200
# A help-desk event id (the webhook's `id`, kept for redelivery dedupe) is bounded alike.
EVENT_ID_MAX_LENGTH = 200


class PoolMode(StrEnum):
    """What a client connection keeps between transactions (ENRICHQ_POOL_MODE); how each
    is served is in `enrichq_schema.pooling`."""

    SESSION = "session"  # one server session per connection: direct, or session pooling
    TRANSACTION = "transaction"  # a server session per transaction: PgBouncer transaction mode


BACKFILL_PRIORITY = min(PLAN_PRIORITY.values()) - 1
"""The level of backfill work in the claim order (the claim's SQL spells it -1): below every
plan, never aged up."""
