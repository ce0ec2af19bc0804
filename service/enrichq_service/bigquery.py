"""The built-in lookup's query on BigQuery, through BigQuery's own client: a query job of
enrichq's own making, bounded by the attempt's deadline and the byte limit, cancelled when
abandoned, its errors mapped to transient, deferred or permanent."""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import sqlalchemy as sa

from enrichq_schema.errors import SettingsError
from enrichq_schema.settings import Settings
from enrichq_service.errors import Deferral, PermanentError, ServiceError, TransientError

LABEL_APP = "enrichq"
# a bound value as the dialect's compiler writes it (pyformat), and as BigQuery names it
# (pyformat, with the type where the compiler knows it: `%(name)s`, `%(name:STRING)s`)
PYFORMAT = re.compile(r"%\((\w+)(?::[^)]*)?\)s")
# a call to BigQuery when the attempt has no deadline (a direct call of the lookup)
CALL_SECONDS_DEFAULT = 300.0
# an abandoned job is cancelled; how long its lookup waits for it to end, to learn its bill
CANCEL_WAIT_SECONDS = 10.0
# one request that only asks (a job's state, a cancel)
REQUEST_SECONDS = 5.0
# BigQuery's daily quotas reset at midnight Pacific time
QUOTA_RESET_ZONE = ZoneInfo("America/Los_Angeles")
TRANSIENT_REASONS = frozenset(
    {"rateLimitExceeded", "backendError", "internalError", "jobBackendError", "jobInternalError"}
)
# what the query itself makes impossible: the same query fails again however often it runs
PERMANENT_REASONS = frozenset(
    {"invalidQuery", "notFound", "accessDenied", "invalid", "duplicate", "billingNotEnabled"}
)
# an error of the query's data (a value that does not convert): splitting its batch finds
# the tickets whose rows cause it (`enrichq_service.enrich`)
DATA_REASONS = frozenset({"invalidQuery"})


def is_bigquery(engine: sa.Engine | sa.Connection) -> bool:
    """Is this the BigQuery dialect?"""
    return engine.dialect.name == "bigquery"


@dataclass(frozen=True, slots=True)
class Ran:
    """A query job that returned its rows."""

    rows: list[Any]
    job_id: str
    bytes_billed: int


class JobFailed(ServiceError):
    """A query job that failed, with what it billed and what its error comes to."""

    def __init__(self, error: BaseException, job_id: str | None, bytes_billed: int, *, data: bool):
        super().__init__(str(error))
        self.error = error  # the error the job's tickets get (`mapped`)
        self.job_id = job_id
        self.bytes_billed = bytes_billed
        self.data = data  # the query's data made it fail: splitting the batch may help


def client_of(conn: sa.Connection) -> Any:
    """The google.cloud.bigquery.Client of a pooled BigQuery connection (the DB-API
    connection of sqlalchemy-bigquery keeps the client it was made with)."""
    return conn.connection.dbapi_connection._client  # type: ignore[union-attr]


def compiled(
    dialect: sa.Dialect, stmt: sa.TextClause, params: Mapping[str, Any]
) -> tuple[str, list[Any]]:
    """`stmt` as BigQuery SQL with named parameters (@name), and those parameters: the
    dialect expands a list into one bound value each, as on every dialect."""
    from google.cloud import bigquery

    done = stmt.bindparams(**params).compile(
        dialect=dialect, compile_kwargs={"render_postcompile": True}
    )
    sql = PYFORMAT.sub(lambda m: f"@{m.group(1)}", done.string)
    values: list[Any] = []
    for name, value in done.params.items():
        kind = "INT64" if isinstance(value, int) and not isinstance(value, bool) else "STRING"
        values.append(bigquery.ScalarQueryParameter(name, kind, value))
    return sql, values


