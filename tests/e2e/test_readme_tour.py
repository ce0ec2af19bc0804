"""README's short tour, pasted line by line on real data: every line runs, none ends in a
traceback, and each exits 0 or with a documented refusal (1)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from tests.support.procs import REPO, enrichq_env
from tests.support.world import seeded

pytestmark = pytest.mark.slow


def tour_lines() -> list[str]:
    """The commands of README's tour block, comments stripped, `serve` (runs until stopped)
    left out."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## A short tour\n.*?```sh\n(.*?)```", text, re.S)
    assert block is not None, "README has no tour block"
    lines = []
    for raw in block.group(1).splitlines():
        line = re.sub(r"\s+#.*$", "", raw).strip()
        if line and not line.startswith("enrichq serve"):
            lines.append(line)
    return lines


def test_the_tour_has_no_placeholder_or_alternative() -> None:
    for line in tour_lines():
        assert not re.search(r"[\[\]|…]", line), f"not a command as it stands: {line}"


def test_every_tour_line_runs_without_a_traceback(
    db_url: str, db_engine: sa.Engine, tmp_path: Path
) -> None:
    seeded(db_engine, 40, tenant="acme")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "enrichq").write_text(f'#!/bin/sh\nexec {sys.executable} -m enrichq_service "$@"\n')
    (shim / "enrichq").chmod(0o755)
    env = enrichq_env(db_url)
    env["PATH"] = f"{shim}:/usr/bin:/bin"
    for line in tour_lines():
        done = subprocess.run(
            ["/bin/sh", "-c", line],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        out = done.stdout + done.stderr
        assert "Traceback" not in out, f"{line}\n{out[-3000:]}"
        assert done.returncode in (0, 1), f"{line}: exit {done.returncode}\n{out[-3000:]}"
