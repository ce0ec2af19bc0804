"""Settings for tests: short, deterministic defaults unless a test overrides them."""

from __future__ import annotations

import math
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
        # most tests assume work visible the moment its delay ends; the window's own tests
        # set it
        "lookup_window_seconds": 0,
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


def numeric_settings() -> dict[str, type]:
    """Every numeric setting and its type (int or float)."""
    kinds: dict[str, type] = {}
    for name, field in Settings.model_fields.items():
        if field.annotation is int:
            kinds[name] = int
        elif field.annotation is float:
            kinds[name] = float
    return kinds


def bounds(name: str) -> tuple[float, float]:
    """A numeric setting's smallest and largest accepted values, as its type says."""
    low, high = -math.inf, math.inf
    for bound in Settings.model_fields[name].metadata:
        low = max(low, getattr(bound, "ge", getattr(bound, "gt", -math.inf)))
        high = min(high, getattr(bound, "le", getattr(bound, "lt", math.inf)))
    return low, high


def at_their_largest(database_url: str | None = None, **overrides: Any) -> Settings:
    """Every numeric setting at the largest value its type accepts (the heartbeat under
    half the lease, as it must be)."""
    values: dict[str, Any] = {name: bounds(name)[1] for name in numeric_settings()}
    values["heartbeat_seconds"] = values["lease_seconds"] / 2 - 1
    values.update(overrides)
    return Settings.load(database_url=database_url, **values)