def run(
    conn: sa.Connection,
    stmt: sa.TextClause,
    params: Mapping[str, Any],
    *,
    kind: str,
    max_bytes: int,
    deadline: float | None,
    interruptible: Callable[[Callable[[], None]], contextlib.AbstractContextManager[None]],
) -> Ran:
    """Run `stmt` as a query job bounded by `deadline` (time.monotonic()), cancelled when
    `interruptible` says the attempt is abandoned; JobFailed with what it billed."""
    from google.cloud import bigquery

    client = client_of(conn)
    sql, values = compiled(conn.dialect, stmt, params)
    if deadline is None:
        deadline = time.monotonic() + CALL_SECONDS_DEFAULT
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransientError("the attempt's deadline passed before the lookup started")
    config = bigquery.QueryJobConfig(
        query_parameters=values,
        labels={"app": LABEL_APP, "kind": _label(kind)},
        maximum_bytes_billed=max_bytes,
        job_timeout_ms=max(1, int(remaining * 1000)),
    )
    job_id = f"enrichq_{uuid.uuid4().hex}"
    cancel = _Cancel(client, job_id)
    job = None
    inserted = False
    try:
        with interruptible(cancel):
            job = client.query(
                sql,
                job_config=config,
                job_id=job_id,
                retry=_retry(deadline),
                job_retry=None,
                timeout=_left(deadline),
            )
            inserted = True
            cancel.created()
            rows = list(job.result(retry=_retry(deadline), timeout=_left(deadline)))
    except Exception as exc:
        if job is None:
            # the insert failed, or only its answer was lost: a job made under our id runs
            # and bills all the same, so it is looked for (and cancelled, and charged)
            job = _made_anyway(client, job_id)
        if job is not None:
            cancel.created()
        billed = _billed_at_end(client, job, cancel) if job is not None else 0
        error = cancel.why() or mapped(exc, max_bytes=max_bytes)
        # a query refused before it ran (on insert) is not the data's doing
        data = inserted and _reason(exc) in DATA_REASONS
        raise JobFailed(error, job_id if job is not None else None, billed, data=data) from exc
    return Ran(rows, job.job_id or job_id, int(job.total_bytes_billed or 0))


class _Cancel:
    """Cancels the job from another thread, once, without waiting for BigQuery's answer;
    asked before the job exists (its insert still on its way), once it does."""

    def __init__(self, client: Any, job_id: str) -> None:
        self._client = client
        self._job_id = job_id
        self._lock = threading.Lock()
        self._wanted = False
        self._created = False
        self._sent = False

    def __call__(self) -> None:
        with self._lock:
            self._wanted = True
        self._maybe_send()

    def created(self) -> None:
        """The job exists now: a cancel asked for before is sent."""
        with self._lock:
            self._created = True
        self._maybe_send()

    def _maybe_send(self) -> None:
        with self._lock:
            if not (self._wanted and self._created) or self._sent:
                return
            self._sent = True
        threading.Thread(target=self._send, name="enrichq-cancel", daemon=True).start()

    def _send(self) -> None:
        with contextlib.suppress(Exception):  # best effort: job_timeout_ms still ends it
            self._client.cancel_job(self._job_id, retry=None, timeout=REQUEST_SECONDS)

    def why(self) -> BaseException | None:
        """The error of a lookup whose job was cancelled because it was abandoned."""
        with self._lock:
            if not self._wanted:
                return None
        return TransientError("the lookup was abandoned: its BigQuery job was cancelled")


def _made_anyway(client: Any, job_id: str) -> Any:
    """The job of `job_id` if BigQuery made it after all, or None."""
    try:
        return client.get_job(job_id, retry=None, timeout=REQUEST_SECONDS)
    except Exception:  # not found, or BigQuery unreachable: nothing known to charge
        return None


def _billed_at_end(client: Any, job: Any, cancel: _Cancel) -> int:
    """What a job that did not return its rows billed, once it has ended: one still running
    (its result timed out) is cancelled first; waited for at most CANCEL_WAIT_SECONDS."""
    until = time.monotonic() + CANCEL_WAIT_SECONDS
    while True:
        with contextlib.suppress(Exception):
            job.reload(retry=None, timeout=REQUEST_SECONDS)
        if job.state == "DONE" or time.monotonic() >= until:
            return int(job.total_bytes_billed or 0)
        cancel()
        time.sleep(0.2)


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _retry(deadline: float) -> Any:
    """Retries of a request that never reached BigQuery, until the deadline; BigQuery's own
    errors are not retried here but mapped (`mapped`), so backoff is the queue's."""
    from google.api_core.retry import Retry

    return Retry(predicate=_unreached, initial=0.2, maximum=2.0, timeout=_left(deadline))


def _unreached(exc: Exception) -> bool:
    import requests

    return isinstance(exc, requests.ConnectionError)


def _label(value: str) -> str:
    # label values: lower-case letters, digits, _ and -, at most 63 characters
    return re.sub(r"[^a-z0-9_-]", "_", value.lower())[:63]


def _reason(exc: BaseException) -> str | None:
    errors = getattr(exc, "errors", None)
    if isinstance(errors, Sequence) and errors and isinstance(errors[0], Mapping):
        reason = errors[0].get("reason")
        return str(reason) if reason else None
    return None


