"""Run enrichments in a child process, so that a crash (a poison pill) costs only the job
that caused it: the suspects of a unit run in one child, halved until the job that kills
its child runs alone."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from enrichq_schema.connections import warehouse_engine
from enrichq_schema.pooling import longer_replies
from enrichq_schema.settings import Settings
from enrichq_schema.states import LEASE_EXPIRED_ERROR
from enrichq_service.enrich import (
    ABORTED,
    SQL,
    EnrichContext,
    Enrichment,
    Order,
    PluginAborted,
    Surcharge,
    Ticket,
    choose,
    enrich_all,
    error_text,
    validate,
)
from enrichq_service.errors import Deferral, PermanentError, TransientError

log = logging.getLogger(__name__)

CHILD_DIED = "isolated enrichment process died"
CHILD_RAN_PAST = "isolated enrichment ran past"
CANCELLED = "isolated enrichment stopped: its attempt was abandoned or its lease lost"
# what the worker adds to the error of an isolated attempt it stopped itself (its deadline
# passed, the worker shut down): the job stays a suspect, its innocence never shown
STOPPED_ISOLATED = "while isolated"
# the least time a child is given, even past the deadline: enough to start and answer
MIN_CHILD_SECONDS = 1.0
# what every isolated child's warehouse sessions are named after (and a suffix of its own)
APPLICATION_NAME = "enrichq-isolated"
# how long ending a dead child's warehouse sessions may wait for each to be gone
END_SESSIONS_SECONDS = 5.0
# the most warehouse sessions a child has (its engine: a pool of 1, as many overflowing)
CHILD_SESSIONS = 2
# how often a child checks that its worker is still there
PARENT_CHECK_SECONDS = 0.5
# how long past its time a child may run before it ends itself: its worker stops it at its
# time, unless the worker is frozen (then only the child can)
CHILD_OVERRUN_SECONDS = 1.0
# how long reading a killed child's pipe to its end may take
REAP_SECONDS = 5.0
# the stop signals of a process group, which a child leaves to its parent
GROUP_STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})

Outcomes = dict[str, Enrichment | BaseException | Surcharge]


def is_suspect(attempts: int, last_error: str | None, max_attempts: int | None = None) -> bool:
    """Did this job's previous attempt end with its process vanishing, or may it have?"""
    error = last_error or ""
    vanished = error == LEASE_EXPIRED_ERROR or CHILD_DIED in error
    # a child that ran out of the attempt's time, or that the worker stopped (its deadline,
    # its shutdown), may have been halving around a poison pill that was never isolated:
    # its tickets stay suspects, or the next attempt would run them in-process beside it.
    # Except on the last attempt: a ticket whose child cannot answer within the deadline
    # (a child's start and its batch take longer) is run in-process then, not
    # dead-lettered for being slow to isolate
    inconclusive = CHILD_RAN_PAST in error or STOPPED_ISOLATED in error
    last = max_attempts is not None and attempts >= max_attempts
    return attempts > 1 and (vanished or ABORTED in error or (inconclusive and not last))


def enrich_in_child(context: EnrichContext, tickets: Sequence[Ticket]) -> Outcomes:
    """Each ticket's outcome by ticket id, from the configured enricher run in child
    processes: one for them all, its tickets halved each time a child dies."""
    if not tickets:
        return {}
    try:
        outcomes = _run_child(context, tickets)
    except _ChildDied as died:
        if len(tickets) == 1:
            return {
                tickets[0].id: TransientError(
                    f"{CHILD_DIED} (exit {died.code}); the previous attempt lost its process too"
                )
            }
        log.warning(
            "an isolated enrichment of %d tickets died (exit %d): each half gets a process "
            "of its own",
            len(tickets),
            died.code,
        )
    else:
        aborted = [v for v in outcomes.values() if isinstance(v, PluginAborted) and v.shared]
        if not aborted or len(tickets) == 1:
            return outcomes
        log.warning(
            "an isolated batch enrichment of %d tickets raised %s: each half gets a process "
            "of its own",
            len(tickets),
            aborted[0],
        )
    half = len(tickets) // 2
    return {
        **enrich_in_child(context, tickets[:half]),
        **enrich_in_child(context, tickets[half:]),
    }


