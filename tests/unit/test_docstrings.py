"""Module docstrings and SQL file headers say what a module or file is for in a few lines,
and carry no measured figures (history goes in commits, figures and the long account in
docs/modules.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("service/enrichq_service", "sweeper/enrichq_sweeper", "parity/enrichq_parity",
            "schema/enrichq_schema")  # fmt: skip
MAX_LINES = 5
# a ratio ("0.89x"), a share ("98%") or a rate ("1,200/s", "3 ms"): a measurement that goes
# stale in a docstring
FIGURE = re.compile(r"\b\d[\d.,]*\s*(?:x\b|%|/s\b|ms\b)")
QUERY_HEADER = re.compile(r"-- (?:name|fragment): ")


def modules() -> list[Path]:
    """Every module of the four packages except Alembic's revisions, whose docstring is
    Alembic's own header (message, revision ids)."""
    return sorted(
        path
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if "versions" not in path.relative_to(REPO / package).parts
    )


def sql_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.sql"))


def sql_header(path: Path) -> list[str]:
    """The comment lines before a file's first query or fragment."""
    header = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if QUERY_HEADER.match(line):
            break
        if line.startswith("--"):
            header.append(line)
    return header


def short(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_the_packages_and_sql_files_are_found() -> None:
    assert len(modules()) > 50
    assert len(sql_files()) > 10


@pytest.mark.parametrize("path", modules(), ids=short)
def test_a_module_docstring_says_what_the_module_is_for_in_a_few_lines(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source), clean=False)
    if not source.strip():
        return  # an empty __init__.py: a package marker, nothing to describe
    assert doc, f"{short(path)} has no module docstring"
    lines = doc.strip("\n").splitlines()
    assert len(lines) <= MAX_LINES, (
        f"{short(path)}: module docstring of {len(lines)} lines (at most {MAX_LINES}); "
        "the longer account belongs in docs/modules.md"
    )
    assert not FIGURE.search(doc), f"{short(path)}: a measured figure in the docstring"


@pytest.mark.parametrize("path", sql_files(), ids=short)
def test_a_sql_header_says_what_the_file_is_for_in_a_few_lines(path: Path) -> None:
    header = sql_header(path)
    assert header, f"{short(path)} has no header comment"
    assert len(header) <= MAX_LINES, (
        f"{short(path)}: header of {len(header)} lines (at most {MAX_LINES}); "
        "the longer account belongs in docs/modules.md"
    )
    assert not FIGURE.search("\n".join(header)), f"{short(path)}: a measured figure"


def test_the_guard_sees_a_long_docstring_and_a_figure() -> None:
    """The checks above can fail: a docstring past the bound, a ratio and a share."""
    long_doc = "\n".join(f"line {i}" for i in range(MAX_LINES + 1))
    assert len(long_doc.splitlines()) > MAX_LINES
    assert FIGURE.search("tickets/s 0.89x of the claim")
    assert FIGURE.search("busy 98% of the time")
    assert not FIGURE.search("DESIGN §3, issue 7, 30 days of done rows")
