"""Helpers of the connector tests under vLLM 0.32.0's real Scheduler
(test_connector_scheduler_*.py here): prompts, store-then-serve, slowed disk reads, the check that
the host tier was released, and the partial-tail layout."""

from __future__ import annotations

from strata_harness import G, Runner

# Partial tails (R7, R30): FA16 + Mamba-align 16 hashed every 4 tokens (``prefix_match_unit=4``).
PARTIAL_TAIL = [G("full", 16), G("mamba", 16)]


def token_prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 + 10 for i in range(n)]


def store_then_serve(r: Runner, prompt: list[int], max_tokens: int = 1, again: list[int] | None = None) -> int:
    assert r.serve(prompt, max_tokens) == 0  # nothing stored yet
    r.drop_gpu_prefix_cache()
    served = r.serve(again or prompt, 1)
    assert r.load_errors == [], r.load_errors
    return served


def slow_disk_reads(monkeypatch, seconds: float) -> None:
    import time

    from kvstrata.tiers.disk import DiskStore

    real_get_into = DiskStore.get_into

    def slow_get_into(self, key, out):
        time.sleep(seconds)
        return real_get_into(self, key, out)

    monkeypatch.setattr(DiskStore, "get_into", slow_get_into)


def assert_host_tier_released(r: Runner) -> None:
    import time

    hierarchy = r.connector.scheduler.hierarchy
    deadline = time.monotonic() + 30  # write-behind to disk pins its slots until written
    while hierarchy.stats()["write_inflight_bytes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    st = hierarchy.stats()
    assert st["host"]["referenced"] == 0 and st["host"]["not_ready"] == 0, st["host"]
    assert st["promotions_inflight"] == 0 and st["stores_inflight"] == 0
    assert r.connector.scheduler._reqs == {}
