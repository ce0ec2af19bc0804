"""Process settings: environment variables prefixed ``ENRICHQ_`` and an optional TOML file.

One ``Settings`` object is built in ``main()`` and passed down; nothing here runs at import.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from enrichq_schema.errors import SettingsError
from enrichq_schema.states import PoolMode
from enrichq_schema.text import printable, validation_problem

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

LEASE_SECONDS_DEFAULT = 60
HEARTBEAT_SECONDS_DEFAULT = 15
DELAY_CREATED_SECONDS_DEFAULT = 600
DELAY_UPDATED_SECONDS_DEFAULT = 120
MAX_ATTEMPTS_DEFAULT = 5
BACKOFF_BASE_SECONDS_DEFAULT = 5
BACKOFF_CAP_SECONDS_DEFAULT = 300
ATTEMPT_DEADLINE_SECONDS_DEFAULT = 300
SWEEP_INTERVAL_SECONDS_DEFAULT = 30
POLL_SECONDS_DEFAULT = 5
CONCURRENCY_DEFAULT = 8
RETENTION_DAYS_DEFAULT = 30
DEAD_LETTER_RETENTION_DAYS_DEFAULT = 90
HTTP_PORT_DEFAULT = 8080
METRICS_PORT_DEFAULT = 9464
PARITY_MIN_ORDER_COVERAGE_DEFAULT = 0.995
PARITY_MIN_TICKET_MATCH_RATE_DEFAULT = 0.99
PARITY_MAX_SHADOW_FAULT_RATE_DEFAULT = 0.005
PARITY_MAX_AGE_HOURS_DEFAULT = 24
PARITY_WINDOW_DAYS_DEFAULT = 7
PRIORITY_AGING_SECONDS_DEFAULT = 600
EVENT_DEDUPE_HOURS_DEFAULT = 24
# the reconcile pass (events the help desk never delivered): every quarter of an hour; at
# most once a day, or 0 = off
RECONCILE_INTERVAL_SECONDS_DEFAULT = 900
RECONCILE_INTERVAL_SECONDS_MIN = 1
RECONCILE_INTERVAL_SECONDS_MAX = 86_400
EVENT_DEDUPE_HOURS_MAX = 24 * 90
# The built-in enrichment: one warehouse query per claim batch (enrichq_service.enrich).
BUILTIN_BATCH_ENRICHER = "enrichq_service.enrich:warehouse_lookup_batch"
LOOKUP_BATCH_SIZE_DEFAULT = 200
# Work becomes claimable in cohorts at boundaries this far apart (seconds since the epoch
# divisible by it), so that one warehouse query serves many tickets at a trickle of traffic.
LOOKUP_WINDOW_SECONDS_DEFAULT = 30
LOOKUP_WINDOW_SECONDS_MAX = 3600
# BigQuery: the most one query job may bill (its `maximum_bytes_billed`); past it BigQuery
# refuses the query before it runs, billing nothing. The default, 10 GiB, is a thousand
# times a batch lookup's usual cost (BigQuery's 10 MB minimum) and a few cents on demand;
# at most 1 PiB, the most one lookup may report (enrichq_service.enrich.BYTES_MAX); at
# least BigQuery's 10 MB minimum, below which every query would be refused.
MAX_BYTES_PER_QUERY_DEFAULT = 10 * 2**30
MAX_BYTES_PER_QUERY_MIN = 10 * 2**20
MAX_BYTES_PER_QUERY_MAX = 2**50
BUILTIN_GAVE_UP_HOOK = "enrichq_sweeper.recovery:log_gave_up"
NETWORK_TIMEOUT_SECONDS_DEFAULT = 10
NETWORK_TIMEOUT_SECONDS_MAX = 600
# one part of a warehouse table's name; every part is quoted by the warehouse's dialect
WAREHOUSE_NAME_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")

# -- bounded numbers: one type per kind of number. Every number is finite (pydantic lets
# "inf" and "nan" through a float unless told not to) and bounded to what the database and
# the OS accept where it is used, so a value that would break later is refused at start-up.

# PostgreSQL takes statement_timeout and idle_in_transaction_session_timeout in whole
# milliseconds of a 32-bit integer, and a duration may become one (the attempt deadline is
# a lookup's statement timeout, the lease a session's idle-in-transaction timeout): at most
# 2^31-1 ms, 24.8 days. Intervals (make_interval), timestamps (now() + a delay), Python's
# waits (threading.TIMEOUT_MAX) and APScheduler's intervals all take far more.
MILLISECONDS_MAX = 2**31 - 1
SECONDS_MAX = MILLISECONDS_MAX // 1000
# a positive duration is at least a millisecond: a shorter one rounds to 0 ms, which
# PostgreSQL reads as "no timeout at all"
SECONDS_MIN = 0.001
# a retention period: a century
DAYS_MAX = 36_500
# a period in hours (a parity run's age, the parity period): a leap year
HOURS_MAX = 24 * 366
# bytes a day: the budget ledger's bigint
BIGINT_MAX = 2**63 - 1
# an HTTP request body: 1 GiB, far beyond any help desk's event
BODY_BYTES_MAX = 2**30
# a signed webhook's accepted clock skew: an hour (senders sign with the current time;
# Zendesk, Stripe and Standard Webhooks accept 5 minutes); past that a captured request
# could be replayed long after it was sent
WEBHOOK_TOLERANCE_SECONDS_MAX = 3600
# how long ingest waits for the database before it answers 503: Zendesk gives a webhook
# 12 s in all (network, TLS and our answer), so at most 10
INGEST_DATABASE_TIMEOUT_SECONDS_MAX = 10
INGEST_DATABASE_TIMEOUT_SECONDS_DEFAULT = 2.5
# slow senders: a request's head (line and headers) must arrive within this many seconds of
# the connection opening (or of the previous answer, on a kept-alive connection), its body
# within this many of its head; then the connection is closed
HTTP_HEADER_TIMEOUT_SECONDS_DEFAULT = 10
HTTP_BODY_TIMEOUT_SECONDS_DEFAULT = 30
HTTP_TIMEOUT_SECONDS_MAX = 600
# open HTTP connections at once (more are answered 503 and closed at once); serve lowers it
# to what its open-files limit leaves room for
HTTP_MAX_CONNECTIONS_DEFAULT = 1000
HTTP_MAX_CONNECTIONS_MAX = 1_000_000
# request bytes held at once, by every request together, before their signature is checked
HTTP_MAX_BUFFERED_BYTES_DEFAULT = 16 * 2**20
# Standard Webhooks secrets are `whsec_` + base64 of the key
STANDARD_WEBHOOKS_PREFIX = "whsec_"

# a duration in seconds that may become a millisecond setting: 1 ms to 24.8 days
Seconds = Annotated[float, Field(ge=SECONDS_MIN, le=SECONDS_MAX, allow_inf_nan=False)]
# a duration in seconds where 0 means none (a delay, a grace period, a backoff)
SecondsOrZero = Annotated[float, Field(ge=0, le=SECONDS_MAX, allow_inf_nan=False)]
# a retention period in days
Days = Annotated[float, Field(gt=0, le=DAYS_MAX, allow_inf_nan=False)]
# a period in hours; HoursOrZero: 0 = never
Hours = Annotated[float, Field(gt=0, le=HOURS_MAX, allow_inf_nan=False)]
HoursOrZero = Annotated[float, Field(ge=0, le=HOURS_MAX, allow_inf_nan=False)]
# a share of a whole, 0 to 1 (the parity bars)
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
# a TCP port; 0 = one the system picks
Port = Annotated[int, Field(ge=0, le=65535)]


class Mode(StrEnum):
    """Which world the service writes: only its own tables (shadow) or it serves consumers."""

    SHADOW = "shadow"
    LIVE = "live"


class ZendeskTenantField(StrEnum):
    """Which field of a Zendesk ticket is the enrichq tenant (none: no tenant)."""

    BRAND_ID = "brand_id"
    ORGANIZATION_ID = "organization_id"
    NONE = "none"


class Settings(BaseSettings):
    """Everything an operator or a test can turn; names are the contract of DESIGN §6."""

    model_config = SettingsConfigDict(
        env_prefix="ENRICHQ_",
        extra="forbid",
        frozen=True,
        validate_default=True,
        # each field's docstring is its description
        use_attribute_docstrings=True,
    )

    # Set by ``Settings.load(config_file=...)`` before construction; pydantic-settings
    # reads it in ``settings_customise_sources``.
    _toml_file: ClassVar[Path | None] = None

    database_url: str | None = None
    """SQLAlchemy URL of the queue database; unset = embedded."""
    warehouse_url: str | None = None
    """SQLAlchemy URL of the warehouse; unset = the queue database."""
    parity_database_url: str | None = None
    """Where parity reads (a read replica); unset = the database."""
    listen_database_url: str | None = None
    """A direct (unpooled) URL of the queue database for LISTEN; unset = the database in session
    pool mode, no LISTEN (polling alone) in transaction pool mode.
    """
    pool_mode: PoolMode = PoolMode.SESSION
    """session, or transaction behind a transaction pooler (PgBouncer): settings per transaction,
    nothing prepared, sweeper leadership by a lease row.
    """
    network_timeout_seconds: Annotated[
        float, Field(ge=0, le=NETWORK_TIMEOUT_SECONDS_MAX, allow_inf_nan=False)
    ] = NETWORK_TIMEOUT_SECONDS_DEFAULT
    """How long a dead network or a silent server may go unnoticed (keepalives, tcp_user_timeout,
    connect_timeout, reply waits); 0 = libpq's defaults.
    """
    mode: Mode = Mode.SHADOW
    """shadow (default) or live."""
    lease_seconds: Seconds = LEASE_SECONDS_DEFAULT
    """Lease length."""
    heartbeat_seconds: Seconds = HEARTBEAT_SECONDS_DEFAULT
    """Heartbeat period; < lease/2."""
    delay_created_seconds: SecondsOrZero = DELAY_CREATED_SECONDS_DEFAULT
    """Visibility delay, new ticket."""
    delay_updated_seconds: SecondsOrZero = DELAY_UPDATED_SECONDS_DEFAULT
    """Visibility delay, activity."""
    max_attempts: int = Field(default=MAX_ATTEMPTS_DEFAULT, ge=1, le=100, description="Claims.")
    backoff_base_seconds: SecondsOrZero = BACKOFF_BASE_SECONDS_DEFAULT
    """Retry backoff base."""
    backoff_cap_seconds: SecondsOrZero = BACKOFF_CAP_SECONDS_DEFAULT
    """Retry backoff cap."""
    attempt_deadline_seconds: Seconds = ATTEMPT_DEADLINE_SECONDS_DEFAULT
    """One attempt's time limit."""
    sweep_interval_seconds: Seconds = SWEEP_INTERVAL_SECONDS_DEFAULT
    """Lease recovery period."""
    poll_seconds: Seconds = POLL_SECONDS_DEFAULT
    """Backstop poll when no NOTIFY arrives."""
    priority_aging_seconds: Seconds = PRIORITY_AGING_SECONDS_DEFAULT
    """Seconds a queued row waits visible to rise one plan level in the claim."""
    concurrency: int = Field(
        default=CONCURRENCY_DEFAULT, ge=1, le=1024, description="Jobs in flight per worker."
    )
    retention_days: Days = RETENTION_DAYS_DEFAULT
    """Keep done/failed rows this long."""
    dead_letter_retention_days: Days = DEAD_LETTER_RETENTION_DAYS_DEFAULT
    """Keep dead letters."""
    daily_bytes_budget: Annotated[int, Field(ge=0, le=BIGINT_MAX)] = 0
    """Warehouse bytes billed per UTC day; 0 = no budget."""
    max_bytes_per_query: Annotated[
        int, Field(ge=MAX_BYTES_PER_QUERY_MIN, le=MAX_BYTES_PER_QUERY_MAX)
    ] = MAX_BYTES_PER_QUERY_DEFAULT
    """BigQuery: the most bytes one lookup's query job may bill (its maximum_bytes_billed)."""
    enricher: str | None = None
    """package.module:function of a per-ticket enrichment (not the batch one)."""
    batch_enricher: str | None = None
    """package.module:function of a batch enrichment; unset = the built-in lookup."""
    lookup_batch_size: Annotated[int, Field(ge=1, le=1000)] = LOOKUP_BATCH_SIZE_DEFAULT
    """Tickets a batch enricher gets at once (one warehouse query)."""
    lookup_window_seconds: Annotated[
        float, Field(ge=0, le=LOOKUP_WINDOW_SECONDS_MAX, allow_inf_nan=False)
    ] = LOOKUP_WINDOW_SECONDS_DEFAULT
    """Event work becomes visible at the next multiple of this many seconds (a cohort the
    fleet claims together, one lookup for many tickets); 0 = the moment its delay ends.
    Manual and redriven work is exempt.
    """
    warehouse_max_concurrency: Annotated[int, Field(ge=0, le=10_000)] = 0
    """Warehouse lookups running at once, fleet-wide; 0 = no cap."""
    gave_up_hook: str = BUILTIN_GAVE_UP_HOOK
    """Called with rows whose attempts are spent."""
    tickets_table: str = "helpdesk.tickets"
    """The help desk's ticket mirror (schema.table)."""
    customers_table: str = "warehouse.customers"
    """Warehouse customers ([catalog.]schema.table)."""
    orders_table: str = "warehouse.orders"
    """Warehouse orders ([catalog.]schema.table)."""
    legacy_table: str = "legacy.ticket_orders"
    """What the legacy flow wrote."""
    webhook_secret: SecretStr | None = None
    """HMAC keys of POST /v1/events, comma-separated (any one verifies, for rotation); unset
    refuses every event.
    """
    webhook_tolerance_seconds: Annotated[
        float, Field(ge=SECONDS_MIN, le=WEBHOOK_TOLERANCE_SECONDS_MAX, allow_inf_nan=False)
    ] = 300
    """Accepted clock skew of a signed event's timestamp."""
    zendesk_signing_secret: SecretStr | None = None
    """Signing secrets of the Zendesk webhooks of POST /v1/zendesk, comma-separated (any one
    verifies, for rotation); unset refuses every Zendesk delivery.
    """
    zendesk_tenant_field: ZendeskTenantField = ZendeskTenantField.BRAND_ID
    """The ticket field that is the tenant: brand_id, organization_id or none."""
    ingest_database_timeout_seconds: Annotated[
        float, Field(ge=0.1, le=INGEST_DATABASE_TIMEOUT_SECONDS_MAX, allow_inf_nan=False)
    ] = INGEST_DATABASE_TIMEOUT_SECONDS_DEFAULT
    """How long ingest waits for the database before it answers 503 with Retry-After."""
    event_dedupe_hours: Annotated[
        float, Field(gt=0, le=EVENT_DEDUPE_HOURS_MAX, allow_inf_nan=False)
    ] = EVENT_DEDUPE_HOURS_DEFAULT
    """A webhook event id seen this recently is a redelivery: acknowledged, not enqueued again."""
    max_body_bytes: int = Field(
        default=1_048_576,
        ge=1024,
        le=BODY_BYTES_MAX,
        description="Largest accepted POST /v1/events body.",
    )
    http_header_timeout_seconds: Annotated[
        float, Field(ge=0.1, le=HTTP_TIMEOUT_SECONDS_MAX, allow_inf_nan=False)
    ] = HTTP_HEADER_TIMEOUT_SECONDS_DEFAULT
    """Seconds a client has to send a request's line and headers; then it is disconnected."""
    http_body_timeout_seconds: Annotated[
        float, Field(ge=0.1, le=HTTP_TIMEOUT_SECONDS_MAX, allow_inf_nan=False)
    ] = HTTP_BODY_TIMEOUT_SECONDS_DEFAULT
    """Seconds a client has to send a request's body after its headers; then it is
    disconnected."""
    http_max_connections: Annotated[int, Field(ge=1, le=HTTP_MAX_CONNECTIONS_MAX)] = (
        HTTP_MAX_CONNECTIONS_DEFAULT
    )
    """Open HTTP connections at once; more are answered 503 with Retry-After and closed."""
    http_max_buffered_bytes: Annotated[int, Field(ge=1024, le=BODY_BYTES_MAX)] = (
        HTTP_MAX_BUFFERED_BYTES_DEFAULT
    )
    """Request body bytes held at once, all requests together, before their signatures are
    checked; past it a request is answered 503 with Retry-After."""
    http_host: str = "0.0.0.0"  # noqa: S104 -- a service listens on all interfaces in its container
    """Address `serve` binds."""
    http_port: Port = HTTP_PORT_DEFAULT
    """HTTP port."""
    metrics_port: Port = METRICS_PORT_DEFAULT
    """/metrics without HTTP server."""
    shutdown_grace_seconds: SecondsOrZero = 30
    """How long in-flight work may finish on SIGTERM."""
    refresh_interval_seconds: Seconds = 3600
    """How often the sweeper enqueues refresh work."""
    reconcile_interval_seconds: Annotated[
        float, Field(ge=0, le=RECONCILE_INTERVAL_SECONDS_MAX, allow_inf_nan=False)
    ] = RECONCILE_INTERVAL_SECONDS_DEFAULT
    """How often the sweeper enqueues tickets changed without an event; 0 = never."""
    parity_grace_seconds: SecondsOrZero = 3600
    """Extra age past the visibility delay before parity."""
    parity_interval_hours: HoursOrZero = 0
    """Sweeper runs parity this often; 0 = never."""
    parity_min_order_coverage: Fraction = PARITY_MIN_ORDER_COVERAGE_DEFAULT
    """Parity pass bar: |shadow ∩ legacy| / |legacy| over the orders."""
    parity_min_ticket_match_rate: Fraction = PARITY_MIN_TICKET_MATCH_RATE_DEFAULT
    """Below it the report marks how often both flows agree; not a pass bar."""
    parity_max_shadow_fault_rate: Fraction = PARITY_MAX_SHADOW_FAULT_RATE_DEFAULT
    """Parity pass bar: tickets that are enrichq's fault / tickets compared."""
    parity_max_age_hours: Hours = PARITY_MAX_AGE_HOURS_DEFAULT
    """Cutover needs a run whose window ends, and whose data is, younger than this."""
    parity_window_days: float = Field(
        default=PARITY_WINDOW_DAYS_DEFAULT,
        gt=0,
        le=366,
        allow_inf_nan=False,
        description="Parity's default window; cutover needs a run over at least this long.",
    )
    parity_concurrency: int = Field(
        default=2, ge=1, le=16, description="Days parity compares at once, a connection each."
    )
    statement_timeout_seconds: Seconds = 30
    """Limit on every statement of the sweeper and parity."""
    log_level: str = "INFO"
    """Python logging level."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments win, then the environment, then the TOML file."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_file))
        return tuple(sources)

    @field_validator("database_url", "parity_database_url", "listen_database_url")
    @classmethod
    def _postgres_url(cls, value: str | None) -> str | None:
        # enrichq's own tables, and what parity reads, live in PostgreSQL (psycopg 3)
        if value in (None, ""):
            return None
        url = _parse_url(value)
        _check_postgres(url)
        return value

    @field_validator("warehouse_url")
    @classmethod
    def _warehouse_url(cls, value: str | None) -> str | None:
        # any SQLAlchemy dialect, as long as it (and its driver) is installed
        if value in (None, ""):
            return None
        url = _parse_url(value)
        if url.get_backend_name() in {"postgresql", "postgres"}:
            _check_postgres(url)
        else:
            _check_dialect(url)
        return value

    @field_validator("webhook_secret", "zendesk_signing_secret")
    @classmethod
    def _secrets(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        # the message never repeats the value: it is a secret
        if value is None:
            return None
        parts = value.get_secret_value().split(",")
        if not all(p.strip() for p in parts):
            raise ValueError("an empty secret (comma-separated secrets, none of them empty)")
        for i, part in enumerate(p.strip() for p in parts):
            if info.field_name != "webhook_secret":
                break  # a Zendesk signing secret is used as it is
            if part.startswith(STANDARD_WEBHOOKS_PREFIX) and not standard_webhooks_key(part):
                raise ValueError(
                    f"secret {i + 1}: a {STANDARD_WEBHOOKS_PREFIX} secret must be base64 "
                    "after its prefix (Standard Webhooks)"
                )
        return value

    @property
    def webhook_secrets(self) -> tuple[str, ...]:
        """Every secret of ENRICHQ_WEBHOOK_SECRET, in order: a signature by any verifies."""
        if self.webhook_secret is None:
            return ()
        return tuple(p.strip() for p in self.webhook_secret.get_secret_value().split(","))

    @property
    def zendesk_signing_secrets(self) -> tuple[str, ...]:
        """Every secret of ENRICHQ_ZENDESK_SIGNING_SECRET, in order: a signature by any verifies."""
        if self.zendesk_signing_secret is None:
            return ()
        value = self.zendesk_signing_secret.get_secret_value()
        return tuple(p.strip() for p in value.split(","))

    @field_validator("enricher", "batch_enricher", "gave_up_hook")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        module, sep, attr = value.partition(":")
        if not sep or not module or not attr.isidentifier():
            raise ValueError("expected package.module:function")
        return value

    @field_validator("tickets_table", "legacy_table", "customers_table", "orders_table")
    @classmethod
    def _table_name(cls, value: str, info: ValidationInfo) -> str:
        parts = value.split(".")
        if info.field_name in {"customers_table", "orders_table"}:
            # a warehouse table may name its catalog too: a BigQuery project
            # (my-project.sales.orders), a DuckDB file's catalog (dw.warehouse.orders)
            if len(parts) not in (2, 3) or not all(WAREHOUSE_NAME_PART.fullmatch(p) for p in parts):
                raise ValueError(
                    "expected schema.table or catalog.schema.table (letters, digits, _ and -)"
                )
        elif len(parts) != 2 or not all(p.isidentifier() for p in parts):
            raise ValueError("expected schema.table with plain identifiers")
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return value.upper()

    @model_validator(mode="after")
    def _remember_secrets(self) -> Settings:
        # every line this process prints or logs from now on masks them
        from enrichq_schema.secrets import remember, secrets_of_url

        for url in (
            self.database_url,
            self.warehouse_url,
            self.parity_database_url,
            self.listen_database_url,
        ):
            if url:
                remember(*secrets_of_url(url))
        remember(*self.webhook_secrets, *self.zendesk_signing_secrets)
        return self

    @field_validator("reconcile_interval_seconds")
    @classmethod
    def _reconcile_interval(cls, value: float) -> float:
        if 0 < value < RECONCILE_INTERVAL_SECONDS_MIN:
            raise ValueError(f"0 (off) or at least {RECONCILE_INTERVAL_SECONDS_MIN} s")
        return value

    @model_validator(mode="after")
    def _one_body_fits_the_buffer(self) -> Settings:
        if self.http_max_buffered_bytes < self.max_body_bytes:
            raise ValueError(
                f"ENRICHQ_HTTP_MAX_BUFFERED_BYTES ({self.http_max_buffered_bytes}) must not be "
                f"under ENRICHQ_MAX_BODY_BYTES ({self.max_body_bytes}): no body could be read"
            )
        return self

    @model_validator(mode="after")
    def _one_enricher(self) -> Settings:
        if self.enricher is not None and self.batch_enricher is not None:
            raise ValueError(
                "set ENRICHQ_ENRICHER (per ticket) or ENRICHQ_BATCH_ENRICHER (per batch), not both"
            )
        return self

    @model_validator(mode="after")
    def _heartbeat_under_half_lease(self) -> Settings:
        if self.heartbeat_seconds >= self.lease_seconds / 2:
            raise ValueError(
                f"ENRICHQ_HEARTBEAT_SECONDS ({self.heartbeat_seconds:g}) must be under half of "
                f"ENRICHQ_LEASE_SECONDS ({self.lease_seconds:g})"
            )
        if self.backoff_cap_seconds < self.backoff_base_seconds:
            raise ValueError(
                "ENRICHQ_BACKOFF_CAP_SECONDS must not be under ENRICHQ_BACKOFF_BASE_SECONDS"
            )
        return self

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Build the settings from overrides, the environment and an optional TOML file."""
        if config_file is not None:
            _check_toml(config_file)
        cls._toml_file = config_file
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise SettingsError(describe_validation_error(exc)) from None
        finally:
            cls._toml_file = None

    def safe_dump(self) -> dict[str, object]:
        """The settings as an operator may see them: passwords and secrets hidden."""
        from enrichq_schema.secrets import redacted_url

        out: dict[str, object] = {}
        for name, value in self.model_dump().items():
            if name.endswith("_url") and value:
                out[name] = redacted_url(value)
            elif isinstance(value, SecretStr):
                out[name] = "**********"
            else:
                out[name] = value.value if isinstance(value, StrEnum) else value
        return out


