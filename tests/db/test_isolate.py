"""The isolated child (enrichq_service.isolate): it connects to the warehouse as the
worker's settings say, like every other enrichq engine; it hands back each ticket's
outcome as the enricher gave it; and it is killed when its attempt is given up."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.db import q
from tests.support.enrichers import BASE_EXCEPTIONS, STDOUT_NOISE
from tests.support.procs import alive, wait_for
from tests.support.settings import make_settings

from enrichq_schema.connections import warehouse_engine
from enrichq_schema.settings import Settings
from enrichq_schema.states import PoolMode
from enrichq_service.enrich import (
    EnrichContext,
    EnricherChoice,
    Enrichment,
    PluginAborted,
    Ticket,
    enrich_all,
)
from enrichq_service.errors import Deferral, PermanentError, TransientError
from enrichq_service.isolate import (
    CANCELLED,
    CHILD_DIED,
    enrich_in_child,
    is_suspect,
)


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


def test_a_plug_in_that_prints_to_stdout_does_not_corrupt_the_childs_answer(
    db_url: str, capfd: pytest.CaptureFixture[str]
) -> None:
    # the child's answer travels on a channel of its own; what a plug-in prints goes to
    # the worker's log (its stderr), not into the answer
    settings = make_settings(db_url, enricher="tests.support.enrichers:prints_to_stdout")
    with warehouse(settings, db_url) as engine:
        outcomes = enrich_in_child(EnrichContext(settings, engine), [ticket("T-1"), ticket("T-2")])

    for key in ("T-1", "T-2"):
        enrichment = outcomes[key]
        assert isinstance(enrichment, Enrichment), enrichment
        assert (enrichment.job_id, enrichment.bytes_billed) == ("job-x", 1000)
    out, err = capfd.readouterr()
    assert STDOUT_NOISE not in out
    assert err.count(STDOUT_NOISE) == 4  # two tickets, print and fd 1 each


@pytest.mark.parametrize("kind", BASE_EXCEPTIONS)
@pytest.mark.parametrize("form", ["per_ticket", "batch"])
def test_a_base_exception_raised_by_a_plug_in_is_its_tickets_error_alone(
    db_url: str, monkeypatch: pytest.MonkeyPatch, kind: str, form: str
) -> None:
    # asyncio.CancelledError, a library's KeyboardInterrupt or SystemExit is the outcome of
    # the ticket whose call raised it, named; a batch call's is narrowed down to its ticket
    monkeypatch.setenv("ENRICHQ_TEST_BASE_KIND", kind)
    plug_in = "tests.support.enrichers:raises_base_exception"
    settings = (
        make_settings(db_url, enricher=plug_in)
        if form == "per_ticket"
        else make_settings(db_url, batch_enricher=f"{plug_in}_batch")
    )
    keys = ["T-1", "T-2", "B-1", "T-3"]
    with warehouse(settings, db_url) as engine:
        outcomes = enrich_in_child(EnrichContext(settings, engine), [ticket(k) for k in keys])

    assert {k: type(v) for k, v in outcomes.items()} == {
        "T-1": Enrichment,
        "T-2": Enrichment,
        "B-1": PluginAborted,
        "T-3": Enrichment,
    }
    name = {
        "cancelled": "CancelledError",
        "keyboard_interrupt": "KeyboardInterrupt",
        "system_exit": "SystemExit",
    }[kind]
    assert name in str(outcomes["B-1"])
    assert CHILD_DIED not in str(outcomes["B-1"])
    assert is_suspect(2, str(outcomes["B-1"]))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_child_ignores_the_stop_signals_its_process_group_gets(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: signal.Signals
) -> None:
    # a graceful stop signalled to the worker's whole process group (systemd's
    # KillMode=control-group, Ctrl-C in a terminal) reaches the child too: it carries on,
    # and its parent stops it at the end of its grace if need be
    monkeypatch.setenv("ENRICHQ_TEST_STARTED_DIR", str(tmp_path))
    monkeypatch.setenv("ENRICHQ_TEST_SLOW_SECONDS", "1.5")
    settings = make_settings(db_url, enricher="tests.support.enrichers:slow")
    started = tmp_path / "T-1"
    sent: list[int] = []

    def signal_the_child() -> None:
        pid = wait_for(
            lambda: started.read_text() if started.exists() else None,
            timeout=60,
            what="the child's pid",
        )
        child = int(pid)
        os.kill(child, signum)
        sent.append(child)

    thread = threading.Thread(target=signal_the_child)
    thread.start()
    try:
        with warehouse(settings, db_url) as engine:
            outcomes = enrich_in_child(EnrichContext(settings, engine), [ticket("T-1")])
    finally:
        thread.join()

    assert sent
    assert isinstance(outcomes["T-1"], Enrichment), outcomes["T-1"]


def test_the_query_of_a_killed_child_is_gone_from_the_server_when_the_call_returns(
    db_url: str, db_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a child killed mid-query (its attempt given up) must not leave its query running on
    # the warehouse: the caller releases the lookup's slot under the warehouse cap next
    monkeypatch.setenv("ENRICHQ_TEST_SLOW_SECONDS", "600")
    settings = make_settings(db_url, enricher="tests.support.enrichers:slow_query")
    cancelled = threading.Event()

    @contextmanager
    def interruptible(cancel: Callable[[], None]) -> Iterator[None]:
        def give_up() -> None:
            wait_for(lambda: isolated_sleepers(db_engine), timeout=60, what="the child's query")
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

    assert str(outcomes["T-1"]) == CANCELLED
    assert isolated_sleepers(db_engine) == 0


def isolated_sleepers(engine: sa.Engine) -> int:
    """Queries of isolated children running on the server now."""
    [(n,)] = q(
        engine,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'enrichq-isolated%' AND state = 'active'"
        " AND query LIKE '%pg_sleep%'",
    )
    return int(n)


def test_only_a_keyboard_interrupt_a_sigint_may_have_raised_stops_the_caller(db_url: str) -> None:
    # a SIGINT to the process under Python's own handler raises KeyboardInterrupt in the
    # main thread: that is the process being interrupted, not the plug-in's error. The
    # same exception raised in a job thread (where no signal is ever delivered) is.
    def interrupted(ticket: Ticket, context: EnrichContext) -> Enrichment:
        signal.raise_signal(signal.SIGINT)
        raise AssertionError("the signal's KeyboardInterrupt was not raised")

    choice = EnricherChoice(interrupted, None, 1)
    settings = make_settings(db_url)
    with warehouse(settings, db_url) as engine:
        context = EnrichContext(settings, engine)
        # Python's own handler, whatever the launcher left (a background job ignores SIGINT)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with pytest.raises(KeyboardInterrupt):
                enrich_all(choice, [ticket("T-1")], context)
        finally:
            signal.signal(signal.SIGINT, previous)

        def library(ticket: Ticket, context: EnrichContext) -> Enrichment:
            raise KeyboardInterrupt("a library's own")

        out: list[dict[str, object]] = []
        thread = threading.Thread(
            target=lambda: out.append(
                enrich_all(EnricherChoice(library, None, 1), [ticket("T-1")], context)
            )
        )
        thread.start()
        thread.join()
    assert isinstance(out[0]["T-1"], PluginAborted)


def test_the_query_of_a_child_past_its_deadline_is_gone_from_the_server_when_the_call_returns(
    db_url: str, db_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the same for a child killed because its attempt's time ran out
    monkeypatch.setenv("ENRICHQ_TEST_SLOW_SECONDS", "600")
    settings = make_settings(db_url, enricher="tests.support.enrichers:slow_query")
    seen: list[int] = []
    thread = threading.Thread(
        target=lambda: seen.append(
            wait_for(lambda: isolated_sleepers(db_engine), timeout=60, what="the child's query")
        )
    )
    thread.start()
    try:
        with warehouse(settings, db_url) as engine:
            context = EnrichContext(settings, engine, deadline=time.monotonic() + 10)
            outcomes = enrich_in_child(context, [ticket("T-1")])
        assert "isolated enrichment ran past" in str(outcomes["T-1"])
        assert isolated_sleepers(db_engine) == 0
    finally:
        thread.join()
    assert seen  # the query did run before the deadline


@pytest.mark.parametrize("end", ["deadline", "given_up", "died"])
def test_a_child_whose_plug_in_forked_a_helper_is_stopped_with_its_helper(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    # a helper forked by the plug-in holds the child's answer pipe: killing the child
    # alone left the call waiting for the helper to exit (600 s here), the job's thread
    # and its warehouse slot with it (or, when the child died, until the attempt's time
    # ran out); the child's whole process group is killed instead, and when it ends
    monkeypatch.setenv("ENRICHQ_TEST_STARTED_DIR", str(tmp_path))
    if end == "died":
        monkeypatch.setenv("ENRICHQ_TEST_EXIT", "1")
    monkeypatch.setenv("ENRICHQ_TEST_SLOW_SECONDS", "600")
    settings = make_settings(db_url, enricher="tests.support.enrichers:forks_and_hangs")
    marker = tmp_path / "helper"

    @contextmanager
    def interruptible(cancel: Callable[[], None]) -> Iterator[None]:
        def give_up() -> None:
            wait_for(marker.exists, timeout=60, what="the plug-in to fork its helper")
            cancel()

        thread = threading.Thread(target=give_up, daemon=True)
        thread.start()
        yield

    out: list[object] = []
    with warehouse(settings, db_url) as engine:
        if end == "deadline":
            context = EnrichContext(settings, engine, deadline=time.monotonic() + 5)
        elif end == "died":
            context = EnrichContext(settings, engine, deadline=time.monotonic() + 600)
        else:
            context = EnrichContext(settings, engine, interruptible=interruptible)
        call = threading.Thread(
            target=lambda: out.append(enrich_in_child(context, [ticket("T-1")])), daemon=True
        )
        call.start()
        call.join(120)
        assert not call.is_alive(), "the call waited for the plug-in's helper"

    assert isinstance(out[0], dict)
    assert isinstance(out[0]["T-1"], TransientError)
    if end == "died":
        assert CHILD_DIED in str(out[0]["T-1"])
    helper = int(marker.read_text())
    wait_for(lambda: not alive(helper), timeout=30, what="the helper to be gone")


PARENT = """
import sys, time
from enrichq_schema.connections import warehouse_engine
from enrichq_service.enrich import EnrichContext, Ticket
from enrichq_service.isolate import enrich_in_child
from tests.support.settings import make_settings

