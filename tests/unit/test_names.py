"""One name, one thing: no two classes of the four packages share a name, so a reader (or an
import) never takes one for the other."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("service/enrichq_service", "sweeper/enrichq_sweeper", "parity/enrichq_parity",
            "schema/enrichq_schema")  # fmt: skip


def test_no_two_classes_share_a_name() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(str(path.relative_to(REPO)))
    assert len(where) > 100
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_one_create_engine() -> None:
    """`db.create_engine` takes explicit options; `connections.engine_from_settings` builds
    them from the settings: one name each."""
    defined = [
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.FunctionDef) and node.name == "create_engine"
    ]
    assert defined == ["schema/enrichq_schema/db.py"]
