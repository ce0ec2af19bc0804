"""HTTP ingest ``POST /v1/events`` (and Zendesk's), ``/healthz``, ``/readyz`` and
``/metrics``: each request checked (framing, size, signature, timestamp, media type, body)
before its events are enqueued in one transaction, or none is."""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import json
import logging
import re
import socket
import threading
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.to_thread
import sqlalchemy as sa
import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import REGISTRY
from prometheus_client.exposition import choose_encoder
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic_core import from_json
from starlette.requests import ClientDisconnect

from enrichq_schema import metrics
from enrichq_schema.db import current_revision, head_revision
from enrichq_schema.errors import SettingsError
from enrichq_schema.settings import Settings
from enrichq_schema.states import EVENT_ID_MAX_LENGTH, KEY_MAX_LENGTH, Kind
from enrichq_schema.text import (
    REFUSED_CATEGORIES,
    id_problem,
    unsafe_character,
    validation_problem,
)
from enrichq_service import events as ingest
from enrichq_service import queue, signatures, zendesk
from enrichq_service.errors import ServiceError
from enrichq_service.http_guard import BodyBudget, Limits, guarded_protocol
from enrichq_service.observe import register_queue_collector, set_build_info
from enrichq_service.signatures import Rejection

log = logging.getLogger(__name__)

TIMESTAMP_HEADER = "X-Enrichq-Timestamp"
SIGNATURE_HEADER = "X-Enrichq-Signature"
MAX_BATCH_EVENTS = 1000
LISTEN_BACKLOG = 2048  # uvicorn's default
RETRY_AFTER_SECONDS = 5  # what a 503 asks the sender to wait
EVENT_RESULTS = (
    "accepted",
    "duplicate",
    "unauthorized",
    "stale",
    "too_large",
    "unsupported",
    "invalid",
    "unavailable",
    "ignored",
)
# RFC 3339 date-time: a date, a time and a zone; pydantic parses the values.
_RFC3339_SCHEMA = (
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})"
)
_RFC3339 = re.compile(_RFC3339_SCHEMA)
_UNIX_SECONDS = re.compile(r"\d{1,12}")
_SCHEMA_REF = "#/components/schemas/{model}"


class Event(BaseModel):
    """One help-desk ticket event."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str | None = Field(
        default=None,
        min_length=1,
        max_length=EVENT_ID_MAX_LENGTH,
        description="The help desk's event id. A redelivery of an id seen within "
        "ENRICHQ_EVENT_DEDUPE_HOURS is acknowledged as a duplicate and enqueues nothing.",
    )
    ticket_id: str = Field(
        min_length=1, max_length=KEY_MAX_LENGTH, description="The help desk's ticket id."
    )
    type: Literal["created", "updated"] = Field(description="What happened to the ticket.")
    tenant: str | None = Field(
        default=None, min_length=1, max_length=KEY_MAX_LENGTH, description="Brand or account."
    )
    occurred_at: AwareDatetime = Field(description="When it happened (RFC 3339, with a zone).")
    payload: dict[str, Any] | None = Field(
        default=None,
        description="Kept on the queue row: at most 64 KiB as JSON, and no NUL (\\u0000) in "
        "any string (PostgreSQL's jsonb cannot store it).",
    )

    @field_validator("ticket_id", "tenant")
    @classmethod
    def _an_id(cls, value: str | None) -> str | None:
        # the rule of `enrichq enqueue` too (enrichq_schema.text.id_problem)
        if value is not None and (problem := id_problem(value, KEY_MAX_LENGTH)):
            raise ValueError(problem)
        return value

    @field_validator("id")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise ValueError("must not be blank")
        if (bad := unsafe_character(value)) is not None:
            # terminal escapes, newlines (forged log lines), zero-width and bidi marks
            raise ValueError(f"must not contain control or format characters ({bad})")
        return value

    @field_validator("occurred_at", mode="before")
    @classmethod
    def _rfc3339(cls, value: object) -> object:
        if not isinstance(value, str) or not _RFC3339.fullmatch(value):
            raise ValueError("expected an RFC 3339 date-time such as 2024-05-01T12:00:00Z")
        return value

    @field_validator("payload")
    @classmethod
    def _plain_json(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # 1e999 parses as infinity, which Postgres jsonb refuses: reject it here, as input.
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            raise ValueError("numbers must be finite") from None
        return value


class EventBatch(BaseModel):
    """Up to 1,000 events, enqueued all or none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    events: list[Event] = Field(min_length=1, max_length=MAX_BATCH_EVENTS)


