"""The service's exceptions; an enrichment raises these to tell the queue what to do."""

from __future__ import annotations

from datetime import datetime

from enrichq_schema.errors import EnrichqError


class ServiceError(EnrichqError):
    """Unexpected enrichq service error."""


class TransientError(ServiceError):
    """The enrichment failed in a way worth retrying."""


class PermanentError(ServiceError):
    """The enrichment can never succeed for this job (bad payload, unknown kind)."""


class Deferral(ServiceError):
    """The work cannot run yet; put it back until `until` without spending an attempt."""

    def __init__(self, until: datetime, message: str | None = None) -> None:
        super().__init__(message)
        self.until = until
