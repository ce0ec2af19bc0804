"""The checks every command's options share: one validator each for an actor, a tenant,
row ids and a day. Each refuses with one line (exit 2) before any connection; the
domain's own checks still run after them."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import click

from enrichq_schema.states import TENANT_MAX_LENGTH
from enrichq_service.commands.base import refuse

# A queue row id is a PostgreSQL bigint: a larger --id names no row and cannot be bound.
ROW_ID_MAX = 2**63 - 1
ROW_ID = click.IntRange(min=1, max=ROW_ID_MAX)


def unpadded(command: str, option: str, value: str | None) -> str | None:
    """`value` unless it has spaces around it: then refuse it, naming what was probably
    meant. A tenant `'acme '` is not tenant `acme`: pausing it would stop nothing, and
    cancelling by it would match nothing."""
    if value is not None and value != value.strip():
        refuse(
            f"{command}: {option}: {value!r} has spaces around it (did you mean "
            f"{value.strip()!r}?); nothing changed"
        )
    return value


def actor(command: str, value: str | None) -> str:
    """Who acts: `value` (default: the OS user), stripped and checked for the audit log."""
    from enrichq_schema.audit import AuditInputError, check_actor, default_actor

    try:
        return check_actor(default_actor() if value is None else value)
    except AuditInputError as exc:
        refuse(f"{command}: {exc}; nothing changed")


def tenant(command: str, value: str | None) -> str | None:
    """A --tenant that names stored rows: at most TENANT_MAX_LENGTH printable characters
    ('' = the rows of no tenant)."""
    if value is not None and (len(value) > TENANT_MAX_LENGTH or not value.isprintable()):
        refuse(
            f"{command}: --tenant {value!r}: expected at most {TENANT_MAX_LENGTH} "
            "printable characters"
        )
    return value


def tenants(command: str, values: Sequence[str]) -> tuple[str, ...]:
    """Repeated --tenant values, each checked by `tenant`, duplicates dropped."""
    for value in values:
        tenant(command, value)
    return tuple(dict.fromkeys(values))


def day(value: str | None, name: str) -> datetime | None:
    """`value` (YYYY-MM-DD or an ISO time; UTC when it names no zone) as a time."""
    if value is None:
        return None
    from datetime import UTC, date

    try:
        if len(value) == 10:
            return datetime.combine(date.fromisoformat(value), datetime.min.time(), tzinfo=UTC)
        parsed = datetime.fromisoformat(value)
    except ValueError:
        refuse(f"{name}: {value!r} is not a date (YYYY-MM-DD) or ISO timestamp")
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
