"""The built-in lookup on BigQuery, through BigQuery's own client (sqlalchemy-bigquery,
google-cloud-bigquery), against the bqemulator on loopback behind a thin fault layer
(tests/support/bigquery.py): what it bills, how it is bounded, cancelled and charged, how
BigQuery's errors are mapped, and that the worker starts only with usable credentials and
tables (issue 30)."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from tests.support.bigquery import (
    MIN_BYTES_BILLED,
    PROJECT,
    Emulator,
    Fault,
    FaultLayer,
    TokenServer,
    credentials_file,
)
from tests.support.db import q
from tests.support.procs import enrichq_env, spawn, stop, wait_for
from tests.support.settings import make_settings
from tests.support.world import enqueue, ticket_ids

from enrichq_schema.db import create_warehouse_engine
from enrichq_schema.settings import Settings
from enrichq_service import seed
from enrichq_service.bigquery import quota_reset
from enrichq_service.enrich import EnrichContext, charge_of, read_tickets, warehouse_lookup_batch
from enrichq_service.errors import Deferral, PermanentError, TransientError
from enrichq_service.worker import Worker

URL = f"bigquery://{PROJECT}"
_datasets = itertools.count()


@pytest.fixture(scope="session")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with Emulator(tmp_path_factory.mktemp("bqemulator")) as emu:
        yield emu


@pytest.fixture(scope="session")
def credentials(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with TokenServer() as tokens:
        yield credentials_file(tmp_path_factory.mktemp("gcp") / "key.json", tokens.url)


@pytest.fixture
def layer(emulator: Emulator) -> Iterator[FaultLayer]:
    with FaultLayer(emulator.url) as fl:
        yield fl


@pytest.fixture
def bq_env(layer: FaultLayer, credentials: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The client reaches the emulator through the fault layer, with the test's key."""
    env = {"BIGQUERY_EMULATOR_HOST": layer.url, "GOOGLE_APPLICATION_CREDENTIALS": str(credentials)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def warehouse(bq_env: dict[str, str]) -> Iterator[sa.Engine]:
    engine = create_warehouse_engine(URL, pool_size=2)
    yield engine
    engine.dispose()


def client(engine: sa.Engine) -> Any:
    from enrichq_service.bigquery import client_of

    with engine.connect() as conn:
        return client_of(conn)


SCHEMA = {
    "customers": "customer_id STRING, email STRING",
    "orders": "order_id STRING, customer_id STRING, placed_at TIMESTAMP, total NUMERIC",
}


def load(engine: sa.Engine, rows: dict[str, list[dict[str, Any]]], schema: dict[str, str]) -> str:
    """A new dataset holding `rows` per table; its name."""
    bq = client(engine)
    dataset = f"wh_{next(_datasets)}_{int(time.time() * 1000) % 10**8}"
    bq.create_dataset(f"{PROJECT}.{dataset}")
    for table, columns in schema.items():
        bq.query(f"CREATE TABLE `{dataset}`.`{table}` ({columns})").result()
        if rows.get(table):
            errors = bq.insert_rows_json(f"{PROJECT}.{dataset}.{table}", rows[table])
            assert not errors, errors
    return dataset


def _json(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, Decimal):
            out[k] = str(v)
        elif hasattr(v, "isoformat"):
            out[k] = v.isoformat()
        else:
            out[k] = v
    return out


def world(db_engine: sa.Engine, tickets: int = 40) -> dict[str, list[dict[str, Any]]]:
    """The seeded world in the queue's database, every ticket enqueued; its warehouse rows."""
    with db_engine.begin() as conn:
        seed.seed_world(conn, tickets=tickets)
        enqueue(conn, ticket_ids(conn))
        return {
            "customers": [
                _json(dict(r._mapping)) for r in conn.execute(seed.SQL("seed_select_customers"))
            ],
            "orders": [
                _json(dict(r._mapping)) for r in conn.execute(seed.SQL("seed_select_orders"))
            ],
        }


def bq_settings(db_url: str, dataset: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "warehouse_url": URL,
        "customers_table": f"{dataset}.customers",
        "orders_table": f"{dataset}.orders",
        "concurrency": 2,
        "lookup_batch_size": 10,
    }
    values.update(overrides)
    return make_settings(db_url, **values)


EXPECTED = """
SELECT t.id, o.order_id FROM helpdesk.tickets AS t
JOIN warehouse.customers AS c ON lower(c.email) = lower(t.requester_email)
JOIN warehouse.orders AS o ON o.customer_id = c.customer_id
"""


def written(db_engine: sa.Engine) -> set[tuple[str, str]]:
    return set(q(db_engine, "SELECT ticket_id, order_id FROM enrichq.ticket_orders"))


# -- the lookup through a worker, batch and single


@pytest.mark.parametrize("form", ["batch", "single"])
def test_a_worker_enriches_through_bigquery_with_bounded_labelled_jobs(
    db_url: str, db_engine: sa.Engine, warehouse: sa.Engine, layer: FaultLayer, form: str
) -> None:
    dataset = load(warehouse, world(db_engine), SCHEMA)
    enricher = "enrichq_service.enrich:warehouse_lookup" if form == "single" else None
    settings = bq_settings(
        db_url, dataset, enricher=enricher, attempt_deadline_seconds=40, max_bytes_per_query=2**34
    )
    before = len(layer.requests)
    result = Worker(settings, db_engine, warehouse=warehouse).run(drain=True)
    tickets = q(db_engine, "SELECT count(*) FROM helpdesk.tickets")[0][0]
    assert result.counts["done"] == tickets
    assert written(db_engine) == set(q(db_engine, EXPECTED)) != set()
    jobs = layer.query_jobs(before)
    # one job per lookup: no ping, no other statement
    assert all("lower(c.email)" in j["configuration"]["query"]["query"] for j in jobs)
    # nor any other query (a connection's ping runs as a stateless query, jobs.query)
    assert [r.body for r in layer.requests[before:] if re.search(r"/queries(\?|$)", r.path)] == []
    log = q(db_engine, "SELECT job_id, bytes_billed FROM enrichq.lookup_log")
    assert len(log) == tickets
    job_ids = {j["jobReference"]["jobId"] for j in jobs}
    assert {job for job, _ in log} == job_ids
    if form == "batch":
        assert len(jobs) <= -(-tickets // 10) + 2  # batches, not a query per ticket
    else:
        assert len(jobs) == tickets
    for job in jobs:
        config = job["configuration"]
        assert job["jobReference"]["jobId"].startswith("enrichq_")
        assert config["labels"] == {"app": "enrichq", "kind": "enrich"}
        assert int(config["query"]["maximumBytesBilled"]) == 2**34
        assert 0 < int(config["jobTimeoutMs"]) <= 40_000
    # every job billed BigQuery's minimum for the two tables it read, charged exactly once
    assert set(layer.billed) >= job_ids
    assert all(layer.billed[j] == 2 * MIN_BYTES_BILLED for j in job_ids)
    total = sum(layer.billed[j] for j in job_ids)
    assert sum(b for _, b in log) == total
    assert q(db_engine, "SELECT bytes_billed FROM enrichq.budget_ledger") == [(total,)]


def one_ticket(db_engine: sa.Engine, warehouse: sa.Engine) -> tuple[str, str]:
    """A world of one enqueued ticket whose customer has orders; its id, and the dataset."""
    rows = world(db_engine, tickets=12)
    keep = q(
        db_engine,
        "SELECT t.id FROM helpdesk.tickets AS t"
        + EXPECTED.split("helpdesk.tickets AS t")[1]
        + " ORDER BY 1 LIMIT 1",
    )[0][0]
    with db_engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM enrichq.queue WHERE key <> :k"), {"k": keep})
    return keep, load(warehouse, rows, SCHEMA)


# -- an abandoned lookup: its job is cancelled, and what it billed is charged


def test_an_abandoned_lookup_cancels_its_job_and_charges_what_it_billed(
    db_url: str, db_engine: sa.Engine, warehouse: sa.Engine, layer: FaultLayer
) -> None:
    ticket, dataset = one_ticket(db_engine, warehouse)
    settings = bq_settings(
        db_url, dataset, attempt_deadline_seconds=3, backoff_base_seconds=0, backoff_cap_seconds=0
    )
    layer.slow_seconds, layer.slow_jobs = 30, 1  # the first query runs 30 s
    before = len(layer.requests)
    result = Worker(settings, db_engine, warehouse=warehouse).run(drain=True)
    assert result.counts["done"] == 1
    first, second = layer.query_jobs(before)
    first_id, second_id = (j["jobReference"]["jobId"] for j in (first, second))
    assert 0 < int(first["configuration"]["jobTimeoutMs"]) <= 3000
    assert layer.cancelled == [first_id]
    # both jobs billed, both charged: the abandoned attempt's lookup-log row names its job
    assert layer.billed[first_id] == layer.billed[second_id] == 2 * MIN_BYTES_BILLED
    assert q(
        db_engine,
        "SELECT attempt, job_id, bytes_billed, status FROM enrichq.lookup_log ORDER BY attempt",
    ) == [(1, first_id, 2 * MIN_BYTES_BILLED, "error"), (2, second_id, 2 * MIN_BYTES_BILLED, "ok")]
    assert q(db_engine, "SELECT bytes_billed FROM enrichq.budget_ledger") == [
        (4 * MIN_BYTES_BILLED,)
    ]
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue WHERE key = :k", k=ticket) == [
        ("done", 2)
    ]


# -- at start-up: credentials, tables and columns, each one line and exit 2


def run_worker(env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "enrichq_service", "worker", "--drain"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(
    ("problem", "says"),
    [
        ("no_credentials", "BigQuery credentials are missing or unusable"),
        ("not_a_key", "BigQuery credentials are missing or unusable"),
        ("no_table", "ENRICHQ_ORDERS_TABLE="),
        ("no_column", "has no column total"),
        ("access_denied", "access denied"),
    ],
)
def test_a_worker_refuses_to_start_without_usable_credentials_or_tables(
    *,
    db_url: str,
    db_engine: sa.Engine,
    warehouse: sa.Engine,
    layer: FaultLayer,
    bq_env: dict[str, str],
    tmp_path: Path,
    problem: str,
    says: str,
) -> None:
    _, dataset = one_ticket(db_engine, warehouse)
    schema = dict(SCHEMA, orders="order_id STRING, customer_id STRING, placed_at TIMESTAMP")
    if problem == "no_column":
        dataset = load(warehouse, {}, schema)
    env = enrichq_env(
        db_url,
        warehouse_url=URL,
        customers_table=f"{dataset}.customers",
        orders_table=f"{dataset}.{'nope' if problem == 'no_table' else 'orders'}",
    )
    env.update(bq_env)
    if problem == "no_credentials":
        # no key, no gcloud login in HOME, and the metadata server's address on loopback
        # where nothing listens: google-auth must never reach the real one from a test
        del env["GOOGLE_APPLICATION_CREDENTIALS"]
        env.update(
            HOME=str(tmp_path), GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9"
        )
    elif problem == "access_denied":
        layer.faults.append(Fault("GET", r"/tables/", 403, "accessDenied", times=None))
    elif problem == "not_a_key":
        (tmp_path / "key.json").write_text(json.dumps({"type": "service_account"}))
        env["GOOGLE_APPLICATION_CREDENTIALS"] = str(tmp_path / "key.json")
    done = run_worker(env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert says in lines[0]
    # nothing was claimed
    assert q(db_engine, "SELECT state, attempts FROM enrichq.queue") == [("queued", 0)]


# -- BigQuery's errors, through the fault layer, as BigQuery documents them


@pytest.mark.parametrize(
    ("status", "reason", "outcome", "says"),
    [
        (403, "rateLimitExceeded", TransientError, "BigQuery rateLimitExceeded"),
        (500, "backendError", TransientError, "BigQuery backendError"),
        (503, "unavailable", TransientError, "BigQuery unavailable"),
        (403, "quotaExceeded", Deferral, "BigQuery quotaExceeded"),
        (400, "invalidQuery", PermanentError, "BigQuery invalidQuery"),
        (404, "notFound", PermanentError, "BigQuery notFound"),
        (403, "accessDenied", PermanentError, "BigQuery accessDenied"),
        (400, "bytesBilledLimitExceeded", PermanentError, "ENRICHQ_MAX_BYTES_PER_QUERY"),
    ],
)
def test_bigquery_errors_are_mapped_as_documented(
    *,
    db_engine: sa.Engine,
    warehouse: sa.Engine,
    layer: FaultLayer,
    status: int,
    reason: str,
    outcome: type[Exception],
    says: str,
) -> None:
    ticket, dataset = one_ticket(db_engine, warehouse)
    settings = bq_settings(str(db_engine.url), dataset)
    with db_engine.connect() as conn:
        tickets = list(read_tickets(conn, settings, [ticket]).values())
    layer.faults.append(Fault("POST", r"/jobs(\?|$)", status, reason, times=None))
    before = len(layer.requests)
    found = warehouse_lookup_batch(tickets, EnrichContext(settings, warehouse))[ticket]
    assert isinstance(found, outcome), found
    assert type(found) is not TransientError or outcome is TransientError
    assert says in str(found)
    assert "\n" not in str(found)
    if isinstance(found, Deferral):
        assert found.until == quota_reset()  # midnight, Pacific time
    # refused on insert: one request (the queue's backoff retries, not the client), no bill
    assert len(layer.jobs(before)) == 1
    assert charge_of(found, ticket) == (None, 0)


def test_a_quota_error_defers_the_work_to_the_reset_without_spending_an_attempt(
    db_url: str, db_engine: sa.Engine, warehouse: sa.Engine, layer: FaultLayer
) -> None:
    ticket, dataset = one_ticket(db_engine, warehouse)
    layer.faults.append(Fault("POST", r"/jobs(\?|$)", 403, "quotaExceeded", times=None))
    Worker(bq_settings(db_url, dataset), db_engine, warehouse=warehouse).run(drain=True)
    [(state, attempts, visible_at)] = q(
        db_engine, "SELECT state, attempts, visible_at FROM enrichq.queue WHERE key = :k", k=ticket
    )
    assert (state, attempts) == ("queued", 0)
    assert visible_at == quota_reset()


# -- a hung BigQuery does not hold up a stop


@pytest.mark.parametrize("how", ["sigterm", "out_of_work"])
def test_worker_drain_stops_in_bounded_time_while_a_bigquery_call_hangs(
    *,
    db_url: str,
    db_engine: sa.Engine,
    warehouse: sa.Engine,
    layer: FaultLayer,
    bq_env: dict[str, str],
    tmp_path: Path,
    how: str,
) -> None:
    """A BigQuery that never answers a job's insert: a SIGTERM stops the worker within its
    grace period, and a drain whose last attempt was abandoned ends once the work is out,
    though the call still hangs (the client would retry it for up to 10 minutes)."""
    ticket, dataset = one_ticket(db_engine, warehouse)
    layer.hang = r"/jobs(\?|$)"
    before = len(layer.requests)
    env = enrichq_env(
        db_url,
        warehouse_url=URL,
        customers_table=f"{dataset}.customers",
        orders_table=f"{dataset}.orders",
        attempt_deadline_seconds=600 if how == "sigterm" else 3,
        shutdown_grace_seconds=1,
    )
    env.update(bq_env)
    proc = spawn(["worker", "--drain"], env, log=tmp_path / "worker.log")
    try:
        wait_for(lambda: layer.jobs(before), timeout=120, what="the lookup's job insert")
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        stop(proc)
    assert code == 0, (tmp_path / "worker.log").read_text()
    [(state, attempts)] = q(
        db_engine, "SELECT state, attempts FROM enrichq.queue WHERE key = :k", k=ticket
    )
    # handed back for a later attempt (the sweeper dead-letters it: attempts spent)
    assert (state, attempts) == ("queued", 1)


def test_a_job_whose_insert_answer_was_lost_is_found_and_charged(
    db_engine: sa.Engine, warehouse: sa.Engine, layer: FaultLayer
) -> None:
    """The insert reached BigQuery, its answer did not: the job ran under the id enrichq
    gave it, so it is looked up, and what it billed is charged."""
    ticket, dataset = one_ticket(db_engine, warehouse)
    settings = bq_settings(str(db_engine.url), dataset)
    with db_engine.connect() as conn:
        tickets = list(read_tickets(conn, settings, [ticket]).values())
    layer.faults.append(Fault("POST", r"/jobs(\?|$)", 503, "backendError", forward=True))
    before = len(layer.requests)
    found = warehouse_lookup_batch(tickets, EnrichContext(settings, warehouse))[ticket]
    assert isinstance(found, TransientError)
    [job] = layer.query_jobs(before)
    job_id = job["jobReference"]["jobId"]
    assert (
        charge_of(found, ticket) == (job_id, 2 * MIN_BYTES_BILLED) == (job_id, layer.billed[job_id])
    )
