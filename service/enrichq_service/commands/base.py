"""What every command is given (settings, database, writers) and how it refuses."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO

from enrichq_schema.process import Exit
from enrichq_service.errors import ServiceError

if TYPE_CHECKING:
    import sqlalchemy as sa

    from enrichq_schema.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class CommandError(ServiceError):
    """A command refused or failed: its one line for the operator, and its exit code."""

    def __init__(self, message: str, code: int = Exit.USAGE) -> None:
        super().__init__(message)
        self.code = code


def refuse(message: str, code: int = Exit.USAGE) -> NoReturn:
    """Stop the command: `message` is said on stderr, `code` (default: bad input) returned."""
    raise CommandError(message, code)


@dataclass
class Context:
    """What every command gets: the settings (read lazily from the file given), the
    database, and the writers it renders to (stdout and stderr unless injected)."""

    config_file: Path | None
    stdout: TextIO | None = None
    stderr: TextIO | None = None
    _settings: Settings | None = None
    _url: str | None = None

    @classmethod
    def given(cls, settings: Settings, url: str, *, stdout: TextIO | None = None) -> Context:
        """A context of settings already read and a database already running (the demo's
        steps, tests)."""
        return cls(None, stdout=stdout, _settings=settings, _url=url)

    @property
    def out(self) -> TextIO:
        """Where the command's result goes."""
        return sys.stdout if self.stdout is None else self.stdout

    @property
    def err(self) -> TextIO:
        """Where progress and refusals go."""
        return sys.stderr if self.stderr is None else self.stderr

    @property
    def settings(self) -> Settings:
        """The process's settings, read once; logging is set up as they say on first use."""
        if self._settings is None:
            from enrichq_schema.settings import Settings, unknown_variables
            from enrichq_schema.text import EscapingFormatter

            self._settings = Settings.load(self.config_file)
            # every record one line, arguments escaped: keys stored before ingest refused
            # control characters must not forge log lines nor reach the terminal raw
            handler = logging.StreamHandler()
            handler.setFormatter(EscapingFormatter(LOG_FORMAT))
            logging.basicConfig(level=self._settings.log_level, handlers=[handler])
            # Alembic narrates every migration step at INFO; operators want the outcome.
            logging.getLogger("alembic").setLevel(logging.WARNING)
            logging.getLogger("httpx").setLevel(logging.WARNING)
            for line in unknown_variables(os.environ):
                logging.getLogger("enrichq_schema.settings").warning("%s", line)
        return self._settings

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """The database URL, starting the embedded PostgreSQL when none is configured."""
        from enrichq_service.embedded_postgres import database_url

        if self._url is not None:
            yield self._url
            return
        with database_url(self.settings.database_url) as url:
            yield url

    @contextlib.contextmanager
    def opened(
        self, application_name: str, *, statement_timeout: bool = True
    ) -> Iterator[sa.Engine]:
        """The one engine of a command (one connection), disposed of at the end; queries
        bounded by ENRICHQ_STATEMENT_TIMEOUT_SECONDS unless `statement_timeout` is False."""
        from enrichq_schema.connections import engine_from_settings

        settings = self.settings
        timeout = {"statement_timeout_seconds": settings.statement_timeout_seconds}
        with self.database() as url:
            engine = engine_from_settings(
                settings,
                url,
                application_name=application_name,
                pool_size=1,
                **(timeout if statement_timeout else {}),
            )
            try:
                yield engine
            finally:
                engine.dispose()
