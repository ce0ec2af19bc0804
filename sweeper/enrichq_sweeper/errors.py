"""The sweeper's exceptions; each docstring is its default one-line message."""

from __future__ import annotations

from enrichq_schema.errors import EnrichqError


class SweeperError(EnrichqError):
    """Unexpected sweeper error."""


class HookError(SweeperError):
    """The gave-up hook cannot be loaded."""


class BackfillInputError(SweeperError):
    """The backfill cannot run on this input."""
