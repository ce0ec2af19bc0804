"""Standard Webhooks: the signer against the spec's published test vector, and the verifier."""

from __future__ import annotations

import pytest

from enrichq_schema.errors import SettingsError
from enrichq_schema.settings import Settings
from enrichq_service.signatures import sign_standard, verify_standard

# the test vector of standard-webhooks/standard-webhooks (libraries/*/tests: TestWebhookSign)
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def check(signatures: str, *, secrets: list[str] | None = None, now: float = VECTOR_TS) -> object:
    return verify_standard(
        secrets or [VECTOR_SECRET],
        VECTOR_ID,
        str(VECTOR_TS),
        signatures,
        VECTOR_BODY,
        now=now,
        tolerance_seconds=300,
    )


def test_the_signer_gives_the_spec_test_vector() -> None:
    assert sign_standard(VECTOR_SECRET, VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIGNATURE


def test_one_valid_signature_of_several_verifies() -> None:
    other = "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4="
    asymmetric = "v1a,hnO3f9T8Ytu9HwrXslvumlUpqtNVqkhqw/enGzPCXe5BdqzCInXqYXFymVJaA7AZdpXwVLPo3mNl8EM+m7TBAg=="
    assert check(f"{other} {asymmetric} {VECTOR_SIGNATURE}") is None


@pytest.mark.parametrize(
    "signatures",
    [
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLawdd",  # the spec's bad signature
        "v2," + VECTOR_SIGNATURE.removeprefix("v1,"),
        VECTOR_SIGNATURE.removeprefix("v1,"),
        "v1,not base64!",
        "",
    ],
)
def test_a_bad_signature_is_refused(signatures: str) -> None:
    rejection = check(signatures)
    assert rejection is not None
    assert getattr(rejection, "status", None) == 401


def test_a_stale_timestamp_is_refused() -> None:
    rejection = check(VECTOR_SIGNATURE, now=VECTOR_TS + 301)
    assert getattr(rejection, "result", None) == "stale"


def test_only_whsec_secrets_verify_standard_signatures() -> None:
    assert check(VECTOR_SIGNATURE, secrets=["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]) is not None


def test_a_whsec_secret_must_be_base64() -> None:
    with pytest.raises((SettingsError, ValueError)):
        Settings.load(webhook_secret="plain-secret, whsec_!!!")