ENV_PREFIX = "ENRICHQ_"
# ENRICHQ_ variables that enrichq reads that are not settings: the CLI's --config and the
# embedded PostgreSQL's data directory
OTHER_VARIABLES = frozenset({"ENRICHQ_CONFIG", "ENRICHQ_EMBEDDED_DIR"})
# the test suite's own variables (tests/), never enrichq's settings
TEST_SUITE_PREFIXES = ("ENRICHQ_TEST_", "ENRICHQ_CHAOS_")


def standard_webhooks_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret (`whsec_` + base64); b"" if it is none."""
    if not secret.startswith(STANDARD_WEBHOOKS_PREFIX):
        return b""
    encoded = secret.removeprefix(STANDARD_WEBHOOKS_PREFIX)
    try:
        # the reference libraries accept unpadded base64 too: pad, extra padding is ignored
        return base64.b64decode(encoded + "==", validate=False) if encoded.isascii() else b""
    except binascii.Error:
        return b""


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line for each ENRICHQ_ variable in `environ` that enrichq does not read (a
    misspelt setting is otherwise silently ignored), naming the closest setting."""
    import difflib

    known = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    lines = []
    for name in sorted(environ):
        upper = name.upper()  # settings are read whatever the case of their names
        if not upper.startswith(ENV_PREFIX) or upper in known or upper in OTHER_VARIABLES:
            continue
        if upper.startswith(TEST_SUITE_PREFIXES):
            continue
        line = f"{printable(name)} is not an enrichq setting: ignored"
        close = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.75)
        if close:
            line += f" (did you mean {close[0]}?)"
        lines.append(line)
    return lines


