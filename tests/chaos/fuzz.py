"""The generative fault harness: random draws of plug-in behaviours, faults and settings
against a fleet of real `enrichq` processes, each held to the invariants at its end.

    python -m tests.chaos.fuzz [--draws N] [--seed S] [--skip-known] [--exclude NAME ...]
                               [--keep-logs]

Draw i uses seed S + i, and a seed alone reproduces a draw: what each ticket's plug-in
does (`tests.support.behaviours`), the settings, and which faults strike after which
pauses. A failing draw prints its seed, what broke, and a one-line command that runs it
again. Exit 0 when no draw broke an invariant, 1 otherwise.

A draw seeds a world of 30-120 tickets, gives each ticket a behaviour (most good; the rest
raise each kind of exception, hang deaf to cancellation, return invalid results, exit the
process...), runs 2-3 `enrichq worker`s (per-ticket plug-in, or batches of 1 or 50) and an
`enrichq sweep` with small leases and deadlines, budget and warehouse cap on or off, and
strikes them with SIGKILL, SIGSTOP/SIGCONT, SIGTERM to a process or its group, a database
restart, and a proxy that drops COMMIT replies or blackholes every connection. When the
queue is quiet it stops the fleet and checks (`check_draw`):

- every good ticket `done` with exactly the warehouse's orders, written once (an audit
  trigger sees every write); every bad one `failed` or dead-lettered with its reason;
  with a budget, any ticket may instead wait, deferred, for the budget's reset;
- no row left `leased`, and the queue's own invariants;
- the attempt that completed a ticket has its lookup logged with the bytes its plug-in
  returned; no ticket has more results or bytes logged than its plug-in calls returned,
  and, in a draw where no process or connection was lost, every returned call is logged
  once with its bytes;
- the budget ledger adds up to the lookup log; a budget is overspent by at most one
  lookup per worker process;
- never more warehouse queries at once than the cap (an observer samples
  `pg_stat_activity` every 10 ms);
- every process's exit code is the documented one: 0 for SIGTERM, -9 for SIGKILL, the
  plug-in's own code for a plug-in that exits, 1 only for one that started while the
  database was down.

KNOWN_DEFECTS lists behaviours, faults and conditions (CONDITIONS) that break an
invariant on the current code and are being fixed elsewhere; the CI test leaves them
out, `--skip-known` here too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from enrichq_schema.db import CLIENT_CHECK_INTERVAL_MS, create_engine
from enrichq_schema.states import LEASE_EXPIRED_ERROR
from enrichq_service.isolate import CHILD_OVERRUN_SECONDS, MIN_CHILD_SECONDS
from enrichq_service.worker.runtime import DEADLINE_EXCEEDED
from tests.chaos.scenarios import AUDIT
from tests.support.behaviours import BEHAVIOURS, EXIT_CODE, UNASKED_BYTES
from tests.support.commit_cutter import CommitCutter
from tests.support.db import q
from tests.support.pg import Databases
from tests.support.procs import alive, enrichq_env, spawn
from tests.support.tcpproxy import TcpProxy, target_of, via
from tests.support.web import free_port
from tests.support.world import seeded

FAULTS = (
    "sigkill",
    "sigkill_sweeper",
    "sigstop",
    "sigterm",
    "sigterm_group",
    "db_restart",
    "drop_claim_reply",
    "drop_settle_reply",
    "blackhole",
)
MODES = ("per_ticket", "batch_1", "batch_50")
# Combinations that KNOWN_DEFECTS (or --exclude) can name besides behaviours and faults.
CONDITIONS = ("admission_outage", "admission_wait", "deaf_hang_cap", "poison_in_batch")
# Faults that break the connections of the processes they strike.
OUTAGES = frozenset({"db_restart", "blackhole", "sigstop"})

# Behaviours and faults that break an invariant on the current code, each being fixed
# elsewhere: the CI test leaves them out until the fix is merged (then delete the line).
KNOWN_DEFECTS: frozenset[str] = frozenset()

SETTLE_TIMEOUT_SECONDS = 150.0
STOP_TIMEOUT_SECONDS = 30.0
MAX_ATTEMPTS = 8
# pauses between faults, seconds
FAULT_GAP = (0.3, 2.5)
CLAIM_TEXT = b"INSERT INTO enrichq.tenant_served"
SETTLE_TEXT = b"INSERT INTO enrichq.lookup_log"
BYTES = {"zero": 0, "normal": 1000, "enormous": 2**40}
# the cap observer's error on when a query began and when it saw it (it samples every 10 ms)
OBSERVER_SLACK_SECONDS = 0.5
ISOLATED_CHILD_SECONDS = 0.4  # one isolated child's start and answer (README, settings)


@dataclass(frozen=True)
class Draw:
    """Everything one run does, drawn from its seed."""

    seed: int
    tickets: int
    mode: str
    workers: int
    concurrency: int
    lease_seconds: float
    deadline_seconds: float
    slow_seconds: float
    budget: bool
    cap: int
    behaviours: tuple[str, ...]  # per ticket, in ticket order
    bytes: tuple[int, ...]  # what each ticket's good lookups bill
    faults: tuple[tuple[float, str], ...]  # (pause before it, kind)

    @property
    def unit_size(self) -> int:
        return 50 if self.mode == "batch_50" else 1

    @property
    def deadline_below_isolation(self) -> bool:
        """Is the attempt's deadline shorter than isolating a poison pill among a unit's
        suspects takes, as the README's settings table gives it (1 + 2 * ceil(log2 unit)
        children of about 0.4 s)? Then suspects' attempts end by the deadline."""
        children = 1 + 2 * math.ceil(math.log2(self.unit_size))
        return self.deadline_seconds < children * ISOLATED_CHILD_SECONDS

    @property
    def unasked_answers(self) -> bool:
        """Does a batch answer for tickets it was not asked about (billing the batch)?"""
        return self.mode != "per_ticket" and "extra_answers" in self.behaviours

    @property
    def process_loss(self) -> bool:
        """Can a process die on its own in this draw (a plug-in that exits)?"""
        return any(BEHAVIOURS[b].process_loss for b in self.behaviours)

    @property
    def lossy(self) -> bool:
        """Can a lookup that ran go unlogged (its process or its connection lost)?"""
        # a SIGTERM stops a worker after a grace: a deaf call still running is not waited for
        lossy_faults = {"sigkill", "db_restart", "blackhole", "sigstop", "sigterm", "sigterm_group"}
        return self.process_loss or any(kind in lossy_faults for _, kind in self.faults)

    def summary(self) -> str:
        counts: dict[str, int] = defaultdict(int)
        for b in self.behaviours:
            if b != "good":
                counts[b] += 1
        return (
            f"{self.tickets} tickets, {self.mode}, {self.workers} workers x {self.concurrency},"
            f" lease {self.lease_seconds:g} s, deadline {self.deadline_seconds:g} s,"
            f" budget {'on' if self.budget else 'off'}, cap {self.cap or 'off'};"
            f" faults {[k for _, k in self.faults]}; bad {dict(counts)}"
        )