class EventResult(BaseModel):
    """What became of one event: a new queued row, merged into the one already queued, or
    a duplicate (its event id was seen recently: nothing enqueued; `id` is the row the
    first delivery went into, when known)."""

    ticket_id: str
    inserted: bool
    id: int | None
    duplicate: bool = False


class Accepted(BaseModel):
    """Every event of the request is in the queue, or was already (duplicates)."""

    accepted: int
    inserted: int
    merged: int
    duplicates: int = 0
    results: list[EventResult]


class ErrorBody(BaseModel):
    """Why a request was refused (one line)."""

    detail: str


class Ignored(BaseModel):
    """A verified Zendesk event that is not a ticket event: nothing enqueued."""

    ignored: str


class Health(BaseModel):
    """The process (healthz) or the process and its database (readyz) can serve."""

    status: str


def sign(secret: str, timestamp: int | str, body: bytes) -> str:
    """The X-Enrichq-Signature of `body` sent at `timestamp` (hex HMAC-SHA256)."""
    message = str(timestamp).encode("ascii") + b"." + body
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def verify(
    secrets: Sequence[str] | str | None,
    timestamp: str | None,
    signature: str | None,
    body: bytes,
    *,
    now: float,
    tolerance_seconds: float,
) -> Rejection | None:
    """None when `signature` signs `body` at a `timestamp` within tolerance of `now`, with
    any one of `secrets` (several during a key rotation)."""
    if isinstance(secrets, str):
        secrets = [secrets]
    if not secrets:
        return Rejection(
            401,
            "unauthorized",
            "this service has no webhook secret (ENRICHQ_WEBHOOK_SECRET): it accepts no events",
        )
    if not timestamp or not signature:
        return Rejection(
            401, "unauthorized", f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header"
        )
    given = signature.strip().lower().encode("utf-8", "replace")
    # every secret is compared (a list, not any() over a generator), so the time taken
    # does not say which one matched
    matches = [
        hmac.compare_digest(sign(secret, timestamp.strip(), body).encode("ascii"), given)
        for secret in secrets
        if timestamp.isascii()
    ]
    if not any(matches):
        return Rejection(401, "unauthorized", "signature does not match")
    if not _UNIX_SECONDS.fullmatch(timestamp.strip()):
        return Rejection(401, "unauthorized", f"{TIMESTAMP_HEADER} must be unix seconds")
    if abs(now - int(timestamp.strip())) > tolerance_seconds:
        return Rejection(
            401,
            "stale",
            f"timestamp outside the ±{tolerance_seconds:g} s tolerance (replayed or clock skew)",
        )
    return None


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON: application/json or application/<anything>+json,
    parameters (charset) allowed."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def unsupported(headers: Any) -> Rejection | None:
    """415 for a body that is not JSON (Content-Type) or not sent as it is (a
    Content-Encoding other than identity: a gzip body would be read as bytes that are no
    JSON), or None."""
    if not is_json(headers.get("content-type")):
        return Rejection(415, "unsupported", "Content-Type must be application/json")
    encoding = (headers.get("content-encoding") or "identity").strip().lower()
    if encoding != "identity":
        return Rejection(
            415,
            "unsupported",
            f"Content-Encoding {encoding[:40]!r} is not supported: send the body as it is",
        )
    return None


def parse_events(body: bytes) -> list[Event] | Rejection:
    """The events of a body (one event or a batch), or why it is invalid."""
    try:
        data = from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        return _invalid(f"body is not valid JSON: {exc}")
    if (key := ingest.duplicate_key(body)) is not None:
        return _invalid(f"body names the key {key!r} twice in one object")
    try:
        if isinstance(data, dict) and "events" in data:
            return list(EventBatch.model_validate(data).events)
        if isinstance(data, dict):
            return [Event.model_validate(data)]
    except ValidationError as exc:
        return _invalid(describe_validation_error(exc))
    return _invalid('body must be a JSON object: one event or {"events": [...]}')


