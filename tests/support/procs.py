"""Real `enrichq` processes for end-to-end and chaos tests, and waiting with a deadline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def enrichq_env(db_url: str, **settings: object) -> dict[str, str]:
    """A clean environment for an `enrichq` child: the database and ENRICHQ_* overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENRICHQ_")}
    env["PYTHONPATH"] = str(REPO)
    env["ENRICHQ_DATABASE_URL"] = db_url
    env.setdefault("ENRICHQ_METRICS_PORT", "0")
    env.setdefault("ENRICHQ_LOG_LEVEL", "WARNING")
    # work visible the moment its delay ends unless a test sets a lookup window
    env.setdefault("ENRICHQ_LOOKUP_WINDOW_SECONDS", "0")
    for name, value in settings.items():
        env[name if name.startswith("ENRICHQ_") else f"ENRICHQ_{name.upper()}"] = str(value)
    return env


def spawn(
    args: list[str],
    env: Mapping[str, str],
    *,
    log: Path | None = None,
    new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """Start `python -m enrichq_service ARGS` (the `enrichq` command) in the repository;
    `new_session` makes it the leader of a process group of its own (its children's too),
    which a test can signal as a whole."""
    if log is None:
        return subprocess.Popen(
            [sys.executable, "-m", "enrichq_service", *args],
            cwd=REPO,
            env=dict(env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=new_session,
        )
    with log.open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "enrichq_service", *args],
            cwd=REPO,
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )


def wait_for(
    condition: Callable[[], T | None],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "",
) -> T:
    """Poll `condition` until it returns something truthy, and return that; fail after
    `timeout` seconds naming `what`. The one way every test waits."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what or condition}")
        time.sleep(interval)


def stop(proc: subprocess.Popen[Any], *, timeout: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def alive(pid: int) -> bool:
    """Is process `pid` running (a zombie is not)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