def allowed(mode: str, exclude: frozenset[str]) -> list[str]:
    """The behaviours a draw in `mode` may give a ticket (their end state known)."""
    out = []
    for name, b in BEHAVIOURS.items():
        if name in exclude or name == "good":
            continue
        if b.batch_only and mode == "per_ticket":
            continue
        if b.per_ticket_only and mode != "per_ticket":
            continue
        # a deaf hang every time takes a batch's neighbours down with it, every time
        if name == "hang_always" and mode == "batch_50":
            continue
        if name == "exit_always" and mode == "batch_50" and "poison_in_batch" in exclude:
            continue
        out.append(name)
    return out


def draw(seed: int, *, exclude: frozenset[str] = frozenset()) -> Draw:
    """The draw of `seed`, without the behaviours and faults named in `exclude`."""
    rng = random.Random(seed)
    mode = rng.choice(MODES)
    tickets = rng.randint(30, 120)
    deadline = rng.choice([1.5, 3.0, 10.0])
    choices = allowed(mode, exclude)
    if deadline > 3:  # every attempt of a deaf hang lasts the deadline: keep draws short
        choices = [c for c in choices if c != "hang_always"]
    if mode == "batch_50" and deadline < 10:
        # isolating a poison pill among 50 suspects takes up to 1 + 2·⌈log2 50⌉ = 13 child
        # processes within one attempt (about 0.4 s each): a deadline under that can never
        # isolate it, and its neighbours spend their attempts (a documented limit of
        # ENRICHQ_ATTEMPT_DEADLINE_SECONDS, operations.md), not a defect the harness hunts
        choices = [c for c in choices if c != "exit_always"]
    bad_share = rng.uniform(0.05, 0.35)
    behaviours: list[str] = []
    rare = {"exit_once": 2, "exit_always": 1, "hang_once": 3, "hang_always": 2}
    for _ in range(tickets):
        name = "good"
        if choices and rng.random() < bad_share:
            name = rng.choice(choices)
            if name in rare:
                if rare[name] == 0:
                    name = "good"
                else:
                    rare[name] -= 1
        behaviours.append(name)
    bytes_mode = rng.choice([*BYTES, "mixed"])
    billed = tuple(
        BYTES[rng.choice(list(BYTES))] if bytes_mode == "mixed" else BYTES[bytes_mode]
        for _ in range(tickets)
    )
    kinds = [k for k in FAULTS if k not in exclude]
    faults = tuple(
        (round(rng.uniform(*FAULT_GAP), 2), rng.choice(kinds))
        for _ in range(rng.randint(0, 4) if kinds else 0)
    )
    lease = rng.choice([2.0, 3.0, 5.0])
    budget, cap = rng.random() < 0.3, rng.choice([0, 0, 1, 2, 3])
    if "admission_outage" in exclude and {k for _, k in faults} & OUTAGES:
        budget, cap = False, 0  # nothing to admit: the outage cannot reach an admission
    if "deaf_hang_cap" in exclude and cap:  # no deaf hang under a cap
        behaviours = ["good" if b.startswith("hang_") else b for b in behaviours]
    if "admission_wait" in exclude and (budget or cap):
        deadline = 10.0  # a wait for admission never outlasts the attempt
    return Draw(
        seed=seed,
        tickets=tickets,
        mode=mode,
        workers=rng.randint(2, 3),
        concurrency=rng.randint(2, 4),
        lease_seconds=lease,
        deadline_seconds=deadline,
        slow_seconds=rng.choice([0.0, 0.05, 0.2]),
        budget=budget,
        cap=cap,
        behaviours=tuple(behaviours),
        bytes=billed,
        faults=faults,
    )


