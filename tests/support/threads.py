"""Racing calls on threads of one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_together(calls: list[Callable[[], T]], *, timeout: float = 60) -> list[T | BaseException]:
    """Run each call on its own thread, released together by a barrier; each one's result
    or exception, in order."""
    barrier = threading.Barrier(len(calls))
    results: list[T | BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            barrier.wait(timeout)
            results[i] = calls[i]()
        except BaseException as exc:  # reported to the test, which asserts on it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a racing call never finished"
    return results  # type: ignore[return-value]  # every slot filled: the threads all finished
