"""The domain packages never talk to a terminal nor end the process: printing, exiting
and exit codes are the command line's (`enrichq_service.commands`). The import-linter
contract in pyproject.toml keeps rich and click out of them; this keeps out the rest."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOMAIN = ["enrichq_sweeper", "enrichq_parity", "enrichq_schema"]
# a print, an exit of the process, or a write to its own streams (a forked child's
# os._exit, before it execs, ends no enrichq process and is allowed)
TERMINAL = re.compile(r"\bprint\(|\bsys\.exit\b|\bsys\.(stdout|stderr)\b")


def offences(source: str) -> list[str]:
    """Each line of `source` that prints or exits, as `line N: text`."""
    return [
        f"line {number}: {line.strip()}"
        for number, line in enumerate(source.splitlines(), start=1)
        if TERMINAL.search(line)
    ]


def test_the_check_finds_what_it_forbids() -> None:
    source = "x = 1\nprint('a')\nsys.exit(2)\nsys.stderr.write('b')\nreprint(x)\n"
    assert offences(source) == [
        "line 2: print('a')",
        "line 3: sys.exit(2)",
        "line 4: sys.stderr.write('b')",
    ]


@pytest.mark.parametrize("package", DOMAIN)
def test_the_domain_never_prints_nor_exits(package: str) -> None:
    root = Path(importlib.import_module(package).__file__ or "").parent
    found = {
        str(path.relative_to(root)): lines
        for path in sorted(root.rglob("*.py"))
        if (lines := offences(path.read_text(encoding="utf-8")))
    }
    assert found == {}
