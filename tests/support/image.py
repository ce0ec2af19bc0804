"""The container image of deploy/Dockerfile, built and run as a user would, with podman or
docker: a container runtime that works here, a Python base image without a registry, and
the built image, both cached between runs.

No registry is pulled from: unless ENRICHQ_TEST_PYTHON_IMAGE names a base image the runtime
already has (or may pull), the base is a Debian bookworm made with `debootstrap
--variant=minbase` plus python3, pip and ca-certificates, shaped like `python:3.11-slim`
(pip installs into the system interpreter, `python` is python3) and imported as an image.
The Dockerfile itself is built unchanged, with only its `PYTHON_IMAGE` argument set.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import REPO

DOCKERFILE = REPO / "deploy" / "Dockerfile"
# What the Dockerfile copies into its build (its COPY lines), so the image's tag changes
# with any of them and a cached image is never stale.
BUILD_INPUTS = ("pyproject.toml", "README.md", "schema", "service", "sweeper", "parity")
BASE_PACKAGES = ("python3", "python3-pip", "python-is-python3", "ca-certificates")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# podman as it runs on sandboxed CI machines (rootful, hybrid cgroups, no systemd, no
# overlay mounts): crun refuses hybrid cgroups, so runc; its storage is a root of the
# cache's own, so the vfs driver never meets a user's overlay storage.
PODMAN_FLAGS = (
    "--storage-driver=vfs",
    "--cgroup-manager=cgroupfs",
    "--events-backend=file",
    "--runtime=runc",
)
# Explicit: the sandbox's own limits are not always ones a container may inherit.
RUN_FLAGS = (
    "--network=host",
    "--ulimit=nofile=20000:20000",
    "--ulimit=nproc=32768:32768",
)
# The Kubernetes manifests' securityContext and the largest memory limit they set.
SECURITY_FLAGS = (
    "--user=10001:10001",
    "--read-only",
    "--tmpfs=/tmp:rw,size=64m,mode=1777",
    "--cap-drop=ALL",
    "--security-opt=no-new-privileges",
    "--memory=512m",
)
PROBE_SECONDS = 60
DEBOOTSTRAP_SECONDS = 900
BUILD_SECONDS = 1500


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "enrichq" / "image-test"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(
    args: Sequence[str], *, timeout: float, input_path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`args` to the end, bounded by `timeout`; its output captured, never raising on exit."""
    with contextlib.ExitStack() as stack:
        stdin = stack.enter_context(input_path.open("rb")) if input_path else subprocess.DEVNULL
        return subprocess.run(
            list(args),
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


@dataclass(frozen=True)
class Runtime:
    """A container runtime's command with its global flags (podman's or docker's)."""

    argv: tuple[str, ...]

    @property
    def name(self) -> str:
        return Path(self.argv[0]).name

    def __call__(
        self, *args: str, timeout: float, input_path: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        return _run([*self.argv, *args], timeout=timeout, input_path=input_path)

    def has_image(self, tag: str) -> bool:
        return self("image", "inspect", tag, timeout=PROBE_SECONDS).returncode == 0

    def remove_container(self, name: str) -> None:
        self("rm", "--force", name, timeout=PROBE_SECONDS)


def find_runtime() -> Runtime | str:
    """The first of podman and docker that answers `info`, else why neither can run."""
    reasons: list[str] = []
    podman = shutil.which("podman")
    if podman is None:
        reasons.append("podman is not installed")
    else:
        storage = cache_dir() / "podman"
        runtime = Runtime(
            (
                podman,
                *PODMAN_FLAGS,
                f"--root={storage / 'root'}",
                f"--runroot={storage / 'run'}",
            )
        )
        if shutil.which("runc") is None:
            reasons.append("podman is installed but runc is not")
        else:
            answer = _probe(runtime)
            if answer is None:
                return runtime
            reasons.append(f"podman cannot run: {answer}")
    docker = shutil.which("docker")
    if docker is None:
        reasons.append("docker is not installed")
    else:
        runtime = Runtime((docker,))
        answer = _probe(runtime)
        if answer is None:
            return runtime
        reasons.append(f"docker cannot run: {answer}")
    return "; ".join(reasons)


def _probe(runtime: Runtime) -> str | None:
    try:
        done = runtime("info", timeout=PROBE_SECONDS)
    except subprocess.TimeoutExpired:
        return f"`{runtime.name} info` did not answer in {PROBE_SECONDS} s"
    return None if done.returncode == 0 else _last(done.stderr or done.stdout)


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One builder at a time per cache (two test runs must not build the same thing)."""
    with (cache_dir() / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _digest(parts: Sequence[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def base_image(runtime: Runtime) -> str:
    """A base image for PYTHON_IMAGE: ENRICHQ_TEST_PYTHON_IMAGE, else the debootstrapped
    one (made once, then cached as a tarball and as an image). Raises RuntimeError with
    the reason when it cannot be made."""
    named = os.environ.get("ENRICHQ_TEST_PYTHON_IMAGE")
    if named:
        return named
    recipe = f"bookworm minbase {' '.join(BASE_PACKAGES)} no EXTERNALLY-MANAGED"
    trust = _trust_store()
    key = _digest([recipe.encode(), trust.read_bytes() if trust else b""])
    tag = f"localhost/enrichq-test-base:{key}"
    with _locked("base"):
        if runtime.has_image(tag):
            return tag
        tarball = cache_dir() / f"base-{key}.tar"
        if not tarball.is_file():
            _debootstrap(tarball, trust)
        imported = runtime("import", str(tarball), tag, timeout=BUILD_SECONDS)
        if imported.returncode != 0:
            raise RuntimeError(f"{runtime.name} import failed: {_last(imported.stderr)}")
        _forget_older(runtime, keep=tag)
    return tag


def _trust_store() -> Path | None:
    """This machine's CA bundle, which the base trusts too: pip in the build then reaches
    PyPI as the host's pip does (through a TLS-intercepting proxy, if there is one)."""
    path = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
    return path if path.is_file() else None


def _debootstrap(tarball: Path, trust: Path | None) -> None:
    debootstrap = shutil.which("debootstrap") or shutil.which("/usr/sbin/debootstrap")
    if debootstrap is None:
        raise RuntimeError("debootstrap is not installed (it makes the Python base image)")
    if os.geteuid() != 0:
        raise RuntimeError("debootstrap needs root (it makes the Python base image)")
    with tempfile.TemporaryDirectory(prefix="enrichq-base-", dir=cache_dir()) as tmp:
        rootfs = Path(tmp) / "rootfs"
        made = _run(
            [
                debootstrap,
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            timeout=DEBOOTSTRAP_SECONDS,
        )
        if made.returncode != 0:
            raise RuntimeError(f"debootstrap failed: {_last(made.stdout + made.stderr)}")
        # Like python:3.11-slim: pip installs into the image's interpreter (PEP 668's marker
        # is Debian's, not the official image's), and no apt lists or caches are kept.
        for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        if trust is not None:
            shutil.copyfile(trust, rootfs / "etc" / "ssl" / "certs" / "ca-certificates.crt")
        shutil.rmtree(rootfs / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        shutil.rmtree(rootfs / "var" / "cache" / "apt", ignore_errors=True)
        partial = tarball.with_suffix(".partial")
        packed = _run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."],
            timeout=DEBOOTSTRAP_SECONDS,
        )
        if packed.returncode != 0:
            raise RuntimeError(f"tar of the base failed: {_last(packed.stderr)}")
        partial.rename(tarball)


def _input_files() -> Iterator[Path]:
    yield DOCKERFILE
    yield DOCKERFILE.with_name("Dockerfile.dockerignore")
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_file():
            yield path
            continue
        for child in sorted(path.rglob("*")):
            if child.is_file() and "__pycache__" not in child.parts:
                yield child


def image_tag(base: str) -> str:
    """The built image's tag: a digest of the base's name and of everything the build
    reads, so an unchanged tree reuses the image and any change builds a new one."""
    parts = [base.encode()]
    for path in _input_files():
        parts += [str(path.relative_to(REPO)).encode(), path.read_bytes()]
    return f"localhost/enrichq-test:{_digest(parts)}"


def build(runtime: Runtime) -> str:
    """The image of deploy/Dockerfile (built unless cached); its tag. Raises RuntimeError
    when no base can be made, AssertionError when the Dockerfile does not build."""
    base = base_image(runtime)
    tag = image_tag(base)
    with _locked("image"):
        if runtime.has_image(tag):
            return tag
        # podman: no intermediate layers (vfs copies the whole tree for each); this cache
        # keeps the finished image by its inputs' digest instead.
        layers = ("--layers=false",) if runtime.name == "podman" else ()
        built = runtime(
            "build",
            *layers,
            "--network=host",
            "--build-arg",
            f"PYTHON_IMAGE={base}",
            "-f",
            str(DOCKERFILE),
            "-t",
            tag,
            str(REPO),
            timeout=BUILD_SECONDS,
        )
        output = built.stdout[-4000:] + built.stderr[-4000:]
        assert built.returncode == 0, f"the image did not build:\n{output}"
        _forget_older(runtime, keep=tag)
    return tag


def _forget_older(runtime: Runtime, *, keep: str) -> None:
    """Remove the images this module made before `keep`, of the same name (vfs keeps
    whole copies of every layer)."""
    listed = runtime("images", "--format", "{{.Repository}}:{{.Tag}}", timeout=PROBE_SECONDS).stdout
    for line in listed.split():
        if line.partition(":")[0] == keep.partition(":")[0] and line != keep:
            runtime("rmi", "--force", line, timeout=PROBE_SECONDS)
    if runtime.name == "podman":
        runtime("image", "prune", "--force", timeout=PROBE_SECONDS)