def _check_toml(path: Path) -> None:
    """A config file that exists and is TOML; else SettingsError naming it and the line."""
    import tomllib

    if not path.is_file():
        raise SettingsError(f"config file {path}: not found")
    try:
        tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:  # its message ends in "(at line L, column C)"
        raise SettingsError(f"config file {path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"config file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise SettingsError(f"config file {path}: cannot be read ({exc.strerror})") from None


def _parse_url(value: str) -> URL:
    from sqlalchemy.engine import make_url

    _, _, rest = value.partition("://")
    if rest.split("/", 1)[0].count("@") > 1:
        # the driver would take what follows the first '@' for the host, and quote that part
        # of the password in its error
        raise ValueError(
            "its user or password holds an unescaped '@': percent-encode it as %40 (a ':', "
            "'/', '?' or '#' in a password likewise)"
        )
    try:
        return make_url(value)
    except Exception as exc:
        raise ValueError("not a database URL (expected postgresql+psycopg://...)") from exc


@functools.cache
def _libpq_options() -> frozenset[str]:
    """Every connection option libpq knows (what a postgresql:// URL's query may set)."""
    import psycopg

    return frozenset(o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults())


# libpq's options whose value is a whole number, and the range libpq and the OS accept (a
# bad one would fail at the first connection, with a traceback)
INTEGER_OPTIONS = {
    "port": (1, 65535),
    "connect_timeout": (0, 2_147_483),
    "keepalives": (0, 1),
    "keepalives_idle": (0, 2_147_483),
    "keepalives_interval": (0, 2_147_483),
    "keepalives_count": (0, 2_147_483),
    "tcp_user_timeout": (0, 2_147_483_647),
}


def _check_postgres(url: URL) -> None:
    """A PostgreSQL URL whose query options libpq knows (never the password in a message)."""
    backend = url.get_backend_name()
    if backend == "postgres":
        raise ValueError("write postgresql://, not postgres:// (SQLAlchemy knows only the former)")
    if backend != "postgresql":
        raise ValueError(
            f"enrichq keeps its queue in PostgreSQL: expected postgresql://..., not {backend}://"
        )
    unknown = sorted(set(url.query) - _libpq_options())
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise ValueError(
            f"unknown connection option {names} (libpq options only, such as sslmode, "
            "connect_timeout, application_name)"
        )
    for name, (low, high) in INTEGER_OPTIONS.items():
        value = url.query.get(name)
        if value is None:
            continue
        values = [value] if isinstance(value, str) else list(value)
        for one in values:
            # a port list (host=a,b&port=1,2) names a port per host
            for part in one.split(",") if name == "port" else [one]:
                if not part.strip().isdigit() or not low <= int(part) <= high:
                    raise ValueError(
                        f"connection option {name!r} must be a whole number from {low} to {high}"
                    )


def _check_dialect(url: URL) -> None:
    """The URL's SQLAlchemy dialect is installed, and for SQLAlchemy's own dialects, its
    driver too. A third-party dialect (BigQuery, DuckDB) is found by its entry point, not
    imported: its driver loads with it when the warehouse is first used, and importing it
    here would slow every command down."""
    from importlib.metadata import entry_points

    import sqlalchemy.dialects
    from sqlalchemy.exc import NoSuchModuleError

    backend = url.get_backend_name()
    plugins = {ep.name for ep in entry_points(group="sqlalchemy.dialects")}
    if backend not in sqlalchemy.dialects.__all__:
        if backend in plugins or url.drivername.replace("+", ".") in plugins:
            return
        raise ValueError(
            f"no SQLAlchemy dialect for {backend}:// is installed (install its package, "
            "e.g. sqlalchemy-bigquery or duckdb-engine)"
        )
    try:
        url.get_dialect().import_dbapi()
    except NoSuchModuleError:
        raise ValueError(f"SQLAlchemy has no driver {url.drivername!r}") from None
    except ImportError as exc:
        raise ValueError(
            f"the database driver of {url.drivername}:// is not installed ({exc})"
        ) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming the first bad field as its environment variable."""
    problem = validation_problem(
        exc.errors(include_input=False, include_url=False),
        field=lambda loc: f"ENRICHQ_{'.'.join(str(p) for p in loc).upper()}" if loc else "",
    )
    if problem.startswith("ENRICHQ_"):
        return f"invalid setting {problem}"
    return f"invalid configuration: {problem}"