# -- running a draw


@dataclass
class Proc:
    """One process of the fleet and what the harness did to it."""

    role: str
    popen: subprocess.Popen[bytes]
    started: float
    log: Path
    fate: str = "running"  # running, killed, terminated, died (on its own)
    code: int | None = None


@dataclass
class Result:
    """What one draw did and what broke."""

    draw: Draw
    exclude: frozenset[str] = frozenset()  # what the draw was drawn without
    faults: int = 0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)
    logs: Path | None = None

    def reproduce(self) -> str:
        """The command that runs this draw again."""
        rerun = f"python -m tests.chaos.fuzz --draws 1 --seed {self.draw.seed}"
        return f"{rerun} --exclude {' '.join(sorted(self.exclude))}" if self.exclude else rerun


class Observer:
    """Samples how many warehouse queries run at once, from pg_stat_activity: the workers'
    and their isolated children's (named `enrichq-isolated-…`), but for the statement by
    which a worker ends a dead child's sessions (`isolate_end_child_sessions`)."""

    def __init__(self, url: str, cap: int) -> None:
        self.engine = create_engine(url, pool_size=1)
        self.cap = cap
        # every sample of more queries than the cap: (time.monotonic(), the queries)
        self.over: list[tuple[float, list[tuple[Any, ...]]]] = []
        self.samples = 0
        self._lineages: dict[tuple[int, int], tuple[int, ...]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cap-observer", daemon=True)

    def _lineage(self, backend: int, port: int | None) -> tuple[int, ...]:
        """The process whose connection a backend serves, then its parent and theirs: a
        query is told a frozen worker's by its worker's pid in there (an isolated child's
        too). Empty when it cannot be told (a connection through the harness's proxy
        belongs to the harness)."""
        key = (backend, port or 0)
        if key not in self._lineages:
            self._lineages[key] = _lineage_of_port(port) if port else ()
        return self._lineages[key]

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                with self.engine.connect() as conn:
                    while not self._stop.wait(0.01):
                        running = conn.execute(
                            sa.text(
                                "SELECT pid, application_name, left(query, 40),"
                                " round(extract(epoch FROM now() - query_start)::numeric, 2),"
                                " client_port"
                                " FROM pg_stat_activity"
                                " WHERE datname = current_database() AND state = 'active'"
                                " AND (application_name = 'enrichq-warehouse'"
                                "      OR application_name LIKE 'enrichq-isolated-%')"
                                # a worker ending a dead child's sessions: no lookup
                                " AND query NOT LIKE '%pg_terminate_backend(%'"
                            )
                        ).all()
                        seen = time.monotonic()
                        conn.rollback()  # a new snapshot of pg_stat_activity each time
                        if self.cap and len(running) > self.cap:
                            self.over.append(
                                (seen, [(*r[:4], self._lineage(r[0], r[4])) for r in running])
                            )
                        self.samples += 1
            except sa.exc.SQLAlchemyError:
                continue  # the database restarts: sample again when it is back

    def __enter__(self) -> Observer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.engine.dispose()


def _lineage_of_port(port: int) -> tuple[int, ...]:
    """The pids, child first, of the process holding the local TCP socket of `port` on this
    host and of its ancestors (Linux /proc); empty if none is found."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    owner = None
    for proc in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                owner = int(proc.name)
                break
    lineage: list[int] = []
    while owner and owner > 1 and len(lineage) < 8:
        lineage.append(owner)
        try:
            stat = Path(f"/proc/{owner}/stat").read_text()
        except OSError:
            break
        owner = int(stat.rsplit(")", 1)[1].split()[1])
    return tuple(lineage)


class Harness:
    """The fleet of one draw, the faults it suffers, and the bookkeeping of its processes."""

    def __init__(
        self, d: Draw, engine: sa.Engine, url: str, logs: Path, rng: random.Random
    ) -> None:
        self.d = d
        self.engine = engine
        self.url = url
        self.logs = logs
        self.rng = rng
        self.procs: list[Proc] = []
        self.down: list[tuple[float, float]] = []  # windows the database was unreachable
        # windows a worker was SIGSTOPped: (from, to, its pid)
        self.frozen: list[tuple[float, float, int]] = []
        self.cut_off: list[tuple[float, float]] = []  # windows the fleet was blackholed
        self.faults = 0
        self.server: Any = None  # the private server, when the draw restarts it
        self.proxy: TcpProxy | None = None
        self.cutter: CommitCutter | None = None
        self._n = 0
        settings: dict[str, object] = {
            "lease_seconds": d.lease_seconds,
            "heartbeat_seconds": d.lease_seconds / 5,
            "poll_seconds": 0.2,
            "sweep_interval_seconds": 0.5,
            "backoff_base_seconds": 0.2,
            "backoff_cap_seconds": 1,
            "max_attempts": MAX_ATTEMPTS,
            "concurrency": d.concurrency,
            "attempt_deadline_seconds": d.deadline_seconds,
            "warehouse_max_concurrency": d.cap,
            "daily_bytes_budget": budget_of(d),
            "network_timeout_seconds": 2,
            "statement_timeout_seconds": 5,
            "ENRICHQ_TEST_BEHAVIOURS": logs / "behaviours.json",
            "ENRICHQ_TEST_MARKERS": logs / "markers",
            "ENRICHQ_TEST_CALLS": logs / "calls",
            "ENRICHQ_TEST_SLOW_SECONDS": d.slow_seconds,
        }
        if d.mode == "per_ticket":
            settings["enricher"] = "tests.support.behaviours:per_ticket"
        else:
            settings["batch_enricher"] = "tests.support.behaviours:batch"
            settings["lookup_batch_size"] = d.unit_size
        self.settings = settings

    def env(self, url: str) -> dict[str, str]:
        return enrichq_env(url, **self.settings)

    def start(self, role: str, fleet_url: str) -> Proc:
        self._n += 1
        args = ["worker"] if role == "worker" else ["sweep"]
        log = self.logs / f"{role}-{self._n}.log"
        p = spawn(args, self.env(fleet_url), log=log, new_session=True)
        proc = Proc(role, p, time.monotonic(), log)
        self.procs.append(proc)
        return proc

    def live(self, role: str) -> list[Proc]:
        """The running processes of `role`, each waited for until it is past its start-up
        (a process signalled while it still imports dies of it: SIGTERM, exit -15)."""
        running = [p for p in self.procs if p.fate == "running" and p.role == role]
        return [p for p in running if self.ready(p, timeout=20)]

    def ready(self, p: Proc, timeout: float = 0.0) -> bool:
        """Has `p` begun its run (its row in enrichq.runs, written once its signal
        handlers are in place)? Waits up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if q(
                    self.engine,
                    "SELECT count(*) FROM enrichq.runs WHERE owner LIKE :a OR owner LIKE :b",
                    a=f"%:{p.popen.pid}:%",
                    b=f"%:{p.popen.pid}",
                )[0][0]:
                    return True
            except sa.exc.SQLAlchemyError:
                pass
            if time.monotonic() >= deadline or p.popen.poll() is not None:
                return False
            time.sleep(0.1)

    def revive(self, fleet_url: str) -> None:
        """Note processes that exited on their own and start others in their place."""
        for p in list(self.procs):
            if p.fate == "running" and p.popen.poll() is not None:
                p.fate, p.code = "died", p.popen.returncode
                self.start(p.role, fleet_url)

    # -- faults

    def strike(self, kind: str, fleet_url: str) -> None:
        rng = self.rng
        workers = self.live("worker")
        if kind.startswith("sig") and kind != "sigkill_sweeper" and not workers:
            return
        if kind == "sigkill":
            victim = rng.choice(workers)
            victim.popen.kill()
            victim.popen.wait(10)
            victim.fate, victim.code = "killed", victim.popen.returncode
            self.start("worker", fleet_url)
        elif kind == "sigkill_sweeper":
            sweepers = self.live("sweeper")
            if not sweepers:
                return
            sweepers[0].popen.kill()
            sweepers[0].popen.wait(10)
            sweepers[0].fate, sweepers[0].code = "killed", sweepers[0].popen.returncode
            self.start("sweeper", fleet_url)
        elif kind == "sigstop":
            victim = rng.choice(workers)
            began = time.monotonic()
            os.kill(victim.popen.pid, signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 2 * self.d.lease_seconds))
            os.kill(victim.popen.pid, signal.SIGCONT)
            self.frozen.append((began, time.monotonic(), victim.popen.pid))
        elif kind in ("sigterm", "sigterm_group"):
            victim = rng.choice(workers)
            if kind == "sigterm":
                victim.popen.terminate()
            else:
                os.killpg(victim.popen.pid, signal.SIGTERM)
            try:
                victim.popen.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                victim.popen.kill()
                victim.popen.wait(10)
            victim.fate, victim.code = "terminated", victim.popen.returncode
            self.start("worker", fleet_url)
        elif kind == "db_restart":
            assert self.server is not None
            began = time.monotonic()
            self.server.stop(crash=rng.random() < 0.5)
            time.sleep(rng.uniform(0.3, 2.0))
            self.server.start()
            self.down.append((began, time.monotonic()))
        elif kind in ("drop_claim_reply", "drop_settle_reply"):
            assert self.cutter is not None
            self.cutter.arm(rng.randint(1, 3))
        elif kind == "blackhole":
            assert self.proxy is not None
            began = time.monotonic()
            self.proxy.blackhole()
            time.sleep(rng.uniform(0.5, 2 * self.d.lease_seconds))
            self.proxy.heal()
            self.down.append((began, time.monotonic()))
            self.cut_off.append((began, time.monotonic()))
        self.faults += 1

    def stop_all(self) -> None:
        """SIGTERM every running process (SIGCONT first) and note how each exited."""
        running = [p for p in self.procs if p.fate == "running"]
        for p in running:
            self.ready(p, timeout=10)
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.popen.pid, signal.SIGCONT)
                p.popen.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for p in running:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
                p.fate, p.code = "stopped", p.popen.returncode
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(10)
                p.fate, p.code = "hung at stop", p.popen.returncode
        for p in self.procs:  # their process groups too: isolated children left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.popen.pid, signal.SIGKILL)