def to_requests(
    events: Sequence[Event], *, default_id: str | None = None
) -> list[ingest.Delivery] | Rejection:
    """The deliveries of valid events (the queue's own checks may still refuse one).
    `default_id` (a Standard Webhooks webhook-id) dedupes a single event that has no id."""
    out: list[ingest.Delivery] = []
    for i, event in enumerate(events):
        event_id = event.id
        if (
            event_id is None
            and len(events) == 1
            and default_id is not None
            and len(default_id) <= EVENT_ID_MAX_LENGTH
            and unsafe_character(default_id) is None
        ):
            event_id = default_id
        payload: dict[str, Any] = {"occurred_at": event.occurred_at.isoformat()}
        if event.payload is not None:
            payload["payload"] = event.payload
        try:
            request = queue.EnqueueRequest.build(
                key=event.ticket_id,
                kind=Kind.ENRICH.value,
                reason=event.type,
                tenant=event.tenant,
                payload=payload,
            )
            out.append(ingest.Delivery(event_id, request))
        except queue.QueueInputError as exc:
            where = f"events[{i}]." if len(events) > 1 else ""
            return _invalid(f"{where}{exc}")
    return out


def describe_validation_error(exc: ValidationError) -> str:
    """One line: the first error's location and message (never the input), and how many more."""
    return validation_problem(exc.errors(include_input=False, include_url=False))


def _invalid(detail: str) -> Rejection:
    return Rejection(422, "invalid", " ".join(detail.split())[:500])


def _refuse(rejection: Rejection) -> JSONResponse:
    metrics.events_total.labels(rejection.result).inc()
    # a 503 says when to try again: the help desk redelivers, and redelivery is harmless
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if rejection.status == 503 else None
    return JSONResponse({"detail": rejection.detail}, status_code=rejection.status, headers=headers)


async def _read_body(request: Request, limit: int, budget: BodyBudget) -> bytes | Response:
    """The body, held against `budget` (the caller gives it back), or the answer to a body
    that is too large (413), that would pass the bytes every request may hold before its
    signature is checked (503), or that never came (400)."""
    declared = request.headers.get("content-length", "")
    too_large = Rejection(413, "too_large", f"body larger than {limit} bytes")
    if declared.isdigit() and int(declared) > limit:
        return _refuse(too_large)
    busy = Rejection(503, "unavailable", "too many request bodies in flight; retry later")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            if size + len(chunk) > limit:
                budget.give_back(size)
                return _refuse(too_large)
            if not budget.take(len(chunk)):
                budget.give_back(size)
                log.warning("request bodies in flight reached ENRICHQ_HTTP_MAX_BUFFERED_BYTES")
                return _refuse(busy)
            size += len(chunk)
            chunks.append(chunk)
    except ClientDisconnect:
        budget.give_back(size)
        return JSONResponse({"detail": "client disconnected"}, status_code=400)
    return b"".join(chunks)


async def _zendesk(
    request: Request, settings: Settings, engine: sa.Engine, budget: BodyBudget
) -> Response:
    """POST /v1/zendesk: size, Zendesk's signature and timestamp, media type, body; then
    the ticket event is enqueued (deduplicated on its event id) or ignored (2xx)."""
    body = await _read_body(request, settings.max_body_bytes, budget)
    if isinstance(body, Response):
        return body
    try:
        return await _zendesk_body(request, body, settings, engine)
    finally:
        budget.give_back(len(body))


