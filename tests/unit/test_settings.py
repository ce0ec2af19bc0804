"""Settings: the DESIGN §6 names and defaults, TOML files, and one-line refusals."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from tests.support.settings import at_their_largest, bounds, numeric_settings

from enrichq_schema.errors import SettingsError
from enrichq_schema.settings import Mode, Settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("ENRICHQ_"):
            monkeypatch.delenv(name)


def test_defaults_match_the_design() -> None:
    s = Settings.load()
    assert s.database_url is None
    assert s.mode is Mode.SHADOW
    assert (s.lease_seconds, s.heartbeat_seconds) == (60, 15)
    assert (s.delay_created_seconds, s.delay_updated_seconds) == (600, 120)
    assert (s.max_attempts, s.backoff_base_seconds, s.backoff_cap_seconds) == (5, 5, 300)
    assert s.attempt_deadline_seconds == 300
    assert (s.sweep_interval_seconds, s.poll_seconds, s.concurrency) == (30, 5, 8)
    assert (s.retention_days, s.dead_letter_retention_days) == (30, 90)
    assert s.daily_bytes_budget == 0
    assert s.max_bytes_per_query == 10 * 2**30
    assert s.tickets_table == "helpdesk.tickets"
    assert s.legacy_table == "legacy.ticket_orders"
    assert (s.http_port, s.metrics_port) == (8080, 9464)
    assert (s.parity_min_order_coverage, s.parity_min_ticket_match_rate) == (0.995, 0.99)
    assert s.parity_max_shadow_fault_rate == 0.005
    assert s.parity_max_age_hours == 24


def test_environment_variables_are_prefixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENRICHQ_LEASE_SECONDS", "120")
    monkeypatch.setenv("ENRICHQ_HEARTBEAT_SECONDS", "20")
    monkeypatch.setenv("ENRICHQ_WEBHOOK_SECRET", "s3cret")
    s = Settings.load()
    assert s.lease_seconds == 120
    assert s.heartbeat_seconds == 20
    assert s.webhook_secret == SecretStr("s3cret")


def test_toml_file_is_read_and_environment_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "enrichq.toml"
    cfg.write_text("concurrency = 3\nmax_attempts = 7\n")
    monkeypatch.setenv("ENRICHQ_MAX_ATTEMPTS", "9")
    s = Settings.load(cfg)
    assert s.concurrency == 3
    assert s.max_attempts == 9


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ENRICHQ_HEARTBEAT_SECONDS": "30"}, "ENRICHQ_HEARTBEAT_SECONDS"),
        ({"ENRICHQ_DELAY_CREATED_SECONDS": "-1"}, "ENRICHQ_DELAY_CREATED_SECONDS"),
        ({"ENRICHQ_MODE": "yolo"}, "ENRICHQ_MODE"),
        # below BigQuery's 10 MB minimum every query would be refused; above 2^50 no lookup
        # may report its bill
        ({"ENRICHQ_MAX_BYTES_PER_QUERY": str(10 * 2**20 - 1)}, "ENRICHQ_MAX_BYTES_PER_QUERY"),
        ({"ENRICHQ_MAX_BYTES_PER_QUERY": str(2**50 + 1)}, "ENRICHQ_MAX_BYTES_PER_QUERY"),
        ({"ENRICHQ_CONCURRENCY": "many"}, "ENRICHQ_CONCURRENCY"),
        ({"ENRICHQ_PARITY_CONCURRENCY": "0"}, "ENRICHQ_PARITY_CONCURRENCY"),
        ({"ENRICHQ_ENRICHER": "no_colon"}, "ENRICHQ_ENRICHER"),
        ({"ENRICHQ_TICKETS_TABLE": "x; drop table y"}, "ENRICHQ_TICKETS_TABLE"),
        ({"ENRICHQ_DATABASE_URL": "::nonsense::"}, "ENRICHQ_DATABASE_URL"),
        (
            {"ENRICHQ_DATABASE_URL": "postgresql://u:pw@h/db?foo=bar"},
            "unknown connection option 'foo'",
        ),
        ({"ENRICHQ_DATABASE_URL": "mysql://u:pw@h/db"}, "expected postgresql://"),
        ({"ENRICHQ_DATABASE_URL": "sqlite:///enrichq.db"}, "expected postgresql://"),
        ({"ENRICHQ_DATABASE_URL": "postgres://u:pw@h/db"}, "not postgres://"),
        ({"ENRICHQ_PARITY_DATABASE_URL": "mssql://u:pw@h/db"}, "ENRICHQ_PARITY_DATABASE_URL"),
        ({"ENRICHQ_WAREHOUSE_URL": "snowflake://account/db"}, "no SQLAlchemy dialect"),
        ({"ENRICHQ_WAREHOUSE_URL": "mysql://u:pw@h/db"}, "driver of mysql:// is not installed"),
        ({"ENRICHQ_WAREHOUSE_URL": "postgresql://u:pw@h/db?sslmod=x"}, "'sslmod'"),
        ({"ENRICHQ_POOL_MODE": "statement"}, "ENRICHQ_POOL_MODE"),
        ({"ENRICHQ_NETWORK_TIMEOUT_SECONDS": "-1"}, "ENRICHQ_NETWORK_TIMEOUT_SECONDS"),
        ({"ENRICHQ_LISTEN_DATABASE_URL": "mysql://u:pw@h/db"}, "ENRICHQ_LISTEN_DATABASE_URL"),
        ({"ENRICHQ_ORDERS_TABLE": "a.b.c.d"}, "ENRICHQ_ORDERS_TABLE"),
        ({"ENRICHQ_CUSTOMERS_TABLE": "sales.customers; --"}, "ENRICHQ_CUSTOMERS_TABLE"),
        ({"ENRICHQ_TICKETS_TABLE": "db.helpdesk.tickets"}, "ENRICHQ_TICKETS_TABLE"),
        ({"ENRICHQ_NO_SUCH_THING": "1"}, None),
    ],
)
def test_impossible_values_are_refused_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str | None
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if expected is None:
        # Unknown variables in the environment are ignored (other tools share the prefix
        # space only by accident); unknown keys in a TOML file are refused below.
        Settings.load()
        return
    with pytest.raises(SettingsError) as info:
        Settings.load()
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("name", "url"),
    [
        ("database_url", "postgresql://u:pw@h:5432/db?sslmode=require&connect_timeout=5"),
        ("database_url", "postgresql+psycopg2://u@/db?host=a:5432&host=b:5432"),
        ("database_url", "postgresql://u@h/db?target_session_attrs=read-write"),
        ("listen_database_url", "postgresql://u@db-direct:5432/db?keepalives_idle=30"),
        ("warehouse_url", "sqlite:///warehouse.db"),
        ("warehouse_url", "postgresql://u@h/warehouse?application_name=lookups"),
        ("warehouse_url", "duckdb:///var/lib/warehouse/dw.duckdb?access_mode=read_only"),
    ],
)
def test_urls_enrichq_can_use_are_accepted(name: str, url: str) -> None:
    overrides: dict[str, Any] = {name: url}
    assert getattr(Settings.load(None, **overrides), name) == url


@pytest.mark.parametrize(
    "table", ["warehouse.orders", "my-project.sales.orders", "dw.warehouse.orders"]
)
def test_warehouse_tables_may_name_their_catalog(table: str) -> None:
    assert Settings.load(orders_table=table, customers_table=table).orders_table == table


def test_a_refused_url_never_shows_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ("postgresql://u:hunter2@h/db?foo=1", "mysql://u:hunter2@h/db"):
        monkeypatch.setenv("ENRICHQ_DATABASE_URL", url)
        with pytest.raises(SettingsError) as info:
            Settings.load()
        assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"concurrency = 3\nmax_attempts = \n", "line 2"),
        (b"[table\n", "line 1"),
        (b"concurrency = 3\nconcurrency = 4\n", "line 2"),
        (b"\xff\xfe = 1\n", "not UTF-8"),
    ],
)
def test_a_malformed_toml_file_is_refused_naming_the_line(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    cfg = tmp_path / "enrichq.toml"
    cfg.write_bytes(content)
    with pytest.raises(SettingsError) as info:
        Settings.load(cfg)
    message = str(info.value)
    assert message.startswith(f"config file {cfg}: ")
    assert expected in message
    assert "\n" not in message


def test_unknown_key_in_toml_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "enrichq.toml"
    cfg.write_text("leese_seconds = 10\n")
    with pytest.raises(SettingsError, match="ENRICHQ_LEESE_SECONDS"):
        Settings.load(cfg)


def test_missing_config_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not found"):
        Settings.load(tmp_path / "absent.toml")


def test_safe_dump_hides_passwords_and_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", "postgresql://app:hunter2@db:5432/enrichq")
    monkeypatch.setenv("ENRICHQ_WEBHOOK_SECRET", "topsecret")
    dumped = repr(Settings.load().safe_dump())
    assert "hunter2" not in dumped
    assert "topsecret" not in dumped
    assert "app:***@db" in dumped


def test_a_per_ticket_and_a_batch_enricher_together_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ENRICHQ_ENRICHER", "tests.support.enrichers:tagged")
    monkeypatch.setenv("ENRICHQ_BATCH_ENRICHER", "tests.support.enrichers:noop_batch")
    with pytest.raises(SettingsError, match="not both") as info:
        Settings.load()
    assert "\n" not in str(info.value)


def test_the_built_in_batch_lookup_is_the_default_enricher() -> None:
    from enrichq_service.enrich import choose, warehouse_lookup, warehouse_lookup_batch

    default = choose(Settings.load())
    assert (default.batch, default.per_ticket, default.unit_size) == (
        warehouse_lookup_batch,
        None,
        200,
    )
    single = choose(Settings.load(enricher="enrichq_service.enrich:warehouse_lookup"))
    assert (single.per_ticket, single.batch, single.unit_size) == (warehouse_lookup, None, 1)


def test_unknown_variables_are_named_with_the_closest_setting() -> None:
    from enrichq_schema.settings import unknown_variables

    environ = {
        "ENRICHQ_LEESE_SECONDS": "10",  # a typo
        "ENRICHQ_WAREHOUSE_MAX_CONCURENCY": "4",  # another
        "ENRICHQ_NO_SUCH_THING": "1",  # nothing close
        "enrichq_concurency": "2",  # read whatever its case, so warned whatever its case
        "ENRICHQ_LEASE_SECONDS": "10",  # settings, and what enrichq reads besides them
        "ENRICHQ_CONFIG": "/etc/enrichq.toml",
        "ENRICHQ_EMBEDDED_DIR": "/tmp/pg",
        "ENRICHQ_TEST_DATABASE_URL": "postgresql://localhost/x",  # the test suite's
        "PATH": "/usr/bin",
    }
    assert unknown_variables(environ) == [
        "ENRICHQ_LEESE_SECONDS is not an enrichq setting: ignored"
        " (did you mean ENRICHQ_LEASE_SECONDS?)",
        "ENRICHQ_NO_SUCH_THING is not an enrichq setting: ignored",
        "ENRICHQ_WAREHOUSE_MAX_CONCURENCY is not an enrichq setting: ignored"
        " (did you mean ENRICHQ_WAREHOUSE_MAX_CONCURRENCY?)",
        "enrichq_concurency is not an enrichq setting: ignored (did you mean ENRICHQ_CONCURRENCY?)",
    ]


# -- every number is finite and bounded (issue 31): refused at start-up, in one line


NUMBERS = sorted(numeric_settings())


def test_every_number_has_a_finite_upper_bound_and_floats_refuse_inf_and_nan() -> None:
    assert len(NUMBERS) >= 30  # the lookup found them
    for name in NUMBERS:
        low, high = bounds(name)
        assert math.isfinite(low), name
        assert math.isfinite(high), name
        if numeric_settings()[name] is float:
            flags = [
                getattr(m, "allow_inf_nan", None) for m in Settings.model_fields[name].metadata
            ]
            assert False in flags, f"{name} lets inf and nan through"


def _refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> str:
    monkeypatch.setenv(f"ENRICHQ_{name.upper()}", value)
    with pytest.raises(SettingsError) as info:
        Settings.load()
    return str(info.value)


@pytest.mark.parametrize("name", NUMBERS)
@pytest.mark.parametrize("value", ["inf", "-inf", "Infinity", "nan", "NaN", "1e300", "-1e300"])
def test_inf_nan_and_huge_numbers_are_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    message = _refused(monkeypatch, name, value)
    assert message.startswith(f"invalid setting ENRICHQ_{name.upper()}: ")
    assert "\n" not in message


@pytest.mark.parametrize("name", NUMBERS)
def test_one_past_the_largest_value_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    _, high = bounds(name)
    past = high + 1 if numeric_settings()[name] is int else math.nextafter(high, math.inf)
    message = _refused(monkeypatch, name, repr(past))
    assert message.startswith(f"invalid setting ENRICHQ_{name.upper()}: ")
    assert "less than or equal" in message
    assert "\n" not in message


def test_the_largest_value_of_every_number_is_accepted() -> None:
    settings = at_their_largest()
    for name in NUMBERS:
        if name != "heartbeat_seconds":
            assert getattr(settings, name) == bounds(name)[1], name


def test_durations_fit_postgres_milliseconds_and_python_waits() -> None:
    """A duration that becomes a statement_timeout or an idle-in-transaction timeout is
    sent in whole milliseconds of a 32-bit integer, and at least 1 ms (0 means none);
    every duration is something threading's waits take."""
    import threading

    for name in ("attempt_deadline_seconds", "statement_timeout_seconds", "lease_seconds"):
        low, high = bounds(name)
        assert int(high * 1000) <= 2**31 - 1, name
        assert int(low * 1000) >= 1, name
    for name in NUMBERS:
        if name.endswith("_seconds"):
            assert bounds(name)[1] <= threading.TIMEOUT_MAX, name


