"""An enqueue request is checked where it enters: each bad field is refused by name."""

from __future__ import annotations

import pytest

from enrichq_service.queue import EnqueueRequest, QueueInputError


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
