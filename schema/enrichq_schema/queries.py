"""Named SQL: each ``.sql`` file holds queries under ``-- name: x`` headers, loaded once."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources

import sqlalchemy as sa

_HEADER = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Query:
    """One named statement: its text as SQLAlchemy `text()` and what its comment says."""

    name: str
    doc: str
    sql: str
    text: sa.TextClause


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
        name = header["name"]
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
        queries[name] = Query(name, " ".join(doc_lines), sql, sa.text(sql))
    return Queries(source, queries)


@cache
def load(package: str, filename: str) -> Queries:
    """The named queries of `filename` inside `package` (read once per process)."""
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    return parse(f"{package}/{filename}", text)