async def _zendesk_body(
    request: Request, body: bytes, settings: Settings, engine: sa.Engine
) -> Response:
    headers = request.headers
    stamp = headers.get(zendesk.TIMESTAMP_HEADER)
    rejection = zendesk.verify(
        settings.zendesk_signing_secrets,
        stamp,
        headers.get(zendesk.SIGNATURE_HEADER),
        body,
        now=time.time(),
        tolerance_seconds=settings.webhook_tolerance_seconds,
    )
    sent_at = zendesk.parse_timestamp(stamp or "")
    if rejection is not None or sent_at is None:
        return _refuse(rejection or Rejection(401, "unauthorized", "bad timestamp"))
    if (problem := unsupported(headers)) is not None:
        return _refuse(problem)
    event = zendesk.parse(
        body,
        tenant_field=settings.zendesk_tenant_field,
        invocation_id=headers.get(zendesk.INVOCATION_HEADER),
        sent_at=sent_at,
    )
    if isinstance(event, Rejection):
        return _refuse(event)
    if isinstance(event, zendesk.NotATicketEvent):
        metrics.events_total.labels("ignored").inc()
        return JSONResponse({"ignored": event.zendesk_type}, status_code=200)
    delivery = zendesk.to_delivery(event)
    if isinstance(delivery, Rejection):
        return _refuse(delivery)
    results = await _enqueue_within(engine, settings, [delivery])
    if isinstance(results, Rejection):
        return _refuse(results)
    return _accepted([event.ticket_id], results)


def _enqueue(
    engine: sa.Engine, settings: Settings, deliveries: list[ingest.Delivery]
) -> list[ingest.DeliveryResult] | Rejection:
    """Enqueue every delivery that is not a redelivery, in one transaction."""
    try:
        with engine.begin() as conn:
            return ingest.enqueue(conn, deliveries, settings=settings)
    except sa.exc.DataError as exc:
        # Input our checks let through and Postgres refused: the client's fault, not ours.
        log.warning("the database refused an event: %s", type(exc.orig).__name__)
        return _invalid("an event was refused by the database (invalid text or value)")
    except sa.exc.SQLAlchemyError as exc:
        # Connection lost, pool exhausted, schema missing: the client may retry later.
        log.warning("enqueue failed: %s", type(getattr(exc, "orig", None) or exc).__name__)
        return Rejection(503, "unavailable", "database unavailable; retry later")


async def _enqueue_within(
    engine: sa.Engine, settings: Settings, deliveries: list[ingest.Delivery]
) -> list[ingest.DeliveryResult] | Rejection:
    """`_enqueue`, answered within ENRICHQ_INGEST_DATABASE_TIMEOUT_SECONDS: a database that
    accepts connections and never answers makes a 503 with Retry-After, not a help desk's
    timeout. The abandoned attempt goes on in its thread until the connection's own
    timeouts end it; if it commits after all, the redelivery is a duplicate or merges."""
    bound = settings.ingest_database_timeout_seconds
    # the threads of starlette's threadpool (anyio's limiter, 40), as before; abandoned on
    # timeout instead of awaited
    with anyio.move_on_after(bound):
        return await anyio.to_thread.run_sync(
            _enqueue, engine, settings, deliveries, abandon_on_cancel=True
        )
    log.warning("enqueue took longer than %g s: answered 503", bound)
    return Rejection(503, "unavailable", "database did not answer in time; retry later")


def _accepted(
    events_ticket_ids: Sequence[str], results: list[ingest.DeliveryResult]
) -> JSONResponse:
    inserted = sum(r.inserted for r in results)
    duplicates = sum(r.duplicate for r in results)
    metrics.events_total.labels("accepted").inc(len(results) - duplicates)
    metrics.events_total.labels("duplicate").inc(duplicates)
    answer = Accepted(
        accepted=len(results),
        inserted=inserted,
        merged=len(results) - inserted - duplicates,
        duplicates=duplicates,
        results=[
            EventResult(ticket_id=t, inserted=r.inserted, id=r.id, duplicate=r.duplicate)
            for t, r in zip(events_ticket_ids, results, strict=True)
        ],
    )
    return JSONResponse(jsonable_encoder(answer), status_code=202)


