"""What every enrichq process shares: its exit codes, who it is, how it stops, and how it
loads a plug-in named in its settings."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum
from types import FrameType
from typing import Any

from enrichq_schema.errors import EnrichqError

log = logging.getLogger(__name__)


class Exit(IntEnum):
    """The exit codes of every `enrichq` command."""

    OK = 0
    FAILED = 1  # it ran and failed, or refused (a gate, a bar not met, nothing to resume)
    USAGE = 2  # bad input or configuration: one line says which, nothing changed
    INTERRUPTED = 130  # Ctrl-C: what was committed so far stays


def process_id() -> str:
    """This process as the run log and the sweeper's leadership name it: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def lease_owner() -> str:
    """A lease owner unique to one worker runtime: host:pid and a random suffix (a worker
    started again in the same process, as tests do, is a new owner)."""
    return f"{process_id()}:{uuid.uuid4().hex[:6]}"


@contextmanager
def stop_on_signals(stop: threading.Event, *, doing: str = "stopping") -> Iterator[None]:
    """SIGTERM and SIGINT set `stop` while inside (only the main thread may install
    handlers: elsewhere this does nothing); the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("received %s: %s", signal.Signals(signum).name, doing)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class PluginError(EnrichqError):
    """A plug-in path that names no callable."""


def load_callable(path: str) -> Callable[..., Any]:
    """The callable that `path` ("package.module:function") names; PluginError saying why
    not (the caller adds which setting it was)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise PluginError(f"{path!r}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{path!r}: cannot import {module_name}: {exc}") from None
    target = getattr(module, attr, None)
    if target is None:
        raise PluginError(f"{path!r}: {module_name} has no function {attr}")
    if not callable(target):
        raise PluginError(f"{path!r}: {module_name}.{attr} is not callable")
    return target  # type: ignore[no-any-return]  # getattr's result, checked callable above
