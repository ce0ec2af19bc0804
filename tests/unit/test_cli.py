"""The command line: help everywhere, one-line refusals with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from enrichq_service.cli import main

COMMANDS = [
    ["migrate"],
    ["serve"],
    ["worker"],
    ["sweep"],
    ["enqueue"],
    ["status"],
    ["dlq"],
    ["dlq", "list"],
    ["dlq", "redrive"],
    ["parity"],
    ["parity", "approve"],
    ["parity", "runs"],
    ["parity", "show"],
    ["cutover"],
    ["demo"],
]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ENRICHQ_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", "from enrichq_service.cli import main; main()", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
        check=False,
    )


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("migrate", "serve", "worker", "sweep", "enqueue", "status", "dlq", "parity"):
        assert name in out
    assert "cutover" in out
    assert "demo" in out


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--help"]) == 0
    assert "Usage: enrichq" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["no-such-command"],
        ["migrate", "extra-argument"],
        ["serve", "--port", "80"],
        ["worker", "--time-budget", "-5"],
        ["worker", "--time-budget"],
        ["worker", "--drain", "yes"],
        ["sweep", "--once", "twice"],
        ["sweep", "--every", "5"],
        ["status", "--json", "out.json"],
        ["enqueue", "T-1", "--kind", "teleport"],
        ["enqueue", "T-1", "--tenant"],
        ["dlq"],
        ["dlq", "list", "--reason", "boredom"],
        ["dlq", "redrive", "--id", "abc"],
        ["parity", "--json"],
        ["parity", "--until", "31/12/2026"],
        ["cutover", "--actor"],
        ["cutover", "--force"],
        ["cutover", "--tenant"],
        ["cutover", "--status", "--rollback"],
        ["cutover", "--status", "--tenant", "acme"],
        ["cutover", "--json"],
        ["parity", "--accept"],
        ["parity", "--csv"],
        ["parity", "approve"],
        ["parity", "approve", "7"],
        ["parity", "approve", "seven", "--by", "alice"],
        ["parity", "approve", "0", "--by", "alice"],
        ["parity", "approve", "7", "--by"],
        ["parity", "runs", "--limit", "0"],
        ["parity", "show"],
        ["parity", "sign", "7"],
        ["parity", "--html", "p.html", "approve", "7", "--by", "alice"],
        ["demo", "--tickets", "5"],
        ["enqueue"],
        ["enqueue", "T-1", "--reason", "bogus"],
        ["dlq", "redrive"],
        ["dlq", "redrive", "--all", "--id", "3"],
        ["dlq", "list", "--limit", "0"],
        ["parity", "--since", "yesterday"],
        ["parity", "--since", "2026-02-01", "--until", "2026-01-01"],
        ["--config", "/nonexistent/enrichq.toml", "status"],
    ],
    ids=" ".join,
)
def test_bad_arguments_give_one_line_and_exit_2(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("enrichq: ")
    assert len(err.splitlines()) == 1


def test_bad_setting_names_it_and_exits_2() -> None:
    proc = run("status", env={"ENRICHQ_HEARTBEAT_SECONDS": "40"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "ENRICHQ_HEARTBEAT_SECONDS" in lines[0]
    assert "Traceback" not in proc.stderr


def test_unreachable_database_is_one_line_without_the_password() -> None:
    proc = run(
        "status",
        env={"ENRICHQ_DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/none?connect_timeout=2"},
    )
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "database unavailable" in proc.stderr
    assert "hunter2" not in proc.stderr + proc.stdout


def test_cli_start_imports_no_heavy_stacks() -> None:
    code = (
        "import sys; from enrichq_service.cli import cli; "
        "heavy = [m for m in ('fastapi', 'uvicorn', 'apscheduler', 'starlette', 'rich', "
        "'sqlalchemy', 'alembic') if m in sys.modules]; print(','.join(heavy))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert proc.stdout.strip() == ""
