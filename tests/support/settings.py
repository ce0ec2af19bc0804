"""Settings for tests: short, deterministic defaults unless a test overrides them."""

from __future__ import annotations

from typing import Any

from enrichq_schema.settings import Settings


def make_settings(database_url: str | None = None, **overrides: Any) -> Settings:
    """Settings for a test: short, deterministic defaults unless the test overrides them."""
    values: dict[str, Any] = {
        "database_url": database_url,
        "delay_created_seconds": 0,
        "delay_updated_seconds": 0,
        "lease_seconds": 30,
        "heartbeat_seconds": 5,
        "poll_seconds": 0.5,
    }
    values.update(overrides)
    return Settings.load(**values)


def parity_settings(url: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "delay_created_seconds": 600,
        "parity_grace_seconds": 3600,
        "parity_min_order_coverage": 0.995,
        "parity_max_shadow_fault_rate": 0.005,
        "parity_min_ticket_match_rate": 0.99,
    }
    values.update(overrides)
    return make_settings(url, **values)