class _ChildDied(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _run_child(context: EnrichContext, tickets: Sequence[Ticket]) -> Outcomes:
    """The outcomes of one child that enriches `tickets`; _ChildDied if it dies on its own."""
    seconds = context.remaining_seconds()
    timeout = None if seconds is None else max(MIN_CHILD_SECONDS, seconds)
    name = f"{APPLICATION_NAME}-{uuid.uuid4().hex[:12]}"
    request = {
        "settings": json.loads(context.settings.model_dump_json()),
        "warehouse_url": context.warehouse.url.render_as_string(hide_password=False),
        "application_name": name,
        "seconds": timeout,
        "ends_by": None if timeout is None else time.monotonic() + timeout + CHILD_OVERRUN_SECONDS,
        "tickets": [_ticket_json(t) for t in tickets],
        "parent": os.getpid(),
    }
    # stderr is the worker's: whatever a dying child says lands in the worker's log. The
    # child starts with the group's stop signals blocked (a blocked mask survives fork and
    # exec), so none can kill it before it has installed its own handlers for them.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_STOP_SIGNALS)
    try:
        # a process group of its own, killed whole: a helper the plug-in forked holds the
        # answer pipe, and would keep the call waiting for it to exit
        proc = subprocess.Popen(
            [sys.executable, "-m", "enrichq_service.isolate"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            process_group=0,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    stopped = threading.Event()

    def end_group() -> None:
        proc.wait()
        _kill(proc)  # what its plug-in left behind, which may hold the answer pipe

    threading.Thread(target=end_group, name="enrichq-isolated-reaper", daemon=True).start()

    def stop() -> None:
        stopped.set()
        _kill(proc)

    try:
        with context.interruptible(stop):
            out, _ = proc.communicate(json.dumps(request).encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out = _reap(proc)
        _end_sessions(context.warehouse, name)
        # an answer written in time, by a child that lingered after it (a thread its
        # plug-in left running): its lookups ran and billed, and are charged as they came
        return _answered(out, tickets) or _each(
            tickets, TransientError(f"{CHILD_RAN_PAST} {timeout:g} s")
        )
    if stopped.is_set():
        _end_sessions(context.warehouse, name)
        # the same for an answer read before the stop (the attempt abandoned, the lease
        # lost): what lands of it is the worker's to say, what it cost is charged
        return _answered(out, tickets) or _each(tickets, TransientError(CANCELLED))
    answered = _answered(out, tickets) if proc.returncode == 0 else None
    if answered is None:
        _end_sessions(context.warehouse, name)
        raise _ChildDied(proc.returncode)
    return answered


def _answered(out: bytes, tickets: Sequence[Ticket]) -> Outcomes | None:
    """Each ticket's outcome from a child's whole answer; None if it answered not at all or
    not for every ticket."""
    answers = _answers(out)
    if answers is None or not all(t.id in answers for t in tickets):
        return None
    return {t.id: _outcome(answers[t.id]) for t in tickets}


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the child's process group: the child and what its plug-in started."""
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(proc.pid, signal.SIGKILL)


def _reap(proc: subprocess.Popen[bytes]) -> bytes:
    """Wait for a killed child, its output read to the end (a few seconds at most: a
    process that left its group may still hold the pipe, and is not waited for); what it
    wrote, or nothing if its pipe did not end."""
    try:
        out, _ = proc.communicate(timeout=REAP_SECONDS)
    except subprocess.TimeoutExpired:
        assert proc.stdout is not None
        proc.stdout.close()
        proc.wait()
        return b""
    return out or b""


def _answers(out: bytes) -> dict[str, Any] | None:
    """Each ticket's answer from a child's output, or None if it gave none (it ended, with
    exit 0, before answering)."""
    try:
        answers = json.loads(out)["outcomes"]
    except (ValueError, KeyError, TypeError):
        return None
    return answers if isinstance(answers, dict) else None


def _end_sessions(warehouse: sa.Engine, name: str) -> None:
    """End the warehouse sessions of the child named `name`, and wait (a few seconds at
    most) for them to be gone: a child killed mid-query leaves its query running on the
    server, which would otherwise go on beside the lookup its released slot admits next.
    Only PostgreSQL names its sessions; on other warehouses the child's connections die
    with it, or cannot be reached from here (BigQuery's jobs run on)."""
    if warehouse.dialect.name != "postgresql":
        return
    try:
        # each session is waited for in turn
        wait = END_SESSIONS_SECONDS * CHILD_SESSIONS + 1
        with warehouse.connect() as conn, longer_replies(conn, wait):
            # its wait, not the attempt deadline the worker's warehouse sessions run under
            # (nor the client's bound on a reply, which that deadline sets)
            conn.execute(
                SQL("enrich_statement_timeout"),
                {"timeout_ms": str(int(wait * 1000))},
            )
            ended = conn.execute(
                SQL("isolate_end_child_sessions"),
                {"name": name, "timeout_ms": int(END_SESSIONS_SECONDS * 1000)},
            ).all()
            conn.commit()
    except Exception as exc:  # best effort: the statement timeout still bounds the query
        log.warning("could not end the warehouse sessions of %s: %s", name, error_text(exc))
        return
    if not all(r.gone for r in ended):
        log.warning(
            "the warehouse sessions of %s were still there after %g s", name, END_SESSIONS_SECONDS
        )


def _each(tickets: Sequence[Ticket], error: BaseException) -> Outcomes:
    return {t.id: error for t in tickets}


def _outcome(answer: dict[str, Any]) -> Enrichment | BaseException | Surcharge:
    """A ticket's outcome from the child's answer for it."""
    surcharge = answer.get("surcharge")
    if surcharge is not None:
        inner = _outcome({k: v for k, v in answer.items() if k != "surcharge"})
        assert not isinstance(inner, Surcharge)
        return Surcharge(inner, int(surcharge["bytes_billed"]), surcharge.get("job_id"))
    error = answer.get("error")
    if error == "permanent":
        return PermanentError(answer["message"])
    if error == "defer":
        return Deferral(datetime.fromisoformat(answer["until"]), answer["message"])
    if error == "transient":
        return TransientError(answer["message"])
    if error == "aborted":
        return PluginAborted(answer["message"], shared=bool(answer["shared"]))
    return Enrichment(
        tuple(
            Order(
                o["order_id"],
                o.get("customer_id"),
                datetime.fromisoformat(o["placed_at"]) if o.get("placed_at") else None,
                Decimal(o["total"]) if o.get("total") is not None else None,
            )
            for o in answer["orders"]
        ),
        job_id=answer.get("job_id"),
        bytes_billed=int(answer.get("bytes_billed", 0)),
    )


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _ticket_json(ticket: Ticket) -> dict[str, Any]:
    return {
        "id": ticket.id,
        "requester_email": ticket.requester_email,
        "tenant": ticket.tenant,
        "created_at": _iso(ticket.created_at),
        "updated_at": _iso(ticket.updated_at),
    }


def _ticket(t: dict[str, Any]) -> Ticket:
    return Ticket(
        t["id"],
        t["requester_email"],
        t["tenant"],
        datetime.fromisoformat(t["created_at"]) if t["created_at"] else None,
        datetime.fromisoformat(t["updated_at"]) if t["updated_at"] else None,
    )


def _answer(outcome: object) -> dict[str, Any]:
    """The child's answer for one ticket: its validated enrichment, or its error's kind
    (and a surcharge's bytes)."""
    if isinstance(outcome, Surcharge):
        answer = _answer(outcome.value)
        answer["surcharge"] = {"bytes_billed": outcome.bytes_billed, "job_id": outcome.job_id}
        return answer
    if isinstance(outcome, Deferral):
        return {"error": "defer", "message": str(outcome), "until": outcome.until.isoformat()}
    if isinstance(outcome, PermanentError):
        return {"error": "permanent", "message": str(outcome)}
    if isinstance(outcome, PluginAborted):
        return {"error": "aborted", "message": str(outcome), "shared": outcome.shared}
    if isinstance(outcome, BaseException):
        return {"error": "transient", "message": f"{type(outcome).__name__}: {outcome}"}
    try:
        result = validate(outcome)
    except PermanentError as exc:
        return {"error": "permanent", "message": str(exc)}
    return {
        "orders": [
            {
                "order_id": o.order_id,
                "customer_id": o.customer_id,
                "placed_at": _iso(o.placed_at),
                "total": None if o.total is None else str(o.total),
            }
            for o in result.orders
        ],
        "job_id": result.job_id,
        "bytes_billed": result.bytes_billed,
    }


def _leave_stops_to_the_parent() -> None:
    """Ignore the stop signals a process group gets (blocked since the fork, see
    `_run_child`). A handler that does nothing, not SIG_IGN: an ignored signal would stay
    ignored in the processes a plug-in starts."""
    for signum in GROUP_STOP_SIGNALS:
        signal.signal(signum, _ignore)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_STOP_SIGNALS)


def _ignore(signum: int, frame: object) -> None:
    log.info("isolated enrichment: %s ignored, its worker stops it", signal.Signals(signum).name)


def _answer_channel() -> int:
    """The pipe the parent reads the answer from, moved off fd 1 to a descriptor that no
    process started here inherits; fd 1 (and sys.stdout) then write to stderr."""
    sys.stdout.flush()
    channel = os.dup(1)
    try:
        os.dup2(2, 1)
    except OSError:  # no stderr to log to: what a plug-in prints is dropped
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    return channel


def _end_with_the_parent(parent: int, ends_by: float | None) -> None:
    """Kill this child's process group (it leads one: `_run_child`) once its worker is
    gone, however it went (a SIGKILL to it or to its group): no one would read the answer,
    or end the query, of a plug-in that hangs on. Likewise at `ends_by` (time.monotonic(),
    the same clock in every process of the host; None: never), CHILD_OVERRUN_SECONDS past
    the time its worker gave it: the worker stops it then, unless the worker is frozen,
    and a plug-in's queries would run on beside the lookups its expired slot lets in."""

    def watch() -> None:
        while os.getppid() == parent:
            left = PARENT_CHECK_SECONDS if ends_by is None else ends_by - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(PARENT_CHECK_SECONDS, left))
        os.killpg(os.getpgrp(), signal.SIGKILL)

    if os.getpgrp() == os.getpid():
        threading.Thread(target=watch, name="enrichq-parent-watch", daemon=True).start()


def _child() -> int:
    """The child's side: read the request, run the enricher, write the answer."""
    _leave_stops_to_the_parent()
    channel = _answer_channel()
    request = json.loads(sys.stdin.buffer.read())
    seconds = request["seconds"]
    _end_with_the_parent(request["parent"], request["ends_by"])
    settings = Settings.model_validate(request["settings"])
    deadline = None if seconds is None else time.monotonic() + seconds
    # the worker's pool mode and network timeouts, as for every enrichq engine
    warehouse = warehouse_engine(
        settings,
        request["warehouse_url"],
        application_name=request["application_name"],
        pool_size=CHILD_SESSIONS // 2,
        statement_timeout_seconds=seconds,  # none of its queries outlives the child's time
    )
    try:
        outcomes = enrich_all(
            choose(settings),
            [_ticket(t) for t in request["tickets"]],
            EnrichContext(settings, warehouse, deadline=deadline),
        )
    finally:
        warehouse.dispose()
    answer = json.dumps({"outcomes": {k: _answer(v) for k, v in outcomes.items()}})
    with os.fdopen(channel, "wb") as out:
        out.write(answer.encode())
    return 0


if __name__ == "__main__":
    code = _child()
    # answered (its channel closed): the child ends now, without waiting for what its
    # plug-in left behind (a thread that runs on would keep the answer from its worker
    # until the attempt's time ran out; its process group is killed after it anyway)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
