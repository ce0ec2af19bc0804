"""The exception root and the translation of driver errors into one-line messages."""

from __future__ import annotations


class EnrichqError(Exception):
    """Unexpected enrichq error."""


class EmbeddedPostgresError(EnrichqError):
    """The embedded PostgreSQL could not be started."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class SettingsError(EnrichqError):
    """The configuration is invalid."""


class MigrationLocked(EnrichqError):
    """A migration could not get a table lock in time."""


def constraint_name(exc: BaseException) -> str | None:
    """The name of the constraint a driver error violated, if any (never parsed from text)."""
    orig = getattr(exc, "orig", exc)
    diag = getattr(orig, "diag", None)
    name = getattr(diag, "constraint_name", None)
    return str(name) if name else None


def describe_database_error(exc: BaseException) -> str | None:
    """A one-line description of a database problem an operator can act on, else None."""
    import sqlalchemy.exc as sa_exc

    if isinstance(exc, EmbeddedPostgresError):
        return f"embedded PostgreSQL: {exc}"
    if isinstance(exc, sa_exc.OperationalError):
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else "connection failed"
        return f"database unavailable: {first}"
    # undefined_table, undefined_schema: the database was never migrated.
    if getattr(getattr(exc, "orig", None), "sqlstate", None) in {"42P01", "3F000"}:
        first = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        return f"{first} (run `enrichq migrate` first)"
    return None
