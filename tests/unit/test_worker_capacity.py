"""How many jobs the claim loop may claim: slots for the units the worker runs, and jobs
waiting for the settler, which free their slots but stay held until settled."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import pytest
import sqlalchemy as sa
from tests.support.settings import make_settings
from tests.unit.test_worker_lifecycle import held

from enrichq_service.enrich import EnrichContext, EnricherChoice, Enrichment, Ticket
from enrichq_service.worker.admission import Admission
from enrichq_service.worker.lifecycle import Held, Jobs
from enrichq_service.worker.runner import Runner

CONCURRENCY = 2
BATCH = 50
SLOTS = CONCURRENCY * BATCH


def batch(
    tickets: Sequence[Ticket], context: EnrichContext, /
) -> Mapping[str, Enrichment | BaseException]:
    return {}


@pytest.fixture
def jobs() -> Jobs:
    return Jobs()


def make_runner(jobs: Jobs, **settings: object) -> Runner:
    config = make_settings(
        "postgresql://nobody@127.0.0.1:1/none", concurrency=CONCURRENCY, **settings
    )
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")  # never used
    return Runner(
        config,
        jobs,
        enricher=EnricherChoice(None, batch, BATCH),
        warehouse=engine,
        admission=Admission(engine, config, "test"),
        settle=lambda *s: None,
        on_budget_refused=lambda: None,
    )


@pytest.fixture
def runner(jobs: Jobs) -> Iterator[Runner]:
    runner = make_runner(jobs)
    yield runner
    runner.shutdown()


def claimed(jobs: Jobs, first: int, n: int) -> list[Held]:
    hs = [held(first + i) for i in range(n)]
    jobs.add(hs)
    return hs


def handed(jobs: Jobs, hs: list[Held]) -> None:
    """Their handlers ran and their settlements went to the settler."""
    jobs.start(hs, now=0.0, run_seconds=60.0)
    for h in hs:
        assert jobs.hand_off(h, finished=True)


def test_running_jobs_take_the_slots(jobs: Jobs, runner: Runner) -> None:
    assert runner.capacity() == SLOTS
    claimed(jobs, 0, BATCH)
    assert runner.capacity() == SLOTS - BATCH
    claimed(jobs, BATCH, BATCH)
    assert runner.capacity() == 0


def test_jobs_waiting_for_the_settler_free_their_slots(jobs: Jobs, runner: Runner) -> None:
    handed(jobs, claimed(jobs, 0, SLOTS))
    # the next units can start while the settler commits the last ones
    assert runner.capacity() == SLOTS
    assert jobs.counts() == (SLOTS, SLOTS)


def test_a_settler_that_cannot_get_through_stops_the_claims(jobs: Jobs, runner: Runner) -> None:
    handed(jobs, claimed(jobs, 0, SLOTS))
    claimed(jobs, SLOTS, BATCH)
    assert runner.capacity() == SLOTS - BATCH
    handed(jobs, jobs_of(jobs, SLOTS, BATCH))
    claimed(jobs, SLOTS + BATCH, SLOTS - BATCH)
    # twice the slots held, half of them settling: no claim until the settler gets through
    assert jobs.counts() == (2 * SLOTS, SLOTS + BATCH)
    assert runner.capacity() == 0


def test_settled_jobs_leave_the_count(jobs: Jobs, runner: Runner) -> None:
    hs = claimed(jobs, 0, SLOTS)
    handed(jobs, hs)
    jobs.settled(hs[:BATCH])
    assert jobs.counts() == (SLOTS - BATCH, SLOTS - BATCH)
    jobs.settled(hs[BATCH:])
    assert jobs.counts() == (0, 0)
    assert runner.capacity() == SLOTS


def jobs_of(jobs: Jobs, first: int, n: int) -> list[Held]:
    wanted = set(range(first, first + n))
    return [h for h in jobs.unsettled() if h.id in wanted]


@pytest.mark.parametrize(
    "limit", [{"warehouse_max_concurrency": 1}, {"daily_bytes_budget": 10**12}], ids=str
)
def test_under_a_cap_or_a_budget_a_job_keeps_its_slot_until_settled(
    jobs: Jobs, limit: dict[str, object]
) -> None:
    # its lookup's admission (a slot under the cap, bytes reserved) goes with its settle:
    # a unit started in its place would wait for this very slot, and be deferred
    runner = make_runner(jobs, **limit)
    try:
        hs = claimed(jobs, 0, SLOTS)
        handed(jobs, hs)
        assert runner.capacity() == 0
        jobs.settled(hs[:BATCH])
        assert runner.capacity() == BATCH
    finally:
        runner.shutdown()
