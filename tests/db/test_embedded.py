"""The embedded PostgreSQL launcher, against real server processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
import sqlalchemy as sa
from tests.support.procs import wait_for

from enrichq_service import embedded_postgres as embedded
from enrichq_service.embedded_postgres import (
    EmbeddedPostgres,
    EmbeddedPostgresError,
    default_data_dir,
)

pytestmark = [pytest.mark.db, pytest.mark.slow]

DEADLINE = 20.0

# Started in a separate interpreter that the test then kills with SIGKILL.
CHILD = """
import sys, time
from pathlib import Path
from enrichq_service.embedded_postgres import EmbeddedPostgres

base = Path(sys.argv[1])
EmbeddedPostgres(base).start()
pid = (base / "data" / "postmaster.pid").read_text().split()[0]
(base / "child.tmp").write_text(pid)
(base / "child.tmp").rename(base / "child.pid")
time.sleep(3600)
"""


def traversable_by_others(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


@pytest.fixture
def base_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh base directory the server user can reach."""
    if os.geteuid() != 0 or traversable_by_others(tmp_path):
        yield tmp_path / "pg"
        return
    # As root the server runs as `nobody`, which must reach the data directory. pytest's
    # tmp_path sits under /tmp/pytest-of-root (0700), and the launcher rightly never loosens
    # directories outside its base dir, so use a directory of our own right under /tmp (1777)
    # and let others traverse (not list) it, for tests whose base dir is nested inside it.
    path = Path(tempfile.mkdtemp(prefix="enrichq-test-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def socket_dir(url: str) -> Path:
    return Path(parse_qs(urlsplit(url).query)["host"][0])


def postmaster_pid(base: Path) -> int:
    return int((base / "data" / "postmaster.pid").read_text().split()[0])


def alive(pid: int) -> bool:
    """Alive and not a zombie: the launcher's own check."""
    return embedded.pid_alive(pid)


def processes_in(data_dir: Path) -> list[int]:
    """Live processes whose working directory is `data_dir` (postgres chdirs there)."""
    found = []
    target = data_dir.resolve()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path(os.readlink(entry / "cwd")) == target and alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def query(url: str, *statements: str) -> object:
    """Run `statements` in one transaction through SQLAlchemy; the last one's scalar."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            results = [conn.execute(sa.text(sql)) for sql in statements]
            return results[-1].scalar()
    finally:
        engine.dispose()


def test_start_serves_queries_and_stop_removes_process_and_socket(base_dir: Path) -> None:
    parent_mode = base_dir.parent.stat().st_mode
    pg = EmbeddedPostgres(base_dir)
    with pg:
        url = pg.url
        assert url.startswith("postgresql+psycopg://postgres@/postgres?host=")
        assert pg.start() == url, "start() is idempotent"
        assert query(url, "SELECT 1") == 1
        pid = postmaster_pid(base_dir)
        socket = socket_dir(url) / ".s.PGSQL.5432"
        assert alive(pid)
        assert socket.is_socket()
        # Unix socket only: nothing listens on TCP.
        assert query(url, "SHOW listen_addresses") == ""
    assert not alive(pid)
    assert not socket.exists()
    assert base_dir.parent.stat().st_mode == parent_mode
    pg.stop()  # idempotent
    with pytest.raises(EmbeddedPostgresError):
        _ = pg.url


def test_restart_reuses_the_data_directory(base_dir: Path) -> None:
    pg = EmbeddedPostgres(base_dir)
    url = pg.start()
    query(url, "CREATE TABLE kept (v int)", "INSERT INTO kept VALUES (42)", "SELECT 1")
    pg.stop()
    url = pg.start()
    try:
        assert query(url, "SELECT v FROM kept") == 42
    finally:
        pg.stop()


def test_long_base_dir_puts_the_socket_in_a_short_private_dir(base_dir: Path) -> None:
    deep = base_dir / ("d" * 60) / ("e" * 60)
    with EmbeddedPostgres(deep) as pg:
        sockets = socket_dir(pg.url)
        assert not sockets.is_relative_to(deep)
        assert len(os.fsencode(sockets / ".s.PGSQL.5432")) <= 107
        assert query(pg.url, "SELECT 1") == 1
    assert not sockets.exists()


def test_killed_parent_leaves_no_orphan_and_the_next_start_succeeds(base_dir: Path) -> None:
    package_root = Path(embedded.__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_root), env.get("PYTHONPATH")]))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(base_dir)], env=env, stdin=subprocess.DEVNULL
    )
    try:
        pid_file = base_dir / "child.pid"
        wait_for(
            lambda: pid_file.exists() or child.poll() is not None,
            what="the child's server",
            timeout=DEADLINE,
        )
        assert child.poll() is None, f"the child exited with {child.returncode}"
        pid = int(pid_file.read_text())
        assert alive(pid)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(DEADLINE)
    wait_for(
        lambda: not alive(pid), what=f"postmaster {pid} to die with its parent", timeout=DEADLINE
    )
    data_dir = base_dir / "data"
    wait_for(
        lambda: not processes_in(data_dir), what="the server's children to exit", timeout=DEADLINE
    )

    with EmbeddedPostgres(base_dir) as pg:
        assert query(pg.url, "SELECT 1") == 1


def test_a_live_server_on_the_same_data_dir_is_a_clear_error(base_dir: Path) -> None:
    with EmbeddedPostgres(base_dir) as first:
        with pytest.raises(EmbeddedPostgresError, match="in use by a running PostgreSQL") as info:
            EmbeddedPostgres(base_dir).start(timeout_seconds=2)
        assert "\n" not in str(info.value)
        assert query(first.url, "SELECT 1") == 1


def test_garbage_pg_version_is_a_clear_error(base_dir: Path) -> None:
    data_dir = base_dir / "data"
    data_dir.mkdir(parents=True)
    (data_dir / "PG_VERSION").write_text("nonsense\n")
    with pytest.raises(EmbeddedPostgresError, match="PG_VERSION") as info:
        EmbeddedPostgres(base_dir).start()
    assert "\n" not in str(info.value)
    assert "nonsense" in str(info.value)


def test_server_that_exits_during_start_reports_its_log(base_dir: Path) -> None:
    pg = EmbeddedPostgres(base_dir)
    pg.start()
    pg.stop()
    (base_dir / "data" / "postgresql.conf").unlink()
    with pytest.raises(EmbeddedPostgresError, match=r"postgresql\.conf") as info:
        pg.start(timeout_seconds=15)
    assert "\n" not in str(info.value)
    assert "exited during start-up" in str(info.value)
    assert not processes_in(base_dir / "data")


def test_default_data_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ENRICHQ_EMBEDDED_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == tmp_path / "explicit"
    monkeypatch.delenv("ENRICHQ_EMBEDDED_DIR")
    assert default_data_dir() == tmp_path / "xdg" / "enrichq" / "postgres"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/is/ignored")
    if os.geteuid() == 0:
        # the server runs as nobody, which cannot enter root's 0700 home
        assert default_data_dir() == Path("/var/lib/enrichq/postgres")
    else:
        assert default_data_dir() == Path.home() / ".local" / "share" / "enrichq" / "postgres"


def test_psycopg_reaches_the_socket_named_in_the_url(base_dir: Path) -> None:
    with EmbeddedPostgres(base_dir, port=6543) as pg:
        host = str(socket_dir(pg.url))
        assert pg.url.endswith("&port=6543")
        with psycopg.connect(host=host, port=6543, user="postgres", dbname="postgres") as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("postgres",)


def test_a_second_command_uses_the_embedded_server_another_runs(
    base_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`enrichq status` while `enrichq serve` runs on the embedded default: the second
    command connects to the running server (and leaves it running) instead of waiting for
    its data directory and failing."""
    from enrichq_service.embedded_postgres import database_url

    monkeypatch.setenv("ENRICHQ_EMBEDDED_DIR", str(base_dir))
    with EmbeddedPostgres(base_dir) as first:
        pid = postmaster_pid(base_dir)
        assert embedded.running_url(base_dir) == first.url
        with database_url(None) as url:
            assert query(url, "SELECT current_database()") == "enrichq"
        assert alive(pid)
        assert query(first.url, "SELECT 1") == 1
    assert embedded.running_url(base_dir) is None
