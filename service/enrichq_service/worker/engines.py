"""The connection pools of one worker process."""

from __future__ import annotations

import functools
from typing import NamedTuple

import sqlalchemy as sa

from enrichq_schema.connections import engine_from_settings, warehouse_engine
from enrichq_schema.settings import Settings


class WorkerEngines(NamedTuple):
    """The connection pools of one worker process."""

    queue: sa.Engine  # settles, heartbeats, admissions, run log, HTTP (serve), metrics
    claims: sa.Engine  # the claim loop only
    warehouse: sa.Engine  # lookups

    def dispose(self) -> None:
        for engine in self:
            engine.dispose()


def build_engines(settings: Settings, url: str) -> WorkerEngines:
    """The queue, claim and warehouse engines of a worker.

    The warehouse always gets a pool of its own, sized to the concurrency, even when it is
    the same database: slow lookups must never hold the connections that claims,
    heartbeats and settles need, or a slow warehouse would let leases expire.

    The claim loop gets one connection of its own, tuned for its two statements (the claim
    and the ticket read, whose generic plans tests/db/test_queue_plans.py checks): the
    prepared claim keeps its generic plan instead of being planned again on every call
    (planning cost about as much as running it), claims commit asynchronously (one that a
    server crash undoes only returns its rows to the queue, and the fence refuses whatever
    this worker then settles for them), and no ping precedes each checkout, since a failed
    claim is simply retried.

    Every engine follows ENRICHQ_POOL_MODE and ENRICHQ_NETWORK_TIMEOUT_SECONDS
    (`enrichq_schema.connections`): behind a transaction pooler the session settings are
    set in each transaction and nothing is prepared, so the claim keeps no generic plan.
    """
    # A worker frozen mid-transaction (SIGSTOP, a VM pause) would hold the row locks of its
    # claim or settle, and the sweeper would wait on them: the server ends such a session
    # after one lease, the time after which its work is someone else's anyway.
    session = functools.partial(
        engine_from_settings,
        settings,
        url,
        statement_timeout_seconds=settings.statement_timeout_seconds,
        idle_in_transaction_timeout_seconds=settings.lease_seconds,
    )
    queue = session(application_name="enrichq-worker", pool_size=4)
    claims = session(
        application_name="enrichq-worker-claims",
        pool_size=1,
        pre_ping=False,
        generic_plans=True,
        asynchronous_commit=True,
    )
    # No warehouse statement outlives its attempt's deadline, the plug-in's own queries
    # included (the built-in lookup sets what is left of it per lookup): a worker frozen
    # with a query running loses its slot a lease after its last heartbeat, and the
    # query must not run on beside the next lookup for longer than that deadline.
    warehouse = warehouse_engine(
        settings,
        settings.warehouse_url or url,
        pool_size=settings.concurrency,
        statement_timeout_seconds=settings.attempt_deadline_seconds,
    )
    return WorkerEngines(queue, claims, warehouse)
