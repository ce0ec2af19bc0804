"""Which jobs are suspects (run in a child process): those whose previous attempt lost its
process, and those whose isolated child ran out of time while looking for a poison pill."""

from __future__ import annotations

import json

import pytest

from enrichq_schema.states import LEASE_EXPIRED_ERROR
from enrichq_service.enrich import ABORTED
from enrichq_service.errors import TransientError
from enrichq_service.isolate import CHILD_DIED, CHILD_RAN_PAST, STOPPED_ISOLATED, is_suspect


@pytest.mark.parametrize(
    "error",
    [
        LEASE_EXPIRED_ERROR,
        f"TransientError: {CHILD_DIED} (exit 3); the previous attempt lost its process too",
        f"PluginAborted: {ABORTED}: CancelledError",
        # the child ran past the attempt while halving its tickets around a poison pill:
        # before, these neighbours ran in-process beside it next time, and died with it
        f"TransientError: {CHILD_RAN_PAST} 4 s",
        # or the worker stopped it there, its deadline passed or at its shutdown
        f"attempt deadline of 2 s exceeded {STOPPED_ISOLATED}",
        f"worker shut down mid-attempt {STOPPED_ISOLATED}",
    ],
)
def test_a_job_whose_attempt_may_have_met_a_poison_pill_is_a_suspect(error: str) -> None:
    assert is_suspect(2, error)


def test_an_inconclusive_isolated_attempt_keeps_a_suspect_but_for_its_last_attempt() -> None:
    for error in (f"TransientError: {CHILD_RAN_PAST} 4 s", f"worker stopped {STOPPED_ISOLATED}"):
        assert is_suspect(2, error, 3)
        assert not is_suspect(3, error, 3)  # the last: in-process, not dead-lettered for it
    # a process that vanished is isolated to the end
    assert is_suspect(3, LEASE_EXPIRED_ERROR, 3)
    assert is_suspect(3, f"TransientError: {CHILD_DIED} (exit 13)", 3)


@pytest.mark.parametrize(
    "error", [None, "TransientError: warehouse busy", "attempt deadline of 300 s exceeded"]
)
def test_an_ordinary_failure_is_no_suspect(error: str | None) -> None:
    assert not is_suspect(2, error)
    assert not is_suspect(1, LEASE_EXPIRED_ERROR)  # the first attempt has no history


def test_a_surcharge_crosses_from_an_isolated_child_with_its_bytes() -> None:
    """Bytes billed under answers a batch was not asked for reach the parent with the
    ticket's own outcome, a result or an error alike (`enrich.Surcharge`)."""
    from enrichq_service.enrich import Enrichment, Missing, Order, Surcharge
    from enrichq_service.isolate import _answer, _outcome

    for value in (Enrichment((Order("O-1"),), job_id="j", bytes_billed=5), Missing("gone")):
        back = _outcome(json.loads(json.dumps(_answer(Surcharge(value, 3000, "q-1")))))
        assert isinstance(back, Surcharge)
        assert (back.bytes_billed, back.job_id) == (3000, "q-1")
        assert type(back.value) is (Enrichment if isinstance(value, Enrichment) else TransientError)
