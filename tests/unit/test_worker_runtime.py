"""The worker's one-line account of its work, logged every minute."""

from __future__ import annotations

from enrichq_schema import metrics
from enrichq_service.worker.runtime import RunCounts, Summary


def test_a_summary_counts_what_happened_since_the_last_one() -> None:
    tally = RunCounts()
    tally.add("claimed", 3)
    summary = Summary(tally, every=0.0)
    assert summary.due()
    tally.add("claimed", 50)
    tally.add("done", 48)
    tally.add("failed", 2)
    metrics.lookups_total.labels("ok").inc(1)
    metrics.warehouse_bytes_billed_total.inc(10_485_760)
    line = summary.line()
    assert line.startswith("worker: last ")
    assert "claimed 50, done 48, retry 0, failed 2, dead letter 0, deferred 0, lost 0" in line
    assert line.endswith("lookups 1, bytes billed 10,485,760")
    # the next line starts from there
    assert "claimed 0, done 0" in summary.line()
