"""A worker process for the queue concurrency tests: claim, settle, report every claim.

Started with multiprocessing's spawn method, so it imports nothing from pytest and shares
nothing with the parent but its arguments: a barrier to start together and a queue for
its report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from enrichq_schema.db import create_engine
from enrichq_service import queue

LEASE_SECONDS = 60.0


@dataclass(frozen=True)
class ClaimReport:
    """What one worker saw: every (id, attempt) it was handed, and which settles won."""

    owner: str
    claims: list[tuple[int, int]] = field(default_factory=list)
    completed: list[tuple[int, int]] = field(default_factory=list)
    retried: list[tuple[int, int]] = field(default_factory=list)
    error: str | None = None


def claim_until_empty(
    *, url: str, owner: str, batch: int, retry_every: int, start: Any, out: Any
) -> None:
    """Claim batches until a claim comes back empty; complete each job, except that a job
    whose id is a multiple of `retry_every` is retried (zero backoff) on its first attempt.

    One transaction per claim and one per settle, like a worker without a settle buffer.
    """
    report = ClaimReport(owner)
    engine = create_engine(url, pool_size=1, application_name=f"claimer-{owner}")
    try:
        start.wait(60)
        while True:
            with engine.begin() as conn:
                jobs = queue.claim(
                    conn, kinds=("enrich",), owner=owner, limit=batch, lease_seconds=LEASE_SECONDS
                )
            if not jobs:
                break
            report.claims.extend((j.id, j.attempts) for j in jobs)
            flaky = [j for j in jobs if j.attempts == 1 and j.id % retry_every == 0]
            done = [j for j in jobs if j not in flaky]
            with engine.begin() as conn:
                won = queue.complete(conn, owner=owner, jobs=done)
                requeued = queue.retry(
                    conn,
                    owner=owner,
                    failures=[(j, "flaky") for j in flaky],
                    backoff_base_seconds=0,
                    backoff_cap_seconds=0,
                )
            report.completed.extend((j.id, j.attempts) for j in done if j.id in won)
            report.retried.extend((j.id, j.attempts) for j in flaky if j.id in requeued)
    except Exception as exc:  # the parent asserts on it; a child must always report
        report = ClaimReport(owner, report.claims, report.completed, report.retried, repr(exc))
    finally:
        engine.dispose()
        out.put(report)
