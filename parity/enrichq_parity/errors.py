"""Parity's exceptions; each docstring is its default one-line message."""

from __future__ import annotations

from enrichq_schema.errors import EnrichqError


class ParityError(EnrichqError):
    """Unexpected parity error."""