@given(
    name=st.sampled_from(NUMBERS),
    number=st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**70), 2**70),
)
@settings(max_examples=300, deadline=None)
def test_any_number_is_refused_in_one_line_or_accepted_finite_within_itsbounds(
    name: str, number: float
) -> None:
    variable = f"ENRICHQ_{name.upper()}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(variable, str(number))
        if name == "heartbeat_seconds":  # under half the lease, whatever the lease
            env.setenv("ENRICHQ_LEASE_SECONDS", str(bounds("lease_seconds")[1]))
        if name == "backoff_base_seconds":  # under the cap, whatever the cap
            env.setenv("ENRICHQ_BACKOFF_CAP_SECONDS", str(bounds("backoff_cap_seconds")[1]))
        try:
            value, refused = getattr(Settings.load(), name), None
        except SettingsError as exc:
            value, refused = None, str(exc)
    if refused is not None:
        # the variable named (a value that contradicts another names both)
        assert refused.startswith("invalid setting ")
        assert variable in refused
        assert "\n" not in refused
        return
    low, high = bounds(name)
    assert math.isfinite(value)
    assert low <= value <= high


def test_the_lookup_window_is_bounded_and_defaults_to_thirty_seconds() -> None:
    assert Settings.load().lookup_window_seconds == 30
    assert Settings.load(lookup_window_seconds=0).lookup_window_seconds == 0
    for bad in (-1, 3601, float("nan"), float("inf")):
        with pytest.raises(SettingsError, match="ENRICHQ_LOOKUP_WINDOW_SECONDS"):
            Settings.load(lookup_window_seconds=bad)


OLD_SECRET = "whsec-old-8e2c41"
NEW_SECRET = "whsec-new-f07a93"


def test_an_empty_secret_in_the_list_is_refused_without_showing_the_others() -> None:
    from enrichq_schema.errors import SettingsError

    with pytest.raises(SettingsError) as info:
        Settings.load(webhook_secret=f"{NEW_SECRET},,{OLD_SECRET}")
    assert "ENRICHQ_WEBHOOK_SECRET" in str(info.value)
    assert NEW_SECRET not in str(info.value)
    assert OLD_SECRET not in str(info.value)
