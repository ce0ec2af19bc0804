"""The command line: help everywhere, one-line refusals with exit 2."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

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
    ["dlq", "discard"],
    ["cancel"],
    ["pause"],
    ["resume"],
    ["audit"],
    ["parity"],
    ["parity", "approve"],
    ["parity", "runs"],
    ["parity", "show"],
    ["cutover"],
    ["backfill"],
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
    assert "backfill" in out
    assert "demo" in out
    for name in ("cancel", "pause", "resume", "audit"):
        assert name in out


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
        ["enqueue", "w\u001b[2J\nFAKE LOG LINE"],
        ["enqueue", "T-1", "--tenant", "acme\u200b"],
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


def test_an_unknown_variable_is_warned_about_at_start_up() -> None:
    proc = run(
        "status",
        env={
            "ENRICHQ_DATABASE_URL": "postgresql://u@127.0.0.1:1/none?connect_timeout=2",
            "ENRICHQ_LEESE_SECONDS": "10",
        },
    )
    warned = [line for line in proc.stderr.splitlines() if "ENRICHQ_LEESE_SECONDS" in line]
    assert len(warned) == 1
    assert "WARNING" in warned[0]
    assert "not an enrichq setting: ignored (did you mean ENRICHQ_LEASE_SECONDS?)" in warned[0]
    assert proc.returncode == 1  # the command itself goes on (here, to an absent database)


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


def test_a_refused_key_is_not_echoed_raw(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["enqueue", "w\u001b[2J\nFAKE LOG LINE"]) == 2
    err = capsys.readouterr().err
    assert err == "enrichq: key: must not contain control or format characters (U+001B)\n"


def test_log_lines_escape_control_characters_in_their_arguments() -> None:
    code = (
        "import logging; from enrichq_service.cli import Context; Context(None).settings; "
        "logging.getLogger('enrichq_sweeper.recovery').warning("
        "'gave up on %s', 'w\\x1b[2J\\nFAKE LOG LINE')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENRICHQ_")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "\x1b" not in proc.stderr
    assert lines[0].endswith("gave up on w\\x1b[2J\\nFAKE LOG LINE")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ENRICHQ_DATABASE_URL": "postgresql://u@127.0.0.1:1/db?foo=bar"}, "'foo'"),
        ({"ENRICHQ_DATABASE_URL": "mysql://u@127.0.0.1/db"}, "PostgreSQL"),
        ({"ENRICHQ_DATABASE_URL": "sqlite:///x.db"}, "PostgreSQL"),
        ({"ENRICHQ_DATABASE_URL": "sqlite:"}, "ENRICHQ_DATABASE_URL"),
        ({"ENRICHQ_DATABASE_URL": "postgres://u@127.0.0.1/db"}, "postgresql://"),
        ({"ENRICHQ_WAREHOUSE_URL": "snowflake://account/db"}, "ENRICHQ_WAREHOUSE_URL"),
        ({"ENRICHQ_WAREHOUSE_URL": "mysql://u@127.0.0.1/db"}, "ENRICHQ_WAREHOUSE_URL"),
        ({"ENRICHQ_PARITY_DATABASE_URL": "postgresql://u@h/db?sslmod=require"}, "'sslmod'"),
    ],
    ids=lambda v: next(iter(v.values())) if isinstance(v, dict) else None,
)
def test_a_database_url_enrichq_cannot_use_is_one_line_and_exit_2(
    env: dict[str, str], expected: str
) -> None:
    proc = run("status", env={"ENRICHQ_DATABASE_URL": "postgresql://u@127.0.0.1:1/db", **env})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("enrichq: ")
    assert expected in lines[0]


def test_a_malformed_config_file_names_its_line(tmp_path: Path) -> None:
    cfg = tmp_path / "enrichq.toml"
    cfg.write_text("concurrency = 3\nmax_attempts = \n")
    proc = run("--config", str(cfg), "status")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(cfg) in lines[0]
    assert "line 2" in lines[0]


def test_serve_on_a_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run(
            "serve",
            env={
                "ENRICHQ_DATABASE_URL": "postgresql://u@127.0.0.1:1/db?connect_timeout=1",
                "ENRICHQ_HTTP_HOST": "127.0.0.1",
                "ENRICHQ_HTTP_PORT": str(port),
            },
        )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"127.0.0.1:{port}" in lines[0]
    assert "in use" in lines[0]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        # issue 31: each started, then broke later (422s, crashes, replay protection off)
        ("ENRICHQ_DELAY_CREATED_SECONDS", "inf"),
        ("ENRICHQ_LEASE_SECONDS", "nan"),
        ("ENRICHQ_POLL_SECONDS", "inf"),
        ("ENRICHQ_RETENTION_DAYS", "inf"),
        ("ENRICHQ_WEBHOOK_TOLERANCE_SECONDS", "inf"),
        # issue 25: past 2^31-1 ms, every lookup's statement_timeout was refused
        ("ENRICHQ_ATTEMPT_DEADLINE_SECONDS", "2147484"),
    ],
)
def test_a_number_that_would_break_later_stops_the_worker_at_start_up(
    name: str, value: str
) -> None:
    # an unreachable database: a worker that got past its settings would exit 1, not 2
    proc = run(
        "worker",
        "--drain",
        env={"ENRICHQ_DATABASE_URL": "postgresql://u@127.0.0.1:1/db", name: value},
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"enrichq: invalid setting {name}: ")


def test_an_infinite_number_in_the_config_file_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "enrichq.toml"
    cfg.write_text("delay_created_seconds = inf\n")  # TOML has inf and nan floats
    proc = run("--config", str(cfg), "status")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "ENRICHQ_DELAY_CREATED_SECONDS" in lines[0]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_long_run_on_a_terminal_shows_a_bar_with_rows_done_and_rate() -> None:
    from enrichq_schema.states import AuditCommand
    from enrichq_service.commands.progress import Progress
    from enrichq_service.controls.actions import ActionResult
    from enrichq_service.controls.filters import Filter, Scope

    screen = _Terminal()
    progress = Progress("cancel", batch_size=10, stream=screen)
    flt = Filter.build(Scope.OPEN, all_rows=True)
    progress.start(ActionResult(AuditCommand.CANCEL, flt, 25, {}, 0, True))
    for n in (1, 2, 3):
        progress.batch(n, {"queued": min(10 * n, 25)})
    progress.stop()
    shown = screen.getvalue()
    assert "25/25" in shown
    assert "rows/s" in shown
    assert "enrichq: cancel:" not in shown  # the bar, not plain lines


def test_a_run_of_one_batch_shows_no_progress() -> None:
    from enrichq_schema.states import AuditCommand
    from enrichq_service.commands.progress import Progress
    from enrichq_service.controls.actions import ActionResult
    from enrichq_service.controls.filters import Filter, Scope

    screen = _Terminal()
    progress = Progress("cancel", batch_size=10, stream=screen)
    progress.start(
        ActionResult(AuditCommand.CANCEL, Filter.build(Scope.OPEN, all_rows=True), 9, {}, 0, True)
    )
    progress.batch(1, {"queued": 9})
    progress.stop()
    assert screen.getvalue() == ""


def test_an_audit_filter_shows_only_the_options_given() -> None:
    """A pause of a tenant (no kind) read `kind=None tenant=acme`; options not given are
    left out."""
    from enrichq_service.commands.controls import describe_filter

    assert describe_filter({"kind": None, "tenant": "acme", "scope": "open"}) == "tenant=acme"
    assert describe_filter({"all": True, "ids": [], "dry_run": False}) == "all"
    assert describe_filter({"keys": ["T-1", "T-2"], "kind": "enrich"}) == "keys=T-1,T-2 kind=enrich"
