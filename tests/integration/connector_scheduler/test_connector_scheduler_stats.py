"""What the connector reports under vLLM 0.32.0's real Scheduler, on CPU: the tokens each request
was served and their tier, and the connector stats vLLM's metrics read."""

from __future__ import annotations

from pathlib import Path

import pytest
from connector_scheduler_helpers import (
    store_then_serve,
    token_prompt,
)
from strata_harness import G

pytestmark = pytest.mark.integration


def test_a_finished_request_says_what_kvstrata_served_it_and_from_which_tier(runners, tmp_path: Path) -> None:
    """Per request, the tokens kvstrata served and their tier (``kv_transfer_params``), apart
    from vLLM's own prefix-cache hits: what the end-to-end tests count as "served"."""
    store = tmp_path / "persist"
    prompt = token_prompt(100)
    first = runners([G("full", 16)], store=store)
    cold = first.add(prompt, 1)
    first.run_until_idle()
    # vLLM's own prefix cache serves its 6 whole blocks (96 tokens), kvstrata only the tail.
    again = first.add(prompt, 1)
    first.run_until_idle()
    first.drop_gpu_prefix_cache()
    host = first.add(prompt, 1)
    first.run_until_idle()
    assert first.served[cold.request_id] == {} and first.served[again.request_id] == {"host": 4}
    assert first.served[host.request_id] == {"host": 100}
    first.close()
    second = runners([G("full", 16)], store=store)
    disk = second.add(prompt, 1)
    second.run_until_idle()
    assert second.served[disk.request_id] == {"disk": 100}


def test_a_tier_snapshot_alone_is_reported() -> None:
    # A refresh landing on a step where no counter moved must still reach /metrics.
    from kvstrata.connector.stats import StrataStats

    stats = StrataStats()
    assert stats.is_empty()
    stats.tiers = {"remote_available": 0, "host_chunks": 0}
    assert not stats.is_empty() and stats.data["remote_available"] == 0


def test_connector_stats_report_tiers_and_hits(runners) -> None:
    from kvstrata.connector.connector import StrataConnector

    r = runners([G("full", 16)])
    assert store_then_serve(r, token_prompt(100)) == 100  # 6 chunks + the 4-token prompt tail
    assert r.stats is not None and not r.stats.is_empty()
    data = r.stats.data
    assert data["hit_tokens"] == 100 and data["hit_tokens_host"] == 100 and data["hit_tokens_disk"] == 0
    assert data["store_jobs"] >= 1 and data["load_jobs"] == 1
    assert data["bytes_loaded"] > 0 and data["bytes_stored"] >= data["bytes_loaded"]
    assert data["host_chunks"] == 7
    # vLLM rebuilds the stats object from the dict in its logger process.
    rebuilt = StrataConnector.build_kv_connector_stats(data)
    assert rebuilt.reduce()["hit_tokens"] == 100
