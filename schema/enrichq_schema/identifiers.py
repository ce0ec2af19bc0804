"""Configured table names spliced into named SQL as quoted identifiers: the one way every
package puts a table name into a statement."""

from __future__ import annotations

import re
from functools import cache

import sqlalchemy as sa

from enrichq_schema.queries import Query, load

_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


def qualified(dialect: sa.Dialect, name: str) -> str:
    """``schema.table`` quoted part by part by the dialect (reserved words, upper case)."""
    schema, _, table = name.partition(".")
    if not schema or not table or not schema.isidentifier() or not table.isidentifier():
        raise ValueError(f"{name!r}: expected schema.table with plain identifiers")
    return dialect.identifier_preparer.format_table(sa.table(table, schema=schema))


def qualified_parts(dialect: sa.Dialect, name: str) -> str:
    """A warehouse table's name of one to three parts (``table``, ``schema.table``,
    ``catalog.schema.table``: a BigQuery ``project.dataset.table``, say) quoted part by
    part by the dialect. Settings has checked each part (WAREHOUSE_NAME_PART)."""
    parts = name.split(".")
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise ValueError(f"{name!r}: expected one to three dot-separated parts")
    return ".".join(dialect.identifier_preparer.quote(part) for part in parts)


def render(query: Query, **relations: str) -> sa.TextClause:
    """The query with every ``{name}`` replaced by the given relation SQL (already quoted)."""
    return _render(query.sql, tuple(sorted(relations.items())))


@cache
def _render(sql: str, relations: tuple[tuple[str, str], ...]) -> sa.TextClause:
    given = dict(relations)
    wanted = set(_PLACEHOLDER.findall(sql))
    if wanted != set(given):
        raise KeyError(f"placeholders {sorted(wanted)} but relations {sorted(given)}")
    return sa.text(_PLACEHOLDER.sub(lambda m: given[m.group(1)], sql))


def relation_exists(conn: sa.Connection, name: str) -> bool:
    """Whether the relation `name` (``schema.table``, quoted as `qualified` gives it) exists."""
    query = load("enrichq_schema", "sql/catalog.sql")("catalog_relation_exists")
    present: bool = conn.execute(query, {"name": name}).scalar_one()
    return present
