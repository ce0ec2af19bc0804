"""Named SQL: each ``.sql`` file holds queries under ``-- name: x`` headers, loaded once
into statements (``prepared`` marks the claim loop's hot ones)."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources

import sqlalchemy as sa

_HEADER = re.compile(r"^--\s*(?P<kind>name|fragment):(?P<rest>.*)$", re.MULTILINE)
_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_FLAGS = frozenset({"prepared"})
# The execution option that makes `enrichq_schema.db`'s engines prepare a statement.
PREPARED_OPTION = "enrichq_prepared"
# A fragment reference: a line that is only {{name}}; the indent is kept for what replaces it.
_REFERENCE = re.compile(
    r"^(?P<indent>[ \t]*)\{\{\s*(?P<name>[a-z_][a-z0-9_]*)\s*\}\}[ \t]*$", re.MULTILINE
)
# A comment to the end of its line, or a string literal (its '' escapes included): text in
# which a ';' ends nothing.
_COMMENT_OR_LITERAL = re.compile(r"--[^\n]*|'(?:[^']|'')*'")
# What is left of a reference that was not alone on its line (or not a fragment name).
_STRAY_REFERENCE = re.compile(r"\{\{[^{}]*\}\}")


@dataclass(frozen=True, slots=True)
class Query:
    """One named statement: its text as SQLAlchemy `text()` and what its comment says.

    `sql` is the statement as it runs, its fragments spliced in; `fragments` names them in
    the order they stand (one included by another right after it).
    """

    name: str
    doc: str
    sql: str
    text: sa.TextClause
    prepared: bool = False
    fragments: tuple[str, ...] = ()


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
    """Split a file's text into its named queries, fragments spliced in; duplicate or empty
    names, and fragments that are undefined, defined twice, unused, circular, holding a ';'
    or named like a query, are errors."""
    headers = list(_HEADER.finditer(text))
    if not any(header["kind"] == "name" for header in headers):
        raise ValueError(f"{source}: no '-- name:' headers")
    written: dict[str, tuple[str, str, bool]] = {}
    fragments: dict[str, str] = {}
    for i, header in enumerate(headers):
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        name, *flags = header["rest"].split() or [""]
        what = "query" if header["kind"] == "name" else "fragment"
        if not _NAME.fullmatch(name):
            raise ValueError(f"{source}: {name!r} is not a {what} name")
        if name in (written if what == "query" else fragments):
            raise ValueError(f"{source}: {what} {name!r} is defined twice")
        doc, body = _split_doc(text[header.end() : end])
        if what == "fragment":
            fragments[name] = _fragment(source, name, flags, body)
            continue
        if unknown := set(flags) - _FLAGS:
            raise ValueError(f"{source}: query {name!r} has unknown flags {sorted(unknown)}")
        written[name] = (doc, body, "prepared" in flags)
    if both := sorted(set(written) & set(fragments)):
        raise ValueError(f"{source}: {both[0]!r} is the name of a query and of a fragment")
    queries: dict[str, Query] = {}
    used: set[str] = set()
    for name, (doc, body, prepared) in written.items():
        spliced, names = _splice(source, f"query {name!r}", body, fragments, ())
        used.update(names)
        sql = spliced.strip().rstrip(";")
        if not sql:
            raise ValueError(f"{source}: query {name!r} is empty")
        clause = sa.text(sql)
        if prepared:
            clause = clause.execution_options(**{PREPARED_OPTION: True})
        queries[name] = Query(name, doc, sql, clause, prepared, tuple(names))
    if unused := sorted(set(fragments) - used):
        raise ValueError(f"{source}: fragments {unused} are used by no query")
    return Queries(source, queries)


def _fragment(source: str, name: str, flags: list[str], body: str) -> str:
    """The text of fragment `name`, its lines indented relative to each other (the splice
    indents them); an error if it takes flags, is empty or holds a ';'."""
    if flags:
        raise ValueError(f"{source}: fragment {name!r} takes no flags, got {flags}")
    text = textwrap.dedent(body.strip("\n")).rstrip()
    if not text:
        raise ValueError(f"{source}: fragment {name!r} is empty")
    if ";" in _COMMENT_OR_LITERAL.sub("", text):
        raise ValueError(
            f"{source}: fragment {name!r} holds a ';': a fragment is part of one statement, "
            "and a ';' would end it"
        )
    return text


def _split_doc(block: str) -> tuple[str, str]:
    """A block's leading comment lines (its doc, joined) and the text after them, each line
    indented as written (a fragment is spliced in at the indentation of its reference)."""
    lines = block.splitlines()
    while lines and not lines[0].strip():
        del lines[0]
    doc_lines: list[str] = []
    sql_lines: list[str] = []
    for i, line in enumerate(lines):
        # the first line may be indented; the doc's later lines start the line
        comment = line.lstrip() if i == 0 else line
        if not sql_lines and comment.startswith("--"):
            doc_lines.append(comment.removeprefix("--").strip())
        else:
            sql_lines.append(line)
    return " ".join(doc_lines), "\n".join(sql_lines)


def _splice(
    source: str, owner: str, body: str, fragments: Mapping[str, str], including: tuple[str, ...]
) -> tuple[str, list[str]]:
    """`body` with each ``{{x}}`` line replaced by fragment x (its own references spliced
    too) at that line's indentation; and the fragments spliced, in the order they stand."""
    names: list[str] = []

    def fragment(reference: re.Match[str]) -> str:
        name = reference["name"]
        if name not in fragments:
            raise ValueError(f"{source}: {owner} uses fragment {name!r}, which is not defined")
        if name in including:
            chain = " -> ".join((*including, name))
            raise ValueError(f"{source}: fragment {name!r} includes itself ({chain})")
        text, inner = _splice(
            source, f"fragment {name!r}", fragments[name], fragments, (*including, name)
        )
        names.extend((name, *inner))
        return textwrap.indent(text, reference["indent"])

    spliced = _REFERENCE.sub(fragment, body)
    if stray := _STRAY_REFERENCE.search(spliced):
        raise ValueError(
            f"{source}: {owner} has {stray[0]!r}: a fragment reference is a fragment's name "
            "alone on its line"
        )
    return spliced, names


@cache
def load(package: str, filename: str) -> Queries:
    """The named queries of `filename` inside `package` (read once per process)."""
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    return parse(f"{package}/{filename}", text)