async def _events(request: Request, body: bytes, settings: Settings, engine: sa.Engine) -> Response:
    """POST /v1/events once its body is read: signature (enrichq's or Standard Webhooks'),
    media type and encoding, events; then all of them enqueued in one transaction."""
    headers = request.headers
    secrets = [s for s in settings.webhook_secrets if not signatures.is_standard_secret(s)]
    standard_secrets = [s for s in settings.webhook_secrets if signatures.is_standard_secret(s)]
    standard = SIGNATURE_HEADER not in headers and signatures.SIGNATURE_HEADER in headers
    if standard:
        rejection = signatures.verify_standard(
            standard_secrets,
            headers.get(signatures.ID_HEADER),
            headers.get(signatures.TIMESTAMP_HEADER),
            headers.get(signatures.SIGNATURE_HEADER),
            body,
            now=time.time(),
            tolerance_seconds=settings.webhook_tolerance_seconds,
        )
    else:
        rejection = verify(
            secrets,
            headers.get(TIMESTAMP_HEADER),
            headers.get(SIGNATURE_HEADER),
            body,
            now=time.time(),
            tolerance_seconds=settings.webhook_tolerance_seconds,
        )
    if rejection is not None:
        return _refuse(rejection)
    if (problem := unsupported(headers)) is not None:
        return _refuse(problem)
    events = parse_events(body)
    if isinstance(events, Rejection):
        return _refuse(events)
    requests = to_requests(
        events, default_id=headers.get(signatures.ID_HEADER) if standard else None
    )
    if isinstance(requests, Rejection):
        return _refuse(requests)
    results = await _enqueue_within(engine, settings, requests)
    if isinstance(results, Rejection):
        return _refuse(results)
    return _accepted([e.ticket_id for e in events], results)


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing, bad or stale signature."},
    413: {"model": ErrorBody, "description": "Body larger than ENRICHQ_MAX_BODY_BYTES."},
    400: {
        "model": ErrorBody,
        "description": "Both Content-Length and Transfer-Encoding (the connection is closed), "
        "or a body that never came.",
    },
    415: {
        "model": ErrorBody,
        "description": "Content-Type is not application/json, or Content-Encoding is not identity.",
    },
    422: {
        "model": ErrorBody,
        "description": "Not JSON (or a key twice in one object), or not one event or a batch "
        "of them.",
    },
    503: {
        "model": ErrorBody,
        "description": "The database is unavailable, or too many request bodies are in "
        "flight; nothing enqueued. Retry after the Retry-After header's seconds.",
        "headers": {
            "Retry-After": {
                "description": "Seconds to wait before retrying.",
                "schema": {"type": "integer"},
            }
        },
    },
}


def _char_class(chars: Sequence[int]) -> str:
    """The code points `chars` (ascending) as the inside of a regular expression's
    character class: ranges of \\uXXXX escapes in the BMP, the characters themselves past
    it (ECMA's \\u escapes name UTF-16 units only)."""
    parts: list[str] = []
    i = 0
    while i < len(chars):
        j = i
        while j + 1 < len(chars) and chars[j + 1] == chars[j] + 1:
            j += 1

        def one(c: int) -> str:
            return f"\\u{c:04x}" if c <= 0xFFFF else chr(c)

        parts.append(one(chars[i]) if i == j else f"{one(chars[i])}-{one(chars[j])}")
        i = j + 1
    return "".join(parts)


@functools.cache
def id_patterns() -> tuple[str, str]:
    """JSON Schema patterns of the id rule (`enrichq_schema.text.id_problem`: no control,
    format or surrogate character, not blank, no whitespace at either end) and of the event
    id rule (no such character, not blank), so a client that generates or checks bodies by
    the schema agrees with the server."""
    # Lone surrogates (Cs) are refused too, but no pattern can name them: a regular
    # expression over Unicode text (Rust's, ECMA's with the u flag) refuses the range.
    # JSON text reaches them only through \\uD800-style escapes, never as UTF-8.
    refused = [
        c for c in range(0x110000) if unicodedata.category(chr(c)) in REFUSED_CATEGORIES - {"Cs"}
    ]
    space = [c for c in range(0x110000) if chr(c).isspace()]
    bad = _char_class(refused)
    edge = _char_class(sorted(set(refused) | set(space)))
    return f"^[^{edge}](?:[^{bad}]*[^{edge}])?$", f"^[^{bad}]*[^{edge}][^{bad}]*$"


