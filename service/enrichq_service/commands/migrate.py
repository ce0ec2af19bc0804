"""`enrichq migrate [--check [--wait S]]`: bring the schema to head, or say whether it is."""

from __future__ import annotations

import time

from enrichq_schema.process import Exit
from enrichq_service.commands.base import Context, refuse
from enrichq_service.terminal import say

SCHEMA_CHECK_SECONDS = 2.0
"""How often `migrate --check --wait` looks again."""


def migrate(ctx: Context, *, check: bool, wait: float | None) -> int:
    """Upgrade to head (0; 1 while another process holds the migration lock), or with
    `check` only say whether the schema is at head."""
    if wait is not None and not check:
        refuse("migrate: --wait goes with --check")
    ctx.settings  # noqa: B018 -- a bad setting stops the command before any connection
    if check:
        return check_schema(ctx, wait)
    from enrichq_schema.db import migrate as run_migrations
    from enrichq_schema.db import redact
    from enrichq_schema.errors import MigrationLocked

    with ctx.database() as url:
        try:
            run_migrations(url)
        except MigrationLocked as exc:
            refuse(f"migrate: {exc}", Exit.FAILED)
        print(f"migrated {redact(url)} to head", file=ctx.out)
    return Exit.OK


def check_schema(ctx: Context, wait: float | None) -> int:
    """`migrate --check [--wait S]`: 0 at head, 1 while behind (or unreachable at the end)."""
    import sqlalchemy.exc as sa_exc

    from enrichq_schema.db import current_revision, head_revision
    from enrichq_schema.errors import describe_database_error

    deadline = time.monotonic() + (wait or 0.0)
    head = head_revision()
    with ctx.opened("enrichq-migrate-check", statement_timeout=False) as engine:
        while True:
            try:
                with engine.connect() as conn:
                    current = current_revision(conn)
                problem = (
                    None
                    if current == head
                    else f"the schema is at revision {current or 'none'}, not {head} "
                    "(run `enrichq migrate`)"
                )
            except sa_exc.DBAPIError as exc:
                problem = describe_database_error(exc) or str(exc).splitlines()[0]
            if problem is None:
                print(f"the schema is at head ({head})", file=ctx.out)
                return Exit.OK
            if time.monotonic() + SCHEMA_CHECK_SECONDS > deadline:
                say(f"migrate --check: {problem}", ctx.err)
                return Exit.FAILED
            time.sleep(SCHEMA_CHECK_SECONDS)
