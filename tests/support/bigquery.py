"""BigQuery for tests: the bqemulator on loopback, credentials that never leave it, and a
thin fault layer in front of it.

- `Emulator`: bqemulator (DuckDB-backed, REST), from the virtualenv `.ci/run` makes for it
  (`.bqemu`, or ENRICHQ_BQEMULATOR naming its executable), started with a HOME of its own
  holding the DuckDB extensions its packages ship, so it never downloads one.
- `TokenServer` and `credentials_file`: a service-account key whose token URI is a server
  on loopback answering every token request. Never leave credentials unset in a test:
  google-auth would look for the cloud's metadata server.
- `FaultLayer`: an HTTP proxy between the client and the emulator that records every
  request, and on demand fails requests with BigQuery's errors, holds them (a hung
  BigQuery), or keeps a job running for a while (a slow query) until it is cancelled. It
  also bills: the emulator reports no bytes, so the layer gives every query job BigQuery's
  10 MB minimum per table the query reads. That is the test's doing, never the product's.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import sqlglot
from sqlglot import exp

REPO = Path(__file__).resolve().parents[2]
MIN_BYTES_BILLED = 10 * 1024 * 1024  # BigQuery bills at least 10 MB per table read
PROJECT = "enrichq-test"


def emulator_executable() -> Path | None:
    named = os.environ.get("ENRICHQ_BQEMULATOR")
    path = Path(named) if named else REPO / ".bqemu" / "bin" / "bqemulator"
    return path if path.exists() else None


def require_emulator() -> Path:
    """The emulator's executable; without it the test fails in CI (which installs it, in
    .ci/run) and is skipped elsewhere, saying how to install it."""
    path = emulator_executable()
    if path is None:
        message = "bqemulator is not installed: run the BigQuery step of .ci/run (makes .bqemu)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _extensions_home(executable: Path, home: Path) -> None:
    """HOME/.duckdb/extensions/<version>/<platform>/: the extension files the emulator's
    virtualenv installed as packages (duckdb-extension-spatial, -avro)."""
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "")
    venv = executable.resolve().parent.parent
    for found in venv.glob("lib/python*/site-packages/duckdb_extension_*/extensions/v*/*"):
        target = home / ".duckdb" / "extensions" / found.parent.name / f"linux_{arch}"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(found, target / found.name)


class Emulator:
    """bqemulator on loopback, ephemeral (in memory), for one test session."""

    def __init__(self, workdir: Path) -> None:
        self.executable = require_emulator()
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Emulator:
        home = self.workdir / "home"
        _extensions_home(self.executable, home)
        with (self.workdir / "bqemulator.log").open("wb") as log:
            self._proc = self._start(home, log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"bqemulator exited: {(self.workdir / 'bqemulator.log').read_text()[-2000:]}"
                )
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", f"/bigquery/v2/projects/{PROJECT}/datasets")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.2)
        raise RuntimeError("bqemulator did not answer within 60 s")

    def _start(self, home: Path, log: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                str(self.executable),
                "start",
                "--rest-host",
                "127.0.0.1",
                "--rest-port",
                str(self.port),
                "--grpc-port",
                str(free_port()),
                "--project",
                PROJECT,
                "--log-level",
                "warning",
            ],
            env={**os.environ, "HOME": str(home)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class _TokenHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps({"access_token": "test", "expires_in": 3600, "token_type": "Bearer"})
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


class TokenServer:
    """Answers every OAuth token request with a token: the credentials' token URI."""

    def __enter__(self) -> TokenServer:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _TokenHandler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/token"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def credentials_file(path: Path, token_uri: str) -> Path:
    """A service-account key file (a key made here) whose tokens come from `token_uri`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    info = {
        "type": "service_account",
        "project_id": PROJECT,
        "private_key_id": "test",
        "private_key": pem,
        "client_email": f"enrichq@{PROJECT}.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }
    path.write_text(json.dumps(info))
    return path


# -- the fault layer

JOB_PATH = re.compile(r"/projects/[^/]+/(?:jobs|queries)/(?P<job>[^/?]+)")
INSERT_PATH = re.compile(r"/projects/[^/]+/jobs(?:\?|$)")
CANCEL_PATH = re.compile(r"/projects/[^/]+/jobs/(?P<job>[^/?]+)/cancel")


@dataclass
class Request:
    method: str
    path: str
    body: Any


@dataclass
class Fault:
    """Answer requests matching `method` and `path` (a regex) with BigQuery's error
    `reason` and HTTP `status`, `times` times (None: every time); `forward`: the request
    reaches the emulator all the same, only its answer is lost."""

    method: str
    path: str
    status: int
    reason: str
    times: int | None = 1
    forward: bool = False


@dataclass
class _Slow:
    inserted: float
    seconds: float
    cancelled: bool = False


@dataclass
class FaultLayer:
    """An HTTP proxy in front of the emulator (see the module's docstring)."""

    upstream: str
    requests: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    slow_seconds: float = 0.0  # the next `slow_jobs` query jobs inserted run this long
    slow_jobs: int = 0
    hang: str | None = None  # requests whose path matches this regex never get an answer
    billed: dict[str, int] = field(default_factory=dict)  # job id: bytes, as reported
    cancelled: list[str] = field(default_factory=list)
    _slow: dict[str, _Slow] = field(default_factory=dict)
    _queries: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _release: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> FaultLayer:
        layer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                layer._handle(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    # -- what tests read

    def jobs(self, since: int = 0) -> list[dict[str, Any]]:
        """The job resources the client inserted (from request number `since` on), in order."""
        return [
            r.body
            for r in self.requests[since:]
            if r.method == "POST" and INSERT_PATH.search(r.path) and isinstance(r.body, dict)
        ]

    def query_jobs(self, since: int = 0) -> list[dict[str, Any]]:
        return [j for j in self.jobs(since) if "query" in j.get("configuration", {})]

    # -- the proxy

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("content-length", 0) or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        path = h.path.removeprefix("/bigquery/v2")
        with self._lock:
            self.requests.append(Request(h.command, path, body))
            fault = self._fault_for(h.command, path)
        if self.hang and re.search(self.hang, path):
            self._release.wait()
            return
        if fault is not None:
            if fault.forward:
                self._forward(h.command, h.path, raw, h.headers)
                self._remember(h.command, path, body)
            error = {"code": fault.status, "message": f"injected {fault.reason}"}
            error["errors"] = [{"reason": fault.reason, "message": f"injected {fault.reason}"}]
            self._reply(h, fault.status, {"error": error})
            return
        if cancel := CANCEL_PATH.search(path):
            with self._lock:
                self.cancelled.append(cancel["job"])
                if (slow := self._slow.get(cancel["job"])) is not None:
                    slow.cancelled = True
        status, headers, payload = self._forward(h.command, h.path, raw, h.headers)
        self._remember(h.command, path, body)
        if status == 200 and payload:
            with contextlib.suppress(ValueError):
                payload = json.dumps(self._rewrite(path, json.loads(payload))).encode()
        self._reply_raw(h, status, headers, payload)

    def _remember(self, method: str, path: str, body: Any) -> None:
        """A query job the emulator was asked to run: its query (to bill), slow or not."""
        if method == "POST" and INSERT_PATH.search(path) and isinstance(body, dict):
            job_id = (body.get("jobReference") or {}).get("jobId")
            query = body.get("configuration", {}).get("query", {}).get("query")
            if job_id and query:
                with self._lock:
                    self._queries[job_id] = query
                    if self.slow_jobs > 0:
                        self.slow_jobs -= 1
                        self._slow[job_id] = _Slow(time.monotonic(), self.slow_seconds)

    def _fault_for(self, method: str, path: str) -> Fault | None:
        for fault in self.faults:
            if fault.method == method and re.search(fault.path, path):
                if fault.times is not None:
                    fault.times -= 1
                    if fault.times <= 0:
                        self.faults.remove(fault)
                return fault
        return None

    def _forward(
        self, method: str, path: str, raw: bytes, headers: Any
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        host, port = self.upstream.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            send = {k: v for k, v in headers.items() if k.lower() not in {"host", "connection"}}
            conn.request(method, path, body=raw or None, headers=send)
            response = conn.getresponse()
            payload = response.read()
            kept = [
                (k, v)
                for k, v in response.getheaders()
                if k.lower() not in {"content-length", "transfer-encoding", "connection"}
            ]
            return response.status, kept, payload
        finally:
            conn.close()

    def _rewrite(self, path: str, doc: Any) -> Any:
        """Bill finished query jobs; keep slow ones running until their time or a cancel."""
        if not isinstance(doc, dict):
            return doc
        match = JOB_PATH.search(path)
        job_id = (doc.get("jobReference") or {}).get("jobId") or (match and match["job"])
        if not job_id:
            return doc
        with self._lock:
            query = self._queries.get(job_id)
            slow = self._slow.get(job_id)
        if query is None:
            return doc
        running = (
            slow is not None
            and not slow.cancelled
            and time.monotonic() - slow.inserted < slow.seconds
        )
        billed = MIN_BYTES_BILLED * max(1, tables_read(query))
        if doc.get("kind") == "bigquery#job":
            status = doc.setdefault("status", {})
            if running:
                status.clear()
                status["state"] = "RUNNING"
                doc.get("statistics", {}).pop("endTime", None)
                doc.get("statistics", {}).pop("query", None)
            else:
                if slow is not None and slow.cancelled:
                    status.update(
                        state="DONE",
                        errorResult={"reason": "stopped", "message": "Job execution was cancelled"},
                        errors=[{"reason": "stopped", "message": "Job execution was cancelled"}],
                    )
                stats = doc.setdefault("statistics", {})
                stats["totalBytesProcessed"] = str(billed)
                stats.setdefault("query", {}).update(
                    totalBytesBilled=str(billed), totalBytesProcessed=str(billed)
                )
                with self._lock:
                    self.billed[job_id] = billed
        elif doc.get("kind") == "bigquery#getQueryResultsResponse":
            if running:
                return {
                    "kind": doc["kind"],
                    "jobReference": doc.get("jobReference"),
                    "jobComplete": False,
                }
            if slow is not None and slow.cancelled:
                return {
                    "error": {
                        "code": 400,
                        "message": "Job execution was cancelled",
                        "errors": [{"reason": "stopped", "message": "Job execution was cancelled"}],
                    }
                }
            doc["totalBytesProcessed"] = str(billed)
        return doc

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, doc: Any) -> None:
        FaultLayer._reply_raw(
            h, status, [("content-type", "application/json")], json.dumps(doc).encode()
        )

    @staticmethod
    def _reply_raw(
        h: BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]], payload: bytes
    ) -> None:
        h.send_response(status)
        for k, v in headers:
            h.send_header(k, v)
        h.send_header("content-length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)


def tables_read(query: str) -> int:
    """How many distinct tables a query reads (sqlglot's parse of BigQuery SQL)."""
    try:
        tree = sqlglot.parse_one(query, read="bigquery")
    except sqlglot.errors.ParseError:
        return 1
    return len({t.sql(dialect="bigquery") for t in tree.find_all(exp.Table)})


@contextlib.contextmanager
def bigquery_env(
    layer_url: str, credentials: Path, monkeypatch: pytest.MonkeyPatch | None = None
) -> Iterator[dict[str, str]]:
    """The environment a BigQuery client needs to reach the emulator through `layer_url`."""
    env = {"BIGQUERY_EMULATOR_HOST": layer_url, "GOOGLE_APPLICATION_CREDENTIALS": str(credentials)}
    if monkeypatch is not None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    yield env
