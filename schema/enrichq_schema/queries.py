"""Named SQL: each ``.sql`` file holds queries under ``-- name: x`` headers, loaded once.

A header may end in ``prepared`` (``-- name: queue_claim_batch prepared``): that statement
runs as a server-side prepared statement on each connection (see `enrichq_schema.db`), so
Postgres parses it once per connection and may keep its plan. Only the hot statements of
the claim loop are marked; everything else is planned with its real parameter values.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources

import sqlalchemy as sa

_HEADER = re.compile(r"^--\s*name:(?P<rest>.*)$", re.MULTILINE)
_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_FLAGS = frozenset({"prepared"})
# The execution option that makes `enrichq_schema.db`'s engines prepare a statement.
PREPARED_OPTION = "enrichq_prepared"


@dataclass(frozen=True, slots=True)
class Query:
    """One named statement: its text as SQLAlchemy `text()` and what its comment says."""

    name: str
    doc: str
    sql: str
    text: sa.TextClause
    prepared: bool = False


class Queries(Mapping[str, Query]):
    """The statements of one file, by name; a missing name is a KeyError naming the file."""

    def __init__(self, source: str, queries: dict[str, Query]) -> None:
        self._source = source
        self._queries = queries

    def __getitem__(self, name: str) -> Query:
        try:
            return self._queries[name]
        except KeyError:
            raise KeyError(f"no query named {name!r} in {self._source}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._queries)

    def __len__(self) -> int:
        return len(self._queries)

    def __call__(self, name: str) -> sa.TextClause:
        """The executable statement named `name`."""
        return self[name].text


def parse(source: str, text: str) -> Queries:
    """Split a file's text into its named queries; duplicate or empty names are errors."""
    headers = list(_HEADER.finditer(text))
    if not headers:
        raise ValueError(f"{source}: no '-- name:' headers")
    queries: dict[str, Query] = {}
    for i, header in enumerate(headers):
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        body = text[header.end() : end].strip()
        name, *flags = header["rest"].split() or [""]
        if not _NAME.fullmatch(name):
            raise ValueError(f"{source}: {name!r} is not a query name")
        if unknown := set(flags) - _FLAGS:
            raise ValueError(f"{source}: query {name!r} has unknown flags {sorted(unknown)}")
        if name in queries:
            raise ValueError(f"{source}: query {name!r} is defined twice")
        doc_lines: list[str] = []
        sql_lines: list[str] = []
        for line in body.splitlines():
            if not sql_lines and line.startswith("--"):
                doc_lines.append(line.removeprefix("--").strip())
            else:
                sql_lines.append(line)
        sql = "\n".join(sql_lines).strip().rstrip(";")
        if not sql:
            raise ValueError(f"{source}: query {name!r} is empty")
        prepared = "prepared" in flags
        clause = sa.text(sql)
        if prepared:
            clause = clause.execution_options(**{PREPARED_OPTION: True})
        queries[name] = Query(name, " ".join(doc_lines), sql, clause, prepared)
    return Queries(source, queries)


@cache
def load(package: str, filename: str) -> Queries:
    """The named queries of `filename` inside `package` (read once per process)."""
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    return parse(f"{package}/{filename}", text)
