"""Process settings: environment variables prefixed ``ENRICHQ_`` and an optional TOML file.

One ``Settings`` object is built in ``main()`` and passed down; nothing here runs at import.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from enrichq_service.errors import SettingsError

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
BUILTIN_ENRICHER = "enrichq_service.enrich:warehouse_lookup"
BUILTIN_GAVE_UP_HOOK = "enrichq_sweeper.recovery:log_gave_up"


class Mode(StrEnum):
    """Which world the service writes: only its own tables (shadow) or it serves consumers."""

    SHADOW = "shadow"
    LIVE = "live"


class Settings(BaseSettings):
    """Everything an operator or a test can turn; names are the contract of DESIGN §6."""

    model_config = SettingsConfigDict(
        env_prefix="ENRICHQ_",
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    # Set by ``Settings.load(config_file=...)`` before construction; pydantic-settings
    # reads it in ``settings_customise_sources``.
    _toml_file: ClassVar[Path | None] = None

    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL of the queue database; unset = embedded."
    )
    warehouse_url: str | None = Field(
        default=None, description="SQLAlchemy URL of the warehouse; unset = the queue database."
    )
    parity_database_url: str | None = Field(
        default=None, description="Where parity reads (a read replica); unset = the database."
    )
    mode: Mode = Field(default=Mode.SHADOW, description="shadow (default) or live.")
    lease_seconds: float = Field(default=LEASE_SECONDS_DEFAULT, gt=0, description="Lease length.")
    heartbeat_seconds: float = Field(
        default=HEARTBEAT_SECONDS_DEFAULT, gt=0, description="Heartbeat period; < lease/2."
    )
    delay_created_seconds: float = Field(
        default=DELAY_CREATED_SECONDS_DEFAULT, ge=0, description="Visibility delay, new ticket."
    )
    delay_updated_seconds: float = Field(
        default=DELAY_UPDATED_SECONDS_DEFAULT, ge=0, description="Visibility delay, activity."
    )
    max_attempts: int = Field(default=MAX_ATTEMPTS_DEFAULT, ge=1, le=100, description="Claims.")
    backoff_base_seconds: float = Field(
        default=BACKOFF_BASE_SECONDS_DEFAULT, ge=0, description="Retry backoff base."
    )
    backoff_cap_seconds: float = Field(
        default=BACKOFF_CAP_SECONDS_DEFAULT, ge=0, description="Retry backoff cap."
    )
    attempt_deadline_seconds: float = Field(
        default=ATTEMPT_DEADLINE_SECONDS_DEFAULT, gt=0, description="One attempt's time limit."
    )
    sweep_interval_seconds: float = Field(
        default=SWEEP_INTERVAL_SECONDS_DEFAULT, gt=0, description="Lease recovery period."
    )
    poll_seconds: float = Field(
        default=POLL_SECONDS_DEFAULT, gt=0, description="Backstop poll when no NOTIFY arrives."
    )
    concurrency: int = Field(
        default=CONCURRENCY_DEFAULT, ge=1, le=1024, description="Jobs in flight per worker."
    )
    retention_days: float = Field(
        default=RETENTION_DAYS_DEFAULT, gt=0, description="Keep done/failed rows this long."
    )
    dead_letter_retention_days: float = Field(
        default=DEAD_LETTER_RETENTION_DAYS_DEFAULT, gt=0, description="Keep dead letters."
    )
    daily_bytes_budget: int = Field(
        default=0, ge=0, description="Warehouse bytes billed per UTC day; 0 = no budget."
    )
    enricher: str = Field(
        default=BUILTIN_ENRICHER, description="package.module:function of the enrichment."
    )
    gave_up_hook: str = Field(
        default=BUILTIN_GAVE_UP_HOOK, description="Called with rows whose attempts are spent."
    )
    tickets_table: str = Field(
        default="helpdesk.tickets", description="The help desk's ticket mirror (schema.table)."
    )
    customers_table: str = Field(
        default="warehouse.customers", description="Warehouse customers (schema.table)."
    )
    orders_table: str = Field(
        default="warehouse.orders", description="Warehouse orders (schema.table)."
    )
    legacy_table: str = Field(
        default="legacy.ticket_orders", description="What the legacy flow wrote."
    )
    webhook_secret: SecretStr | None = Field(
        default=None, description="HMAC key of POST /v1/events; unset refuses every event."
    )
    webhook_tolerance_seconds: float = Field(
        default=300, gt=0, description="Accepted clock skew of a signed event's timestamp."
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="Largest accepted POST /v1/events body."
    )
    http_host: str = Field(default="0.0.0.0", description="Address `serve` binds.")  # noqa: S104 -- a service listens on all interfaces in its container
    http_port: int = Field(default=HTTP_PORT_DEFAULT, ge=0, le=65535, description="HTTP port.")
    metrics_port: int = Field(
        default=METRICS_PORT_DEFAULT, ge=0, le=65535, description="/metrics without HTTP server."
    )
    shutdown_grace_seconds: float = Field(
        default=30, ge=0, description="How long in-flight work may finish on SIGTERM."
    )
    refresh_interval_seconds: float = Field(
        default=3600, gt=0, description="How often the sweeper enqueues refresh work."
    )
    parity_grace_seconds: float = Field(
        default=3600, ge=0, description="Extra age past the visibility delay before parity."
    )
    parity_interval_hours: float = Field(
        default=0, ge=0, description="Sweeper runs parity this often; 0 = never."
    )
    parity_min_order_coverage: float = Field(
        default=PARITY_MIN_ORDER_COVERAGE_DEFAULT,
        ge=0,
        le=1,
        description="Parity pass bar: |shadow ∩ legacy| / |legacy| over the orders.",
    )
    parity_min_ticket_match_rate: float = Field(
        default=PARITY_MIN_TICKET_MATCH_RATE_DEFAULT,
        ge=0,
        le=1,
        description="Below it the report marks how often both flows agree; not a pass bar.",
    )
    parity_max_shadow_fault_rate: float = Field(
        default=PARITY_MAX_SHADOW_FAULT_RATE_DEFAULT,
        ge=0,
        le=1,
        description="Parity pass bar: tickets that are enrichq's fault / tickets compared.",
    )
    parity_max_age_hours: float = Field(
        default=PARITY_MAX_AGE_HOURS_DEFAULT, gt=0, description="Cutover needs a younger run."
    )
    parity_concurrency: int = Field(
        default=2, ge=1, le=16, description="Days parity compares at once, a connection each."
    )
    statement_timeout_seconds: float = Field(
        default=30, gt=0, description="Limit on every statement of the sweeper and parity."
    )
    log_level: str = Field(default="INFO", description="Python logging level.")

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

    @field_validator("database_url", "warehouse_url", "parity_database_url")
    @classmethod
    def _url_parses(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        from sqlalchemy.engine import make_url

        try:
            make_url(value)
        except Exception as exc:
            raise ValueError("not a database URL (expected postgresql+psycopg://...)") from exc
        return value

    @field_validator("enricher", "gave_up_hook")
    @classmethod
    def _import_path(cls, value: str) -> str:
        module, sep, attr = value.partition(":")
        if not sep or not module or not attr.isidentifier():
            raise ValueError("expected package.module:function")
        return value

    @field_validator("tickets_table", "customers_table", "orders_table", "legacy_table")
    @classmethod
    def _qualified_name(cls, value: str) -> str:
        parts = value.split(".")
        if len(parts) != 2 or not all(p.isidentifier() for p in parts):
            raise ValueError("expected schema.table with plain identifiers")
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return value.upper()

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
        if config_file is not None and not config_file.is_file():
            raise SettingsError(f"config file {config_file}: not found")
        cls._toml_file = config_file
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise SettingsError(describe_validation_error(exc)) from None
        finally:
            cls._toml_file = None

    def safe_dump(self) -> dict[str, object]:
        """The settings as an operator may see them: passwords and secrets hidden."""
        from sqlalchemy.engine import make_url

        out: dict[str, object] = {}
        for name, value in self.model_dump().items():
            if name.endswith("_url") and value:
                out[name] = make_url(value).render_as_string(hide_password=True)
            elif isinstance(value, SecretStr):
                out[name] = "**********"
            else:
                out[name] = value.value if isinstance(value, StrEnum) else value
        return out


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming the first bad field as its environment variable."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    message = str(err["msg"]).removeprefix("Value error, ")
    extra = f" (+{len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    if not loc:
        return f"invalid configuration: {message}{extra}"
    return f"invalid setting ENRICHQ_{loc.upper()}: {message}{extra}"
