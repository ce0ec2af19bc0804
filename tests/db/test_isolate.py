"""The isolated child (enrichq_service.isolate) connects to the warehouse as the worker's
settings say, like every other enrichq engine: network timeouts and the pool mode."""

from __future__ import annotations

import pytest
from tests.support.settings import make_settings

from enrichq_schema.states import PoolMode
from enrichq_service.enrich import Ticket
from enrichq_service.isolate import enrich_in_child


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_the_isolated_child_connects_to_the_warehouse_as_the_settings_say(
    db_url: str, mode: PoolMode
) -> None:
    settings = make_settings(
        db_url,
        enricher="tests.support.enrichers:warehouse_session",
        network_timeout_seconds=7,
        pool_mode=mode,
    )
    ticket = Ticket("T-1", "someone@example.org", "acme", None, None)

    enrichment = enrich_in_child(settings, db_url, ticket, timeout=60)

    # prepare_threshold None: nothing prepared server-side behind a transaction pooler
    prepare = "None" if mode is PoolMode.TRANSACTION else str(2**31 - 1)
    assert [o.order_id for o in enrichment.orders] == [
        "tcp_user_timeout=7000",
        f"prepare={prepare}",
    ]
