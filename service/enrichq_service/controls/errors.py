"""The operator controls' exceptions; each docstring is its default one-line message."""

from __future__ import annotations

from enrichq_service.errors import ServiceError


class ControlError(ServiceError):
    """Unexpected operator-control error."""


class FilterError(ControlError):
    """Bad selection of queue rows."""


class DlqInputError(FilterError):
    """Bad dead-letter selection."""


class PauseError(ControlError):
    """Bad pause or resume input."""