def budget_of(d: Draw) -> int:
    """The draw's daily budget: about half of what its good lookups bill (0: none)."""
    if not d.budget:
        return 0
    return max(1, sum(b for b, name in zip(d.bytes, d.behaviours, strict=True)) // 2)


def quiet(engine: sa.Engine) -> bool:
    """No row leased, and none queued that becomes visible within a minute (a budget's
    deferral waits for the next day)."""
    try:
        return q(
            engine,
            "SELECT count(*) FROM enrichq.queue WHERE state = 'leased'"
            " OR (state = 'queued' AND visible_at < now() + interval '1 minute')",
        ) == [(0,)]
    except sa.exc.SQLAlchemyError:
        return False  # the database restarts


@contextlib.contextmanager
def database(d: Draw, databases: Databases) -> Iterator[tuple[str, Any]]:
    """The draw's database: a clone on the test server, or, when the draw restarts the
    database, a private server's (and the server)."""
    if not any(kind == "db_restart" for _, kind in d.faults):
        url = databases.clone(f"fuzz{d.seed}")
        try:
            yield url, None
        finally:
            databases.drop(url)
        return
    from enrichq_schema.db import ensure_database, migrate
    from enrichq_service.embedded_postgres import EmbeddedPostgres

    base = Path(tempfile.mkdtemp(prefix="enrichq-fuzz-pg-", dir="/tmp"))
    base.chmod(0o711)
    server = EmbeddedPostgres(base, port=free_port())
    try:
        url = ensure_database(server.start(), "enrichq")
        migrate(url)
        yield url, server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def run_draw(
    d: Draw, databases: Databases, logs: Path, exclude: frozenset[str] = frozenset()
) -> Result:
    """Run draw `d` (drawn without `exclude`) and check it; its result names every
    invariant it broke."""
    result = Result(d, exclude, logs=logs)
    rng = random.Random(d.seed * 7919 + 1)  # the faults' own choices (victims, durations)
    for folder in ("markers", "calls"):
        (logs / folder).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with database(d, databases) as (url, server):
        engine = create_engine(url)
        try:
            keys = seeded(engine, d.tickets, max_attempts=MAX_ATTEMPTS)
            with engine.begin() as conn:
                conn.execute(sa.text(AUDIT))
            table = {
                k: {"behaviour": b, "bytes": n}
                for k, b, n in zip(keys, d.behaviours, d.bytes, strict=True)
            }
            (logs / "behaviours.json").write_text(json.dumps(table))
            h = Harness(d, engine, url, logs, rng)
            h.server = server
            with contextlib.ExitStack() as stack:
                fleet_url = url
                kinds = {k for _, k in d.faults}
                if kinds & {"drop_claim_reply", "drop_settle_reply", "blackhole"}:
                    trigger = CLAIM_TEXT if "drop_claim_reply" in kinds else SETTLE_TEXT
                    h.cutter = stack.enter_context(CommitCutter(target_of(url), trigger, times=0))
                    h.proxy = stack.enter_context(TcpProxy(("127.0.0.1", h.cutter.port)))
                    fleet_url = via(h.proxy, url)
                observer = stack.enter_context(Observer(url, d.cap))
                try:
                    for _ in range(d.workers):
                        h.start("worker", fleet_url)
                    h.start("sweeper", fleet_url)
                    for pause, kind in d.faults:
                        until = time.monotonic() + pause
                        while time.monotonic() < until:
                            h.revive(fleet_url)
                            time.sleep(0.05)
                        if quiet(engine):
                            break
                        h.strike(kind, fleet_url)
                    settled = _settle(engine, h, fleet_url)
                    if not settled:
                        result.violations.append(
                            f"the queue did not settle within {SETTLE_TIMEOUT_SECONDS:g} s:"
                            f" {_open_rows(engine)}"
                        )
                    _calls_returned(logs, timeout=2 * d.deadline_seconds + 5)
                finally:
                    h.stop_all()
            result.faults = h.faults
            result.violations += check_draw(d, engine, keys, h, observer)
        finally:
            engine.dispose()
    result.seconds = time.monotonic() - started
    return result


def _settle(engine: sa.Engine, h: Harness, fleet_url: str) -> bool:
    deadline = time.monotonic() + SETTLE_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        h.revive(fleet_url)
        if quiet(engine):
            return True
        time.sleep(0.2)
    return False


def _open_rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    return q(
        engine,
        "SELECT state, left(last_error, 80), count(*) FROM enrichq.queue"
        " WHERE state IN ('queued', 'leased') GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 5",
    )


def _calls(logs: Path) -> tuple[dict[str, int], dict[str, list[int]], dict[int, int]]:
    """Each ticket's calls started, its returned calls (the bytes each billed), and each
    process's calls still running (started, not returned)."""
    starts: dict[str, int] = defaultdict(int)
    returned: dict[str, list[int]] = defaultdict(list)
    running: dict[int, int] = defaultdict(int)
    for path in (logs / "calls").glob("*.calls"):
        pid = int(path.stem)
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.split(" ")
            if parts[0] == "start" and len(parts) == 2:
                running[pid] += 1
                starts[parts[1]] += 1
            elif parts[0] == "end" and len(parts) == 3:
                running[pid] -= 1
                returned[parts[1]].append(int(parts[2]))
    return starts, returned, running


def _calls_returned(logs: Path, *, timeout: float) -> None:
    """Wait (bounded) until every plug-in call of a live process has returned: a call
    abandoned by its attempt may still be running when the queue is quiet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, _, running = _calls(logs)
        if not any(n > 0 and alive(pid) for pid, n in running.items()):
            return
        time.sleep(0.1)


# -- the invariants


def _lookups(engine: sa.Engine, ticket: str) -> list[tuple[Any, ...]]:
    return q(
        engine,
        "SELECT attempt, status, bytes_billed, left(error, 80) FROM enrichq.lookup_log"
        " WHERE ticket_id = :t ORDER BY id",
        t=ticket,
    )


def check_draw(
    d: Draw, engine: sa.Engine, keys: list[str], h: Harness, observer: Observer
) -> list[str]:
    """Every invariant the draw broke, one line each."""
    behaviour = dict(zip(keys, d.behaviours, strict=True))
    bad = _check_tickets(d, engine, behaviour)
    bad += _check_queue(engine)
    bad += _check_lookups(d, engine, behaviour, h.logs)
    bad += _check_ledger(d, engine, workers=sum(p.role == "worker" for p in h.procs))
    bad += _check_cap(d, h, observer)
    bad += _check_exits(d, h)
    return bad


def _check_cap(d: Draw, h: Harness, observer: Observer) -> list[str]:
    """Never more warehouse queries at once than the cap, but for those a freeze (SIGSTOP)
    or a partition (the proxy's blackhole) leaves running: a worker's slot expires a lease
    after its last heartbeat while its query runs on until its statement timeout ends it
    (the attempt deadline: docs/operations.md), or, in an isolated child (which a freeze
    does not stop), until the child ends itself CHILD_OVERRUN_SECONDS later (its time is at
    least MIN_CHILD_SECONDS) and the server notices (the client check). So within that
    reach of a window's start, a query is excused if it is the frozen worker's or its
    child's (told by the process that holds its connection), or, in a partition, or where
    the process cannot be told (a connection through the proxy), if it began before the
    window. A killed worker's query ends with it (`db.CLIENT_CHECK_INTERVAL_MS`)."""
    reach = (
        max(d.deadline_seconds, MIN_CHILD_SECONDS)
        + CHILD_OVERRUN_SECONDS
        + CLIENT_CHECK_INTERVAL_MS / 1000
        + OBSERVER_SLACK_SECONDS
    )

    def within(began: float, seen: float) -> bool:
        return began <= seen <= began + reach

    def excusable(r: tuple[Any, ...], seen: float) -> bool:
        started, lineage = seen - float(r[3]), r[4]
        frozen = [(b, pid) for b, _, pid in h.frozen if within(b, seen)]
        # begun before a partition, or before a freeze where its process is not told
        before = [b for b, _ in h.cut_off if within(b, seen)]
        before += [b for b, _ in frozen if not lineage]
        return any(pid in lineage for _, pid in frozen) or any(
            started <= b + OBSERVER_SLACK_SECONDS for b in before
        )

    for seen, running in observer.over:
        excused = [r for r in running if excusable(r, seen)]
        if len(running) - len(excused) > d.cap:
            return [
                f"{len(running)} warehouse queries at once, cap {d.cap}"
                f"{f' ({len(excused)} of a frozen or cut-off worker)' if excused else ''}:"
                f" (pid, application, query, seconds running, process lineage) {running}"
            ]
    return []


def _orders(engine: sa.Engine, sql: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for ticket, order in q(engine, sql):
        out[ticket].add(order)
    return out


def _check_tickets(d: Draw, engine: sa.Engine, behaviour: dict[str, str]) -> list[str]:
    """Each ticket's end state against its behaviour's; results written once, and only
    for good tickets."""
    rows = {
        r[0]: r[1:]
        for r in q(
            engine,
            "SELECT key, state, dead_reason, last_error,"
            " visible_at > now() + interval '1 minute' FROM enrichq.queue WHERE kind = 'enrich'",
        )
    }
    got = _orders(engine, "SELECT ticket_id, order_id FROM enrichq.ticket_orders")
    expected = _orders(
        engine,
        "SELECT t.id, o.order_id FROM helpdesk.tickets t"
        " JOIN warehouse.customers c ON lower(c.email) = lower(t.requester_email)"
        " JOIN warehouse.orders o ON o.customer_id = c.customer_id",
    )
    written = dict(q(engine, "SELECT ticket_id, count(*) FROM public.result_writes GROUP BY 1"))
    wrong: dict[str, list[str]] = defaultdict(list)
    for key, name in behaviour.items():
        b = BEHAVIOURS[name]
        if key not in rows:
            wrong[name].append(f"{key}: no queue row")
            continue
        state, dead_reason, last_error, deferred = rows[key]
        if d.budget and state == "queued" and deferred:
            continue  # waits for the budget's reset
        why = None
        if state not in b.states:
            why = f"{state} ({dead_reason}: {str(last_error)[:100]})"
        elif state == "done" and got.get(key, set()) != expected.get(key, set()):
            why = "done with other orders than the warehouse's"
        elif state == "dead_letter" and dead_reason != "attempts_exhausted":
            why = f"dead-lettered as {dead_reason}"
        elif state != "done" and not (
            last_error
            and (
                b.names_reason(last_error)
                # its last attempt lost with its worker or connection (the lease expired,
                # attempts count at claim): dead-lettered for that, its own reason unseen
                or (d.lossy and state == "dead_letter" and last_error == LEASE_EXPIRED_ERROR)
                # or stopped by a deadline too short for its unit's suspects, as documented
                or (
                    d.deadline_below_isolation
                    and state == "dead_letter"
                    and last_error.startswith(DEADLINE_EXCEEDED.split("{", 1)[0])
                )
            )
        ):
            why = f"{state}, last_error {str(last_error)[:100]!r}"
        elif not b.good and (written.get(key) or got.get(key)):
            why = f"{state} with a result written"
        elif written.get(key, 0) > 1:
            why = f"written {written[key]} times"
        if why:
            wrong[name].append(f"{key} {why}")
    bad = [
        f"behaviour {name}: {len(examples)} tickets wrong, e.g. {examples[0]}"
        for name, examples in sorted(wrong.items())
    ]
    strays = [t for t in {*got, *written} if t not in behaviour]
    if strays:
        bad.append(f"results written for tickets not in the world: {strays[:3]}")
    return bad


def _check_queue(engine: sa.Engine) -> list[str]:
    """No row left leased; at most one queued row per key; attempts within their bound."""
    leased, doubled, over = q(
        engine,
        "SELECT (SELECT count(*) FROM enrichq.queue WHERE state = 'leased'),"
        " (SELECT count(*) FROM (SELECT key FROM enrichq.queue WHERE state = 'queued'"
        "  GROUP BY kind, key HAVING count(*) > 1) a),"
        " (SELECT count(*) FROM enrichq.queue WHERE attempts > max_attempts)",
    )[0]
    bad = [f"{leased} rows left leased"] if leased else []
    if doubled or over:
        bad.append(f"{doubled} keys with two queued rows, {over} rows past max_attempts")
    return bad


def _check_lookups(d: Draw, engine: sa.Engine, behaviour: dict[str, str], logs: Path) -> list[str]:
    """The lookup log against what the plug-in did: the completing attempt logged with its
    bytes; never more results or bytes logged than calls returned; in a draw that lost
    nothing, every returned call logged with its bytes. (An attempt whose isolated child
    died or ran out of time before its whole answer was read is logged as an error of 0
    bytes, whether its plug-in ran or not.)"""
    billed = dict(zip(behaviour, d.bytes, strict=True))
    starts, returned, _ = _calls(logs)
    for ticket, n in q(
        engine,
        "SELECT q.key, l.bytes_billed FROM enrichq.queue q LEFT JOIN enrichq.lookup_log l"
        " ON l.queue_id = q.id AND l.claim_token = q.claim_token WHERE q.state = 'done'",
    ):
        # a batch that answered for tickets it was not asked about bills its tickets a
        # share of those answers' bytes besides their own: what one of its calls returned
        expected = set(returned[ticket]) if d.unasked_answers else {billed[ticket]}
        if n not in expected:
            return [
                f"{ticket} ({behaviour[ticket]}): the attempt that completed it logged"
                f" {'no lookup' if n is None else f'{n} bytes'}; it billed"
                f" {' or '.join(map(str, sorted(expected))) or 'nothing'}"
            ]
    logged: dict[str, list[int]] = defaultdict(list)
    charged: dict[str, int] = defaultdict(int)  # rows that record a call's result or bytes
    for ticket, n, status in q(
        engine, "SELECT ticket_id, bytes_billed, status FROM enrichq.lookup_log"
    ):
        logged[ticket].append(int(n))
        charged[ticket] += status in ("ok", "empty") or n > 0
    for ticket in sorted({*logged, *returned}):
        mine, ran = logged[ticket], returned[ticket]
        if charged[ticket] > len(ran) or (
            not d.lossy and (len(mine) < len(ran) or sum(mine) != sum(ran))
        ):
            return [
                f"{ticket} ({behaviour.get(ticket)}): {len(mine)} lookups of {sum(mine)} bytes"
                f" logged; its plug-in ran {starts[ticket]} times, returned {len(ran)} of"
                f" {sum(ran)} bytes{'' if d.lossy else ' (nothing was lost in this draw)'};"
                f" logged (attempt, status, bytes, error): {_lookups(engine, ticket)}"
            ]
    return []


def _check_ledger(d: Draw, engine: sa.Engine, *, workers: int) -> list[str]:
    """The ledger adds up to the log; a budget overspent by at most a lookup per worker."""
    ledger_bytes, ledger_lookups, log_bytes, log_lookups = q(
        engine,
        "SELECT (SELECT coalesce(sum(bytes_billed), 0) FROM enrichq.budget_ledger),"
        " (SELECT coalesce(sum(lookups), 0) FROM enrichq.budget_ledger),"
        " (SELECT coalesce(sum(bytes_billed), 0) FROM enrichq.lookup_log),"
        " (SELECT count(*) FROM enrichq.lookup_log)",
    )[0]
    bad = []
    if (ledger_bytes, ledger_lookups) != (log_bytes, log_lookups):
        bad.append(
            f"ledger {ledger_bytes} bytes / {ledger_lookups} lookups,"
            f" log {log_bytes} bytes / {log_lookups} lookups"
        )
    budget = budget_of(d)
    # one call's bytes: its tickets' own, and what answers it was not asked for billed
    unit = d.unit_size * max(d.bytes) + (2 * UNASKED_BYTES if d.unasked_answers else 0)
    if budget and ledger_bytes > budget + workers * unit:
        bad.append(
            f"budget {budget} overspent: {ledger_bytes} billed, more than one lookup"
            f" ({unit}) for each of {workers} worker processes"
        )
    return bad


def _check_exits(d: Draw, h: Harness) -> list[str]:
    """Every process exited as documented: 0 on SIGTERM, -9 on SIGKILL, a plug-in's own
    exit code, 1 only for one whose start-up found the database unreachable."""
    bad = []
    for p in h.procs:
        ok = {"killed": {-9}, "terminated": {0}, "stopped": {0}}.get(p.fate, set())
        if p.role == "worker" and d.process_loss:
            # the plug-in's exit, also while the worker was stopping, or just before a
            # SIGKILL meant for it (the victim was chosen alive, and exited first)
            ok = ok | {EXIT_CODE}
        if p.fate == "died" and any(a - 5 <= p.started <= b for a, b in h.down):
            ok = ok | {1}  # its start-up found the database unreachable
        if p.code not in ok:
            bad.append(f"{p.role} {p.log.name} {p.fate} with exit code {p.code}")
    return bad


# -- the command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--skip-known", action="store_true", help="leave out KNOWN_DEFECTS, as CI does"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep every draw's logs")
    parser.add_argument(
        "--exclude",
        nargs="*",
        default=[],
        choices=sorted([*BEHAVIOURS, *FAULTS, *CONDITIONS]),
        metavar="NAME",
        help="behaviours and faults to leave out of the draws",
    )
    args = parser.parse_args(argv)
    exclude = frozenset(args.exclude) | (KNOWN_DEFECTS if args.skip_known else frozenset())
    results = run_draws(range(args.seed, args.seed + args.draws), exclude, keep=args.keep_logs)
    failed = [r for r in results if r.violations]
    print(
        f"{len(results)} draws, {sum(r.faults for r in results)} faults injected,"
        f" violations: {sum(len(r.violations) for r in results)}"
    )
    return 1 if failed else 0


def run_draws(
    seeds: range | list[int], exclude: frozenset[str], *, keep: bool = False
) -> list[Result]:
    """Run the draws of `seeds` on the test server, printing each as it ends."""
    admin = os.environ.get(
        "ENRICHQ_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    dbs = Databases(admin)
    dbs.create_template()
    results = []
    try:
        for seed in seeds:
            results.append(run_one(seed, dbs, exclude, keep=keep))
    finally:
        dbs.drop_all()
    return results


def run_one(seed: int, dbs: Databases, exclude: frozenset[str], *, keep: bool = False) -> Result:
    """Run the draw of `seed` in a log folder of its own (kept when it fails); print it."""
    d = draw(seed, exclude=exclude)
    logs = Path(tempfile.mkdtemp(prefix=f"enrichq-fuzz-{seed}-"))
    result = run_draw(d, dbs, logs, exclude)
    print(describe(result), flush=True)
    if not result.violations and not keep:
        shutil.rmtree(logs, ignore_errors=True)
    return result


def describe(r: Result) -> str:
    """One draw's outcome: one line when it held, its violations and how to rerun if not."""
    head = f"seed {r.draw.seed}: {r.draw.summary()}; {r.faults} faults, {r.seconds:.0f} s"
    if not r.violations:
        return f"{head}: ok"
    lines = [f"{head}: {len(r.violations)} VIOLATIONS (logs {r.logs})"]
    lines += [f"  - {v}" for v in r.violations]
    lines.append(f"  reproduce: {r.reproduce()}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
