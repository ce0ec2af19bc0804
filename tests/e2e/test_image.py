"""deploy/Dockerfile's image, built unchanged and run as the Kubernetes manifests run it
(uid 10001, read-only root, /tmp in memory, no capabilities, 512 MiB): migrate, the
migration gate, enqueue, a draining worker, status, parity's JSON and serve's /readyz,
against a database of the test server's own.

Marked `image` (and `slow`): CI runs it; `-m "not image"` leaves it out, and without a
container runtime that can run (podman or docker) it skips and says why. The first build
takes minutes; the base and the image are cached (tests/support/image.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from tests.support import image
from tests.support.db import q
from tests.support.pg import Databases
from tests.support.procs import wait_for
from tests.support.web import answers, free_port

from enrichq_schema.db import create_engine
from enrichq_service import seed

pytestmark = [pytest.mark.image, pytest.mark.slow]
COMMAND_SECONDS = 180


@pytest.fixture(scope="module")
def runtime(databases: Databases) -> image.Runtime:
    host = make_url(databases.admin_url).host
    if not host or host.startswith("/"):  # the embedded server, on a Unix socket
        pytest.skip("the container reaches the test server over TCP: set ENRICHQ_TEST_DATABASE_URL")
    found = image.find_runtime()
    if isinstance(found, str):
        pytest.skip(f"no container runtime can run here: {found}")
    return found


@pytest.fixture(scope="module")
def built(runtime: image.Runtime) -> str:
    try:
        return image.build(runtime)
    except RuntimeError as e:  # no base image can be made here (not the Dockerfile's fault)
        pytest.skip(f"no Python base image for the build: {e}")


@pytest.fixture
def empty_url(databases: Databases) -> str:
    """A database with nothing in it, on the test server."""
    return databases.create_empty("image")


class Container:
    """`enrichq ARGS` in the image with the manifests' security settings; every container
    it starts is removed at the end."""

    def __init__(self, runtime: image.Runtime, tag: str, env: dict[str, str], out: Path):
        self.runtime, self.tag, self.env, self.out = runtime, tag, env, out
        self.names: list[str] = []

    def _args(self, name: str, *extra: str) -> list[str]:
        self.names.append(name)
        envs = [f"--env={k}={v}" for k, v in self.env.items()]
        return [
            "run",
            f"--name={name}",
            *image.RUN_FLAGS,
            *image.SECURITY_FLAGS,
            f"--volume={self.out}:/out",
            *envs,
            *extra,
            self.tag,
        ]

    def run(self, *args: str) -> tuple[int, str, str]:
        name = f"enrichq-test-{uuid.uuid4().hex[:12]}"
        # --rm: the runtime removes it even if this process dies before remove_all.
        done = self.runtime(*self._args(name, "--rm"), *args, timeout=COMMAND_SECONDS)
        self.runtime.remove_container(name)
        return done.returncode, done.stdout, done.stderr

    def start(self, *args: str, env: dict[str, str]) -> str:
        name = f"enrichq-test-{uuid.uuid4().hex[:12]}"
        envs = [f"--env={k}={v}" for k, v in env.items()]
        done = self.runtime(*self._args(name, "--detach", *envs), *args, timeout=COMMAND_SECONDS)
        assert done.returncode == 0, done.stderr
        return name

    def logs(self, name: str) -> str:
        done = self.runtime("logs", name, timeout=image.PROBE_SECONDS)
        return (done.stdout + done.stderr)[-3000:]

    def remove_all(self) -> None:
        for name in self.names:
            self.runtime.remove_container(name)


@pytest.fixture
def container(
    runtime: image.Runtime, built: str, empty_url: str, tmp_path: Path
) -> Iterator[Container]:
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # the container's uid 10001 writes parity's report here
    # The host's network: no port of a worker's /metrics may collide with another run's.
    env = {
        "ENRICHQ_DATABASE_URL": empty_url,
        "ENRICHQ_LOG_LEVEL": "WARNING",
        "ENRICHQ_METRICS_PORT": "0",
    }
    box = Container(runtime, built, env, out)
    try:
        yield box
    finally:
        box.remove_all()


def test_the_image_runs_every_command_under_the_manifests_security_settings(
    container: Container, empty_url: str
) -> None:
    # The migration gate says "behind" on an empty database, then migrate brings it to head.
    code, _, err = container.run("migrate", "--check")
    assert code == 1, err
    code, _, err = container.run("migrate")
    assert code == 0, err
    code, _, err = container.run("migrate", "--check", "--wait", "30")
    assert code == 0, err

    engine = create_engine(empty_url, pool_size=1)
    try:
        with engine.begin() as conn:
            seed.seed_world(conn, tickets=20)
            keys = list(
                conn.execute(sa.text("SELECT id FROM helpdesk.tickets ORDER BY id")).scalars()
            )
        code, _, err = container.run("enqueue", *keys)
        assert code == 0, err
        assert q(engine, "SELECT count(*) FROM enrichq.queue WHERE state = 'queued'") == [
            (len(keys),)
        ]

        code, _, err = container.run("worker", "--drain")
        assert code == 0, err
        assert q(engine, "SELECT state, count(*) FROM enrichq.queue GROUP BY state") == [
            ("done", len(keys))
        ]

        code, out, err = container.run("status", "--json")
        assert code == 0, err
        assert json.loads(out)

        # Parity's exit is its verdict (0 pass, 1 below the bars); the report is the point.
        code, _, err = container.run("parity", "--json", "/out/parity.json")
        assert code in (0, 1), err
        report = json.loads((container.out / "parity.json").read_text(encoding="utf-8"))
        assert report

        port = free_port()
        name = container.start(
            "serve",
            env={
                "ENRICHQ_HTTP_HOST": "127.0.0.1",
                "ENRICHQ_HTTP_PORT": str(port),
                "ENRICHQ_WEBHOOK_SECRET": "image-test-secret-not-for-production",
            },
        )
        try:
            try:
                wait_for(
                    lambda: answers(f"http://127.0.0.1:{port}/readyz"),
                    timeout=90,
                    interval=0.5,
                    what="serve's /readyz in the container",
                )
            except AssertionError as e:
                raise AssertionError(f"{e}; its log:\n{container.logs(name)}") from None
        finally:
            stopped = container.runtime("stop", "--time=45", name, timeout=COMMAND_SECONDS)
            assert stopped.returncode == 0, stopped.stderr
        exited = container.runtime(
            "inspect", "--format", "{{.State.ExitCode}}", name, timeout=image.PROBE_SECONDS
        )
        assert exited.stdout.strip() == "0", container.logs(name)
    finally:
        engine.dispose()
