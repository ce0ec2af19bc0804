"""The queue's pure core: an enqueue request is checked where it enters (each bad field is
refused by name), and a retry's backoff is computed from its attempts and a random draw."""

from __future__ import annotations

import random

import pytest

from enrichq_service.queue import EnqueueRequest, QueueInputError, backoff_seconds


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"key": ""}, "key"),
        ({"key": "x" * 201}, "key"),
        ({"key": "a\x00b"}, "key"),
        ({"key": "T", "kind": "nope"}, "kind"),
        ({"key": "T", "reason": "because"}, "reason"),
        ({"key": "T", "tenant": ""}, "tenant"),
        ({"key": "T", "payload": {"x": object()}}, "payload"),
    ],
)
def test_bad_enqueue_input_is_refused(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(QueueInputError, match=f"^{field}"):
        EnqueueRequest.build(**kwargs)  # type: ignore[arg-type]  # bad input on purpose


@pytest.mark.parametrize(
    ("attempts", "full"),
    [(0, 5.0), (1, 10.0), (3, 40.0), (6, 300.0), (100, 300.0), (10_000, 300.0)],
)
def test_backoff_doubles_up_to_the_cap_with_half_to_full_jitter(attempts: int, full: float) -> None:
    def at(u: float) -> float:
        return backoff_seconds(attempts, base_seconds=5, cap_seconds=300, draw=lambda: u)

    assert at(0.0) == full / 2
    assert at(0.5) == full * 3 / 4
    assert full / 2 < at(0.999999) < full


def test_backoff_draws_its_jitter_from_the_source_it_is_given() -> None:
    def delays(seed: int) -> list[float]:
        draw = random.Random(seed).random
        return [backoff_seconds(a, base_seconds=5, cap_seconds=300, draw=draw) for a in range(1, 9)]

    assert delays(7) == delays(7)
    assert delays(7) != delays(8)
    for attempts, delay in enumerate(delays(7), start=1):
        full = min(300, 5 * 2**attempts)
        assert full / 2 <= delay < full
    # a zero base never waits, whatever the cap
    assert backoff_seconds(50, base_seconds=0, cap_seconds=300, draw=lambda: 0.9) == 0