settings = make_settings(sys.argv[1], enricher="tests.support.enrichers:hang_on_h")
engine = warehouse_engine(settings, sys.argv[1])
context = EnrichContext(settings, engine, deadline=time.monotonic() + 600)
enrich_in_child(context, [Ticket("H-1", "someone@example.org", "acme", None, None)])
"""


@pytest.mark.parametrize("kill", ["group", "process"])
def test_an_isolated_child_does_not_outlive_its_worker_killed_by_sigkill(
    db_url: str, tmp_path: Path, kill: str
) -> None:
    # a supervisor that SIGKILLs the worker's process group (supervisord's killasgroup, a
    # terminal's hangup), or the worker alone: its isolated child, hanging deaf to
    # cancellation, must not run on with nobody to read its answer or end its query
    env = {
        **os.environ,
        "ENRICHQ_TEST_STARTED_DIR": str(tmp_path),
        "ENRICHQ_TEST_SLOW_SECONDS": "600",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    worker = subprocess.Popen([sys.executable, "-c", PARENT, db_url], env=env, process_group=0)
    try:
        marks = wait_for(lambda: list(tmp_path.glob("H-1.*")), timeout=60, what="the child")
        child = int(marks[0].read_text())
        assert alive(child)
        if kill == "group":
            os.killpg(worker.pid, signal.SIGKILL)
        else:
            worker.kill()
        worker.wait(10)
        wait_for(lambda: not alive(child), timeout=30, what="the orphaned child to be gone")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)


def test_an_isolated_child_of_a_frozen_worker_ends_at_its_own_deadline(
    db_url: str, tmp_path: Path
) -> None:
    """A worker frozen (SIGSTOP, a paused VM) while its isolated child runs cannot stop the
    child at the attempt's deadline, and its warehouse slot expires a lease later: a
    plug-in that runs query after query (each within the statement timeout) would go on
    beside the next lookup for as long as the freeze lasts. The child ends itself once its
    time (here 2 s) and CHILD_OVERRUN_SECONDS are past."""
    from enrichq_service.isolate import CHILD_OVERRUN_SECONDS

    env = {
        **os.environ,
        "ENRICHQ_TEST_STARTED_DIR": str(tmp_path),
        "ENRICHQ_TEST_SLOW_SECONDS": "600",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    parent = PARENT.replace("time.monotonic() + 600", "time.monotonic() + 2")
    worker = subprocess.Popen([sys.executable, "-c", parent, db_url], env=env, process_group=0)
    try:
        marks = wait_for(lambda: list(tmp_path.glob("H-1.*")), timeout=60, what="the child")
        child = int(marks[0].read_text())
        os.kill(worker.pid, signal.SIGSTOP)
        # its time runs from its worker's clock, before the mark: 2 s and the overrun
        # (and a margin for a loaded machine)
        wait_for(
            lambda: not alive(child),
            timeout=2 + CHILD_OVERRUN_SECONDS + 1,
            what="the frozen worker's child to end itself",
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
            os.kill(worker.pid, signal.SIGCONT)
        worker.wait(10)


@pytest.mark.parametrize("network_timeout", [10, 1])
def test_a_dead_childs_sessions_are_waited_for_past_the_attempt_deadline(
    db_url: str, db_engine: sa.Engine, network_timeout: int
) -> None:
    """The worker's warehouse sessions run under a statement timeout of the attempt
    deadline (1 s here). Ending a dead child's session waits for it to be gone (up to
    END_SESSIONS_SECONDS), and a backend slow to go (here stopped, let go after 2.5 s)
    must not cut that wait short at the deadline: the slot would be released while the
    child's query still ran. Nor may the client's own bound on a reply (the statement
    timeout plus ENRICHQ_NETWORK_TIMEOUT_SECONDS: 2 s with a 1 s network timeout)."""
    from enrichq_service.isolate import END_SESSIONS_SECONDS, _end_sessions

    name = "enrichq-isolated-slowtogo"
    child = sa.create_engine(
        sa.make_url(db_url).set(drivername="postgresql+psycopg"),
        connect_args={"application_name": name},
        poolclass=sa.pool.NullPool,
    )
    settings = make_settings(
        db_url, attempt_deadline_seconds=1, network_timeout_seconds=network_timeout
    )
    engine = warehouse_engine(settings, db_url, statement_timeout_seconds=1)
    conn = child.connect()
    try:

        def sleep() -> None:
            with contextlib.suppress(sa.exc.DBAPIError):  # its session is ended
                conn.execute(sa.text("SELECT pg_sleep(60)"))

        sleeper = threading.Thread(target=sleep, daemon=True)
        [(backend,)] = q(
            db_engine, "SELECT pid FROM pg_stat_activity WHERE application_name = :n", n=name
        )
        sleeper.start()
        wait_for(
            lambda: q(
                db_engine,
                "SELECT 1 FROM pg_stat_activity WHERE pid = :p AND state = 'active'",
                p=backend,
            ),
            what="the child's query",
        )
        os.kill(backend, signal.SIGSTOP)
        released = threading.Timer(2.5, lambda: os.kill(backend, signal.SIGCONT))
        released.start()
        began = time.monotonic()
        _end_sessions(engine, name)
        took = time.monotonic() - began
        still_there = alive(backend)  # before: cut short at 1 s, stopped, until 2.5 s
        released.join()
        assert not still_there, f"returned after {took:.1f} s with the session still there"
        assert took < END_SESSIONS_SECONDS + 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(backend, signal.SIGCONT)
        conn.close()
        child.dispose()
        engine.dispose()
