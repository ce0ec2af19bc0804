"""The wheel, installed without extras in a virtualenv of its own, runs the demo: every
runtime dependency is declared, and the package data (SQL, migrations, templates) ships."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest
from tests.support.procs import REPO

pytestmark = pytest.mark.slow


def run(args: list[str | Path], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # type: ignore[call-overload, no-any-return]  # kw are run()'s own
        [str(a) for a in args], capture_output=True, text=True, check=False, **kw
    )


def test_the_wheel_without_extras_runs_the_demo(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, REPO], timeout=300
    )
    assert built.returncode == 0, built.stderr
    [wheel] = dist.glob("enrichq-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python, enrichq = env_dir / "bin" / "python", env_dir / "bin" / "enrichq"
    installed = run([python, "-m", "pip", "install", "-q", wheel], timeout=900)
    assert installed.returncode == 0, installed.stderr
    # nothing of the test extra came along
    freeze = run([python, "-m", "pip", "list", "--format=freeze"], timeout=60).stdout
    packages = {line.partition("==")[0].lower() for line in freeze.splitlines()}
    assert "enrichq" in packages
    assert not packages & {"pytest", "hypothesis", "httpx2", "schemathesis"}

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENRICHQ_", "PYTHON"))}
    # the embedded server runs as `nobody`, who cannot enter pytest's tmp folders
    pg_dir = Path(tempfile.mkdtemp(prefix="enrichq-wheel-pg-", dir="/tmp"))
    pg_dir.chmod(0o711)
    env |= {"ENRICHQ_EMBEDDED_DIR": str(pg_dir), "ENRICHQ_HTTP_PORT": "0"}
    helped = run([enrichq, "demo", "--help"], env=env, cwd=tmp_path, timeout=60)
    assert helped.returncode == 0, helped.stderr
    assert "Usage: enrichq demo" in helped.stdout
    try:
        demo = run([enrichq, "demo"], env=env, cwd=tmp_path, timeout=600)
    finally:
        shutil.rmtree(pg_dir, ignore_errors=True)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
