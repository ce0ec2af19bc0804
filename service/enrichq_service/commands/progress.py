"""How a long command shows it is working, on stderr: the confirmation an action over
every row asks first, and the progress of an action or a backfill (a rich bar on a
terminal, a plain line now and then otherwise). rich loads only when a bar is shown."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TextIO

import click

if TYPE_CHECKING:
    from enrichq_service.controls.actions import ActionResult

# A plain line of progress at most this often when stderr is not a terminal (seconds).
PROGRESS_LINE_SECONDS = 5.0
PLAIN_EVERY_PAGES = 10
"""Without a terminal, one backfill progress line per this many pages."""


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal a person reads (and types answers into)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream is not one
        return False


def confirm_every_row(command: str, *, yes: bool) -> Callable[[ActionResult], bool] | None:
    """The confirmation `command --all` asks on a terminal before it changes anything:
    None (no question) with --yes or when stdin is not a terminal (a script's run)."""
    if yes or not is_terminal(sys.stdin):
        return None

    def ask(would: ActionResult) -> bool:
        what = "row" if would.filter.scope.value == "open" else "dead letter"
        states = ", ".join(f"{n:,} {s}" for s, n in would.states.items() if n)
        detail = f" ({states})" if states else ""
        plural = "" if would.matched == 1 else "s"
        if would.matched == 0:
            return True  # nothing to change: the run says so
        return click.confirm(
            f"{command} {would.matched:,} {what}{plural}{detail} matching --all?",
            default=False,
            err=True,
        )

    return ask


class Progress:
    """Rows done and their rate while an action works its batches, on stderr: a rich bar on
    a terminal, a plain line every PROGRESS_LINE_SECONDS otherwise (and one at the end).
    Shown only for a run of more than one batch."""

    def __init__(self, command: str, *, batch_size: int, stream: TextIO | None = None) -> None:
        self.command = command
        self.batch_size = batch_size
        self.stream = stream if stream is not None else sys.stderr
        self.total = 0
        self._started = 0.0
        self._last_line = 0.0
        self._bar: Any = None
        self._task: Any = None

    def start(self, would: ActionResult) -> None:
        """The action selected `would.matched` rows and is about to work them."""
        self.total = would.matched
        self._started = self._last_line = time.monotonic()
        if self.total <= self.batch_size or not is_terminal(self.stream):
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import (
            Progress as Bar,
        )

        self._bar = Bar(
            TextColumn(self.command),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rows, {task.fields[rate]:,.0f} rows/s"),
            TimeElapsedColumn(),
            console=Console(file=self.stream),
        )
        self._task = self._bar.add_task(self.command, total=self.total, rate=0.0)
        self._bar.start()

    def batch(self, n: int, totals: Mapping[str, int]) -> None:
        """Batch `n` committed."""
        if self.total <= self.batch_size:
            return
        done = min(n * self.batch_size, self.total)
        now = time.monotonic()
        rate = done / max(now - self._started, 1e-6)
        if self._bar is not None:
            self._bar.update(self._task, completed=done, rate=rate)
        elif done == self.total or now - self._last_line >= PROGRESS_LINE_SECONDS:
            self._last_line = now
            print(
                f"enrichq: {self.command}: {done:,}/{self.total:,} rows, {rate:,.0f} rows/s",
                file=self.stream,
                flush=True,
            )

    def stop(self) -> None:
        """The action ended (done, stopped or interrupted)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextmanager
def progress_display(total: int, out: TextIO) -> Iterator[Callable[[int], None]]:
    """A callback advancing a progress display by the tickets of a page: a rich bar on a
    terminal, a plain line every few pages otherwise (a log or a pipe)."""
    if out.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        with Progress(
            "backfill",
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=Console(file=out),
            transient=True,
        ) as bar:
            task = bar.add_task("tickets", total=total)
            yield lambda n: bar.advance(task, n)
        return
    done = [0, 0]

    def line(n: int) -> None:
        done[0] += n
        done[1] += 1
        if done[1] % PLAIN_EVERY_PAGES == 0:
            print(f"backfill: {done[0]:,}/{total:,} tickets read", file=out, flush=True)

    yield line
