"""Standard Webhooks signatures (`webhook-id`, `webhook-timestamp`, `webhook-signature`),
beside enrichq's own (http.sign/verify). Pure functions: no I/O."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass

from enrichq_schema.settings import STANDARD_WEBHOOKS_PREFIX, standard_webhooks_key

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
_UNIX_SECONDS = re.compile(r"\d{1,12}")
# at most this many signatures are tried (a rotation needs two or three)
MAX_SIGNATURES = 8


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refused request: its status, the events_total result label and a one-line reason."""

    status: int
    result: str
    detail: str


def is_standard_secret(secret: str) -> bool:
    """Whether an ENRICHQ_WEBHOOK_SECRET entry is a Standard Webhooks secret (`whsec_`)."""
    return secret.startswith(STANDARD_WEBHOOKS_PREFIX)


def sign_standard(secret: str, msg_id: str, timestamp: int | str, body: bytes) -> str:
    """The `v1,<base64>` signature of `body` with id `msg_id` sent at `timestamp`."""
    message = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(standard_webhooks_key(secret), message, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def verify_standard(
    secrets: Sequence[str],
    msg_id: str | None,
    timestamp: str | None,
    signatures: str | None,
    body: bytes,
    *,
    now: float,
    tolerance_seconds: float,
) -> Rejection | None:
    """None when one of the `v1` signatures signs `body` with one of the `whsec_` `secrets`
    and `timestamp` is within tolerance of `now`; otherwise why not (401)."""
    keys = [standard_webhooks_key(s) for s in secrets if is_standard_secret(s)]
    keys = [k for k in keys if k]
    if not keys:
        return Rejection(
            401,
            "unauthorized",
            "this service has no Standard Webhooks secret (a whsec_ entry of "
            "ENRICHQ_WEBHOOK_SECRET): it accepts no webhook-signature",
        )
    if not msg_id or not timestamp or not signatures:
        return Rejection(
            401,
            "unauthorized",
            f"missing {ID_HEADER}, {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header",
        )
    if not msg_id.isascii() or not timestamp.isascii() or "." in msg_id:
        return Rejection(401, "unauthorized", "signature does not match")
    message = f"{msg_id}.{timestamp}.".encode("ascii") + body
    expected = [hmac.new(k, message, hashlib.sha256).digest() for k in keys]
    given: list[bytes] = []
    for entry in signatures.split()[:MAX_SIGNATURES]:
        version, _, encoded = entry.partition(",")
        if version != "v1" or not encoded.isascii():
            continue  # v1a (asymmetric) and unknown versions are not ours to check
        try:
            given.append(base64.b64decode(encoded, validate=True))
        except ValueError:
            continue
    # every pair is compared (a list, not any() over a generator), so the time taken does
    # not say which secret or signature matched
    matches = [hmac.compare_digest(e, g) for e in expected for g in given]
    if not any(matches):
        return Rejection(401, "unauthorized", "signature does not match")
    if not _UNIX_SECONDS.fullmatch(timestamp):
        return Rejection(401, "unauthorized", f"{TIMESTAMP_HEADER} must be unix seconds")
    if abs(now - int(timestamp)) > tolerance_seconds:
        return Rejection(
            401,
            "stale",
            f"timestamp outside the ±{tolerance_seconds:g} s tolerance (replayed or clock skew)",
        )
    return None
