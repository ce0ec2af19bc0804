"""`enrichq migrate --check [--wait S]`: the gate of the workers' and sweepers' init
containers, exit 0 at head, non-zero while the schema is behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic import command
from tests.support.pg import Databases
from tests.support.procs import enrichq_env, spawn

from enrichq_schema.db import alembic_config, head_revision
from enrichq_service.cli import main


@pytest.fixture
def empty_db(databases: Databases, request: pytest.FixtureRequest) -> str:
    label = "".join(c if c.isalnum() else "_" for c in request.node.name)[-40:]
    return databases.create_empty(label)


def check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], url: str, *args: str
) -> tuple[int, str, str]:
    monkeypatch.setenv("ENRICHQ_DATABASE_URL", url)
    code = main(["migrate", "--check", *args])
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def test_check_says_behind_until_the_migration_runs(
    empty_db: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    head = head_revision()
    code, _, err = check(monkeypatch, capsys, empty_db)
    assert (code, err) == (
        1,
        f"enrichq: migrate --check: the schema is at revision none, not {head} "
        "(run `enrichq migrate`)",
    )
    command.upgrade(alembic_config(empty_db), "0006")  # type: ignore[arg-type]
    code, _, err = check(monkeypatch, capsys, empty_db)
    assert code == 1
    assert "at revision 0006, not" in err
    command.upgrade(alembic_config(empty_db), "head")  # type: ignore[arg-type]
    assert check(monkeypatch, capsys, empty_db) == (0, f"the schema is at head ({head})", "")


def test_check_changes_nothing(
    empty_db: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    check(monkeypatch, capsys, empty_db)
    code, _, _ = check(monkeypatch, capsys, empty_db)
    assert code == 1  # still behind: the check migrated nothing


def test_check_waits_for_the_migration(empty_db: str, tmp_path: Path) -> None:
    waiting = spawn(
        ["migrate", "--check", "--wait", "120"], enrichq_env(empty_db), log=tmp_path / "w.log"
    )
    migrating = spawn(["migrate"], enrichq_env(empty_db), log=tmp_path / "m.log")
    assert migrating.wait(120) == 0
    assert waiting.wait(120) == 0
    assert "at head" in (tmp_path / "w.log").read_text()


def test_an_unreachable_database_fails_the_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "postgresql://postgres@127.0.0.1:1/none?connect_timeout=2"
    code, _, err = check(monkeypatch, capsys, url)
    assert code == 1
    assert err.startswith("enrichq: migrate --check: database unavailable:")
    assert "\n" not in err


def test_wait_goes_with_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["migrate", "--wait", "5"]) == 2
    assert capsys.readouterr().err == "enrichq: migrate: --wait goes with --check\n"