def _describe_ids(components: dict[str, Any]) -> None:
    """Put the rules that validators check in code into the Event schema: ids and tenants,
    event ids, and the RFC 3339 time."""
    key, event_id = id_patterns()
    props = components["Event"]["properties"]
    props["ticket_id"]["pattern"] = key
    props["tenant"]["anyOf"][0]["pattern"] = key
    props["id"]["anyOf"][0]["pattern"] = event_id
    props["occurred_at"]["pattern"] = f"^{_RFC3339_SCHEMA}$"


class _App(FastAPI):
    """FastAPI, with the request body that the ingest route parses itself in its schema."""

    def openapi(self) -> dict[str, Any]:
        schema = super().openapi()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        if "EventsBody" not in components:
            body = TypeAdapter(Event | EventBatch).json_schema(ref_template=_SCHEMA_REF)
            components.update(body.pop("$defs", {}))
            body["description"] = "One event, or a batch of 1 to 1,000 events."
            components["EventsBody"] = body
            _describe_ids(components)
        return schema


def create_app(
    settings: Settings,
    engine: sa.Engine,
    *,
    health: Callable[[], str | None] | None = None,
    degraded: Callable[[], str | None] | None = None,
) -> FastAPI:
    """The HTTP application: ingest, health, readiness and metrics over `engine`.

    `health`: why the process cannot go on (healthz 503), or None. `degraded`: why a part
    of it stopped while ingest goes on (readyz says so, still 200: events keep coming in),
    or None."""
    version = set_build_info(settings.mode.value)
    register_queue_collector(engine)
    for result in EVENT_RESULTS:
        metrics.events_total.labels(result)
    limit = settings.max_body_bytes
    budget = BodyBudget(settings.http_max_buffered_bytes)
    head = head_revision()
    no_secret = not settings.webhook_secrets and not settings.zendesk_signing_secrets
    if no_secret:
        log.warning(
            "neither ENRICHQ_WEBHOOK_SECRET nor ENRICHQ_ZENDESK_SIGNING_SECRET is set: "
            "every event is refused (401) until one is"
        )

    app = _App(
        title="enrichq",
        version=version,
        description="Ticket events in, enrichment queued; health and Prometheus metrics.",
    )
    app.state.http_limits = Limits.of(settings)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = validation_problem(list(exc.errors()))
        return JSONResponse({"detail": detail}, status_code=422)

    @app.post(
        "/v1/events",
        status_code=202,
        response_model=Accepted,
        responses={**_ERRORS},
        summary="Enqueue one ticket event or a batch (signed)",
        response_description="Every event is queued (inserted, or merged into a queued row).",
        openapi_extra={
            # Declared here, not as parameters: the route reads the headers and the raw body
            # itself, after the size check, so a missing header is a 401 and not a 422.
            "parameters": [
                {
                    "name": TIMESTAMP_HEADER,
                    "in": "header",
                    "required": True,
                    "description": "Unix seconds when the request was signed.",
                    "schema": {"type": "string", "pattern": "^[0-9]{1,12}$"},
                },
                {
                    "name": SIGNATURE_HEADER,
                    "in": "header",
                    "required": True,
                    "description": "Hex HMAC-SHA256 of '{timestamp}.{body}' keyed with "
                    "ENRICHQ_WEBHOOK_SECRET.",
                    "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                },
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _SCHEMA_REF.format(model="EventsBody")}}
                },
            },
        },
    )
    async def post_events(request: Request) -> Response:
        """Verify the signature, validate every event, enqueue them all in one transaction."""
        body = await _read_body(request, limit, budget)
        if isinstance(body, Response):
            return body
        try:
            return await _events(request, body, settings, engine)
        finally:
            budget.give_back(len(body))

    @app.post(
        "/v1/zendesk",
        status_code=202,
        response_model=Accepted,
        responses={
            200: {"model": Ignored, "description": "Verified, not a ticket event: ignored."},
            **_ERRORS,
        },
        summary="Enqueue a Zendesk webhook's ticket event (signed as Zendesk signs)",
        response_description="The ticket is queued (inserted, merged, or a duplicate).",
        openapi_extra={
            "parameters": [
                {
                    "name": zendesk.TIMESTAMP_HEADER,
                    "in": "header",
                    "required": True,
                    "description": "ISO-8601 time when Zendesk signed the request.",
                    "schema": {"type": "string"},
                },
                {
                    "name": zendesk.SIGNATURE_HEADER,
                    "in": "header",
                    "required": True,
                    "description": "base64 HMAC-SHA256 of timestamp + body keyed with "
                    "ENRICHQ_ZENDESK_SIGNING_SECRET.",
                    "schema": {"type": "string"},
                },
                {
                    "name": zendesk.INVOCATION_HEADER,
                    "in": "header",
                    "required": False,
                    "description": "Dedupes a trigger's delivery (events carry their own id).",
                    "schema": {"type": "string"},
                },
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"type": "object"}}},
            },
        },
    )
    async def post_zendesk(request: Request) -> Response:
        """Verify Zendesk's signature, map its ticket event, enqueue it (docs/zendesk.md)."""
        return await _zendesk(request, settings, engine, budget)

    @app.get(
        "/healthz",
        response_model=Health,
        responses={503: {"model": ErrorBody, "description": "The process cannot go on."}},
        summary="The process is alive and its worker makes progress (no database)",
    )
    async def healthz() -> Response:
        # `health` is the worker's: a part stopped on an error, or results waiting to be
        # settled for longer than a lease (enrichq_oldest_unsettled_seconds)
        problem = health() if health is not None else None
        if problem is not None:
            return JSONResponse({"detail": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(
        "/readyz",
        response_model=Health,
        responses={503: {"model": ErrorBody, "description": "Database down or not migrated."}},
        summary="The database answers and is migrated to this build's head",
    )
    def readyz() -> Response:
        try:
            with engine.connect() as conn:
                revision = current_revision(conn)
        except sa.exc.SQLAlchemyError as exc:
            cause = type(getattr(exc, "orig", None) or exc).__name__
            return JSONResponse(
                {"detail": f"database unreachable ({cause})"},
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        if revision != head:
            return JSONResponse(
                {
                    "detail": f"database at migration {revision or 'none'}, this build needs "
                    f"{head}: run `enrichq migrate`"
                },
                status_code=503,
            )
        problem = degraded() if degraded is not None else None
        if problem is not None:
            # ingest still accepts events (the help desk must not lose them): ready, and says
            # what stopped
            return JSONResponse({"status": "ingest only", "detail": problem})
        if no_secret:
            return JSONResponse(
                {
                    "status": "refusing every event",
                    "detail": "no webhook secret: set ENRICHQ_WEBHOOK_SECRET or "
                    "ENRICHQ_ZENDESK_SIGNING_SECRET",
                }
            )
        return JSONResponse({"status": "ok"})

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        summary="Prometheus exposition (text format; OpenMetrics on request)",
    )
    def prometheus_metrics(request: Request) -> Response:
        # Sync on purpose: the collector may query the database, so it runs in the threadpool.
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(REGISTRY), headers={"Content-Type": content_type})

    return app


@dataclass(frozen=True, slots=True)
class ServerThread:
    """A uvicorn server running in a thread of this process."""

    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Finish in-flight requests and stop."""
        self.server.should_exit = True
        self.thread.join(timeout)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); SettingsError, one line, when
    the address cannot be had, so `serve` on a port in use says so instead of a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restarts reuse TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SettingsError(
                f"ENRICHQ_HTTP_PORT: {host}:{port} is already in use (another enrichq serve?)"
            ) from None
        raise SettingsError(
            f"ENRICHQ_HTTP_HOST/ENRICHQ_HTTP_PORT: cannot listen on {host}:{port} "
            f"({exc.strerror or exc})"
        ) from None
    sock.setblocking(False)
    return sock


def start_server_thread(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    sock: socket.socket | None = None,
    timeout: float = 10.0,
) -> ServerThread:
    """Serve `app` with uvicorn in a daemon thread on `sock`, or on a socket bound to
    host:port here (port 0 picks a free one)."""
    if sock is None:
        sock = bind_socket(host, port)
    limits = getattr(app.state, "http_limits", None) or Limits.default()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        # h11 with the bounds of enrichq_service.http_guard, never httptools
        http=guarded_protocol(limits),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="enrichq-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise ServiceError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = sock.getsockname()[1]
    return ServerThread(server, thread, host, int(bound))
