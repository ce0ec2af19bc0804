"""Which jobs are suspects (run in a child process): those whose previous attempt lost its
process, and those whose isolated child ran out of time while looking for a poison pill."""

from __future__ import annotations

import pytest

from enrichq_schema.states import LEASE_EXPIRED_ERROR
from enrichq_service.enrich import ABORTED
from enrichq_service.isolate import CHILD_DIED, CHILD_RAN_PAST, is_suspect


@pytest.mark.parametrize(
    "error",
    [
        LEASE_EXPIRED_ERROR,
        f"TransientError: {CHILD_DIED} (exit 3); the previous attempt lost its process too",
        f"PluginAborted: {ABORTED}: CancelledError",
        # the child ran past the attempt while halving its tickets around a poison pill:
        # before, these neighbours ran in-process beside it next time, and died with it
        f"TransientError: {CHILD_RAN_PAST} 4 s",
    ],
)
def test_a_job_whose_attempt_may_have_met_a_poison_pill_is_a_suspect(error: str) -> None:
    assert is_suspect(2, error)


@pytest.mark.parametrize(
    "error", [None, "TransientError: warehouse busy", "attempt deadline of 300 s exceeded"]
)
def test_an_ordinary_failure_is_no_suspect(error: str | None) -> None:
    assert not is_suspect(2, error)
    assert not is_suspect(1, LEASE_EXPIRED_ERROR)  # the first attempt has no history
