"""The isolated child (enrichq_service.isolate): it connects to the warehouse as the
worker's settings say, like every other enrichq engine; it hands back each ticket's
outcome as the enricher gave it; and it is killed when its attempt is given up."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.procs import wait_for
from tests.support.settings import make_settings

from enrichq_schema.connections import warehouse_engine
from enrichq_schema.settings import Settings
from enrichq_schema.states import PoolMode
from enrichq_service.enrich import EnrichContext, Enrichment, Ticket
from enrichq_service.errors import Deferral, PermanentError, TransientError
from enrichq_service.isolate import CANCELLED, enrich_in_child


def ticket(key: str) -> Ticket:
    return Ticket(key, "someone@example.org", "acme", None, None)


@contextmanager
def warehouse(settings: Settings, url: str) -> Iterator[sa.Engine]:
    engine = warehouse_engine(settings, url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_the_isolated_child_connects_to_the_warehouse_as_the_settings_say(
    db_url: str, mode: PoolMode
) -> None:
    settings = make_settings(
        db_url,
        enricher="tests.support.enrichers:warehouse_session",
        network_timeout_seconds=7,
        pool_mode=mode,
    )
    with warehouse(settings, db_url) as engine:
        outcomes = enrich_in_child(EnrichContext(settings, engine), [ticket("T-1")])

    enrichment = outcomes["T-1"]
    assert isinstance(enrichment, Enrichment)
    # prepare_threshold None: nothing prepared server-side behind a transaction pooler
    prepare = "None" if mode is PoolMode.TRANSACTION else str(2**31 - 1)
    assert [o.order_id for o in enrichment.orders] == [
        "tcp_user_timeout=7000",
        f"prepare={prepare}",
    ]


def test_each_ticket_gets_the_outcome_its_batch_enricher_gave_it(db_url: str) -> None:
    settings = make_settings(db_url, batch_enricher="tests.support.enrichers:batch_outcomes")
    keys = ["ok-1", "perm-1", "defer-1", "trans-1", "odd-1", "gone-1", "bad-1"]
    with warehouse(settings, db_url) as engine:
        outcomes = enrich_in_child(EnrichContext(settings, engine), [ticket(k) for k in keys])

    ok = outcomes["ok-1"]
    assert isinstance(ok, Enrichment)
    assert ([o.order_id for o in ok.orders], ok.job_id, ok.bytes_billed) == (
        ["O-ok-1"],
        "batch-job",
        7,
    )
    assert {k: type(v) for k, v in outcomes.items() if k != "ok-1"} == {
        "perm-1": PermanentError,
        "defer-1": Deferral,
        "trans-1": TransientError,
        "odd-1": TransientError,
        "gone-1": TransientError,
        "bad-1": PermanentError,  # refused where it enters, as in the worker
    }
    assert str(outcomes["odd-1"]) == "ValueError: unexpected"
    assert "orders[0].order_id" in str(outcomes["bad-1"])


def test_a_child_is_killed_when_its_attempt_is_given_up(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the child sleeps 600 s; the attempt is given up (abandoned or its lease lost) once
    # the child has started: the child is killed and the call returns
    monkeypatch.setenv("ENRICHQ_TEST_STARTED_DIR", str(tmp_path))
    monkeypatch.setenv("ENRICHQ_TEST_SLOW_SECONDS", "600")
    settings = make_settings(db_url, enricher="tests.support.enrichers:sleepy_warehouse")
    cancelled = threading.Event()
    started = tmp_path / "T-1"

    @contextmanager
    def interruptible(cancel: Callable[[], None]) -> Iterator[None]:
        def give_up() -> None:
            wait_for(started.exists, timeout=60, what="the child to start its enrichment")
            cancelled.set()
            cancel()

        thread = threading.Thread(target=give_up)
        thread.start()
        try:
            yield
        finally:
            thread.join()

    with warehouse(settings, db_url) as engine:
        context = EnrichContext(settings, engine, cancelled, interruptible=interruptible)
        outcomes = enrich_in_child(context, [ticket("T-1")])

    assert isinstance(outcomes["T-1"], TransientError)
    assert str(outcomes["T-1"]) == CANCELLED
    child = int(wait_for(started.read_text, what="the child's pid"))
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