def _message(exc: BaseException) -> str:
    errors = getattr(exc, "errors", None)
    if isinstance(errors, Sequence) and errors and isinstance(errors[0], Mapping):
        message = str(errors[0].get("message") or "")
    else:
        message = str(getattr(exc, "message", "") or exc)
    return (message.strip().splitlines() or [type(exc).__name__])[0]


def quota_reset(now: datetime | None = None) -> datetime:
    """When BigQuery's daily quotas reset next: midnight, Pacific time."""
    local = (now or datetime.now(UTC)).astimezone(QUOTA_RESET_ZONE)
    midnight = datetime.combine(local.date() + timedelta(days=1), datetime.min.time())
    return midnight.replace(tzinfo=QUOTA_RESET_ZONE).astimezone(UTC)


def mapped(exc: BaseException, *, max_bytes: int) -> BaseException:
    """What a BigQuery error comes to for the tickets of its query: TransientError,
    PermanentError or Deferral, in one line naming BigQuery's reason."""
    import concurrent.futures

    import requests

    reason = _reason(exc)
    message = _message(exc)
    code = getattr(exc, "code", None)
    if reason == "quotaExceeded":
        return Deferral(quota_reset(), f"BigQuery quotaExceeded: {message}")
    if reason == "bytesBilledLimitExceeded":
        return PermanentError(
            f"BigQuery refused the query: it would bill more than ENRICHQ_MAX_BYTES_PER_QUERY "
            f"({max_bytes} bytes): {message}"
        )
    if reason in TRANSIENT_REASONS or (isinstance(code, int) and code >= 500):
        return TransientError(f"BigQuery {reason or code}: {message}")
    if reason in PERMANENT_REASONS:
        return PermanentError(f"BigQuery {reason}: {message}")
    if isinstance(exc, concurrent.futures.TimeoutError | TimeoutError):
        return TransientError("the BigQuery job ran past the attempt's deadline")
    if isinstance(exc, requests.RequestException):
        return TransientError(f"BigQuery unreachable: {message}")
    return TransientError(f"BigQuery {reason or type(exc).__name__}: {message}")


# -- at start-up: usable credentials, and tables with the columns the lookup reads

LOOKUP_COLUMNS = {
    "customers_table": ("customer_id", "email"),
    "orders_table": ("order_id", "customer_id", "placed_at", "total"),
}


def preflight(settings: Settings) -> None:
    """Refuse to start on a BigQuery warehouse the lookup cannot use: credentials missing
    or unusable, a table not found or not readable, a column missing. SettingsError (one
    line, exit 2) naming what is wrong and the setting to fix; nothing is billed (table
    metadata is free)."""
    from google.api_core import exceptions as api
    from google.auth import exceptions as auth

    from enrichq_schema.db import create_warehouse_engine

    url = settings.warehouse_url
    assert url is not None
    try:
        engine = create_warehouse_engine(url, pool_size=1)
    except auth.GoogleAuthError as exc:
        raise SettingsError(_credentials_problem(exc)) from None
    except (ValueError, OSError) as exc:  # a key file that is not one, or not readable
        raise SettingsError(f"BigQuery credentials are unusable: {_message(exc)}") from None
    try:
        with engine.connect() as conn:
            client = client_of(conn)
            for setting, columns in LOOKUP_COLUMNS.items():
                name = getattr(settings, setting)
                where = f"ENRICHQ_{setting.upper()}={name}"
                try:
                    table = client.get_table(name, retry=None, timeout=30)
                except api.NotFound as exc:
                    raise SettingsError(
                        f"{where}: BigQuery has no such table ({_message(exc)})"
                    ) from None
                except api.Forbidden as exc:
                    raise SettingsError(
                        f"{where}: access denied ({_message(exc)}); the service account needs "
                        "roles/bigquery.dataViewer on the dataset and roles/bigquery.jobUser "
                        "on the project"
                    ) from None
                except auth.GoogleAuthError as exc:
                    raise SettingsError(_credentials_problem(exc)) from None
                have = {f.name.lower() for f in table.schema}
                missing = [c for c in columns if c not in have]
                if missing:
                    raise SettingsError(
                        f"{where}: BigQuery table has no column {', '.join(missing)} "
                        f"(the lookup reads {', '.join(columns)})"
                    )
    finally:
        engine.dispose()


def _credentials_problem(exc: BaseException) -> str:
    return (
        f"BigQuery credentials are missing or unusable ({_message(exc)}): set "
        "GOOGLE_APPLICATION_CREDENTIALS to a service account's key file, or run where "
        "the platform provides them (docs/operations.md)"
    )
